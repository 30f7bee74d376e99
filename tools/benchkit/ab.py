"""A/B: this checkout against another, on the hot path, alternated in one run.

    python tools/bench.py ab --base PATH [--rounds 5]

PATH is another checkout of shmslots with its extensions built in place
(`git worktree add PATH REV && cd PATH && python setup.py build_ext --inplace`), of
61ad8fc or later (the round trip reads through `Lease.views`; a checkout from before
`table.send` writes by claim, write and publish).
Each round runs, for each checkout in turn, in a fresh interpreter that imports
that checkout first: the one-process cycle (claim -> write -> publish -> take ->
read -> release of the small row), claim+abort, and the busy small round trip
between two spawned processes (the figures of tools/bench.py).  Rounds alternate
A and B so that the machine's drift hits both alike; medians are printed, with the
ratio this / base, and the best of each (this machine runs in one of two speeds from one
process to the next, so a median can compare a fast run with a slow one; the best rounds
of each side are in the same speed).  Used to check that a change does not slow the hot path.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from . import command_parser
from .checkouts import TOOLS, run_probe

HERE = Path(__file__).resolve().parents[2]  # this checkout

# Runs with the checkout under test first on sys.path, and this checkout's benchmark code (the
# same code measures both); prints one JSON line.
PROBE = """
import json, signal, statistics, sys
# SIGTERM unwinds (SystemExit), so the probe's tables are unlinked and its children joined.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
sys.path[:0] = [{root!r}, {tools!r}]
import shmslots
assert shmslots.__file__.startswith({root!r}), shmslots.__file__
from benchkit.common import SMALL, pin_plan
from benchkit.session import BY_NAME, SHM_BUSY, Plan, run_session
from benchkit.shm import bench_one_process

one = bench_one_process(200_000, 3)
plan = Plan(warmup=2_000, trips=20_000, rtt_repeats=3, rtt_budget_s=10.0,
            stream_rows=1, stream_repeats=1, stream_budget_s=1.0)
if __name__ == "__main__":
    trip = run_session(BY_NAME[SHM_BUSY], SMALL, plan, pin_plan())
    print(json.dumps({{
        "cycle_ns": statistics.median(one["local_cycle_ns"]),
        "claim_abort_ns": statistics.median(one["claim_abort_ns"]),
        "rtt_ns": statistics.median(statistics.median(r) for r in trip.rtt_ns),
    }}))
"""


def measure(root: Path) -> dict[str, float]:
    result: dict[str, float] = run_probe(root, PROBE.format(root=str(root), tools=str(TOOLS)), 600)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("ab", __doc__)
    parser.add_argument("--base", required=True, type=Path, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"this": [], "base": []}
    for i in range(args.rounds):
        order = [("this", HERE), ("base", args.base.resolve())]
        for label, root in order if i % 2 == 0 else order[::-1]:
            runs[label].append(measure(root))
            got = ", ".join(f"{k} {v / 1000:.2f} µs" for k, v in runs[label][-1].items())
            print(f"round {i + 1} {label}: {got}", flush=True)
    print("\n| measure | this | base | this / base | best: this | best: base | this / base |")
    print("|---|---|---|---|---|---|---|")
    for key in ("cycle_ns", "claim_abort_ns", "rtt_ns"):
        mine, theirs = [r[key] for r in runs["this"]], [r[key] for r in runs["base"]]
        cells = []
        for pick in (statistics.median, min):
            this, base = pick(mine), pick(theirs)
            cells.append(f"{this / 1000:.2f} µs | {base / 1000:.2f} µs | {this / base:.2f}")
        print(f"| {key} | {' | '.join(cells)} |")
    return 0
