"""The cost of call-site tracing: the same one-process loops on an untraced and a traced table.

    python tools/bench.py trace [--ops 100000] [--rounds 5]

Runs claim+abort and the local cycle (claim -> write -> publish -> take -> read ->
release of the small row, benchkit/shm.py) on two tables made side by side, one
with `trace=True`, alternating rounds so drift hits both alike; prints medians in ns
and the difference per call.  The histograms are in both (they are always on): their
cost is measured against a checkout without them by `python tools/bench.py ab`.
"""

from __future__ import annotations

import statistics

from shmslots import SlotTable

from . import command_parser
from .common import SMALL, unique_name
from .shm import fields_for, time_claim_abort, time_local_cycle


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("trace", __doc__)
    parser.add_argument("--ops", type=int, default=100_000, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    args = parser.parse_args(argv)
    runs: dict[tuple[str, bool], list[float]] = {}
    tables = {
        traced: SlotTable.create(
            unique_name(f"trace-{traced}"), fields_for(SMALL), slots=SMALL.in_flight, trace=traced
        )
        for traced in (False, True)
    }
    try:
        for table in tables.values():  # warm up
            time_claim_abort(table, args.ops // 10)
            time_local_cycle(table, args.ops // 10)
        for i in range(args.rounds):
            for traced in (False, True) if i % 2 == 0 else (True, False):
                table = tables[traced]
                runs.setdefault(("claim_abort_ns", traced), []).append(
                    time_claim_abort(table, args.ops)
                )
                runs.setdefault(("local_cycle_ns", traced), []).append(
                    time_local_cycle(table, args.ops)
                )
    finally:
        for table in tables.values():
            table.close()
            table.unlink()
    print("| measure | untraced | traced | traced - untraced |\n|---|---|---|---|")
    for key in ("claim_abort_ns", "local_cycle_ns"):
        off = statistics.median(runs[key, False])
        on = statistics.median(runs[key, True])
        print(f"| {key} | {off / 1000:.2f} µs | {on / 1000:.2f} µs | {(on - off) / 1000:+.2f} µs |")
    return 0
