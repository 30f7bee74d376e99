"""Wall time of one `shmslots` CLI call, against the target of 0.3 s (docs/performance.md).

    python tools/bench.py cli [--runs 10]

Each command runs as a fresh process, as a user types it, on a table of 64
EAGLE-sized slots that this script creates (and removes) with a few slots in
use; the table prints the median and the slowest of the runs, beside a bare
`python -c pass` and `python -c "import torch"` for scale.  tools/bench.py
reports `ls` and `inspect` from the same functions.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shmslots.workers import eagle

from shmslots import SlotTable

from . import command_parser

TARGET_S = 0.3


def wall_s(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, check=False, capture_output=True, timeout=60)
        times.append(time.perf_counter() - started)
    return times


@contextmanager
def sample_table() -> Iterator[str]:
    """A table of 64 EAGLE-sized slots, four rows published and one of them held, as a CLI
    user finds a live one; closed and removed afterwards.  Yields its name."""
    name = f"shmslots-bench-cli-{os.getpid()}"
    shape = eagle.RowShape()
    with SlotTable.create(name, shape.fields(), slots=64) as table:
        for tag in range(1, 5):
            table.claim(tag=tag).write(
                **eagle.row_values(tag, shape, time.monotonic_ns())
            ).publish()
        held = table.take()
        assert held is not None
        try:
            yield name
        finally:
            held.release()


def commands(name: str) -> dict[str, list[str]]:
    """Every CLI call timed, by the label it is reported under."""
    cli = [sys.executable, "-m", "shmslots"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "shmslots --help": [*cli, "--help"],
        "shmslots ls": [*cli, "ls"],
        "shmslots inspect NAME": [*cli, "inspect", name],
        "shmslots inspect NAME --slot 1": [*cli, "inspect", name, "--slot", "1"],
        "shmslots watch NAME --count 1": [*cli, "watch", name, "--count", "1"],
        "shmslots metrics NAME": [*cli, "metrics", name],
        "shmslots reap NAME": [*cli, "reap", name],
    }


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("cli", __doc__)
    parser.add_argument("--runs", type=int, default=10, help="calls per command (default: 10)")
    args = parser.parse_args(argv)
    with sample_table() as name:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(
            f"one CLI call, wall time over {args.runs} runs (target <= {TARGET_S} s); "
            f"{os.cpu_count()} CPUs, load average {load}\n"
        )
        print("| command | median s | slowest s | target met |")
        print("|---|---:|---:|---|")
        for label, argv in commands(name).items():
            times = wall_s(argv, args.runs)
            median = statistics.median(times)
            met = "-" if label.startswith("python") else ("yes" if median <= TARGET_S else "no")
            print(f"| `{label}` | {median:.3f} | {max(times):.3f} | {met} |")
    return 0
