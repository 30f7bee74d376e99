"""Benchmark shmslots against its peers, side by side in one run, with ratios to its targets.

Run from the repository root (inside the project's virtualenv, with the `bench` extras:
`pip install --no-build-isolation -e '.[bench]'`, for iceoryx2 and matplotlib):

    python tools/bench.py [--quick] [--out bench-out] [--profile]
    python tools/bench.py COMMAND [args]      (COMMAND --help says more)

The one tool for every benchmark; its code is the package tools/benchkit/.  Without a
command it runs the full comparison below.  The commands look closer at one thing:

    ab       this checkout against another (--base PATH), the hot path alternated in one run
    steps    the step timings of the busy round trip, batches and the loan
    one      some sessions of the full run on their own
    cli      the wall time of every CLI command, each a fresh process
    trace    what call-site tracing costs
    remote   remote writes through Mooncake and NIXL beside the local path
    sglang   SGLang's own decode path on shmslots against its clone at commit
    pd       prefill to decode on one host: the shmslots backend, Mooncake, a memcpy floor

Peers, all real: multiprocessing.Queue, multiprocessing.Pipe, a torch.multiprocessing queue
passing tensors, iceoryx2 publish-subscribe (busy-polled, and blocking through its event
service), and a bare busy-polled shared-memory ring with no ownership, checks or schema (the
floor). shmslots runs busy (take(0); table.send of private tensors, one compiled claim,
write and publish; views, the reply sent from the request's views), blocking
(take(timeout)), in batches of 64 (claim_n, scatter, publish_all; poll, gather,
release_all), with loaned tensors (ws.alloc) and as a user first writes it (claim, write
and publish a step each, blocking take, lease.copy() of every field). Records: the small
row (id, int64[5], float32[64]), the EAGLE metadata row (output id, cached tokens, top-k p
float32[16], top-k index int64[16], hidden bf16[4096]), and 1 MiB and 64 MiB CPU tensors
(shmslots: a ref field in the table's arena, read with lease.tensor).

Measured, each repeated (3 runs unless said) and reported as median and lowest-highest:

* round trip between two spawned processes: A sends into table REQ, B takes, reads,
  answers through table RESP and releases (busy polling and blocking);
* one-way throughput (rows/s) from A to B, for every record kind;
* claim+release (claim then abort) in one process, and claims/s with two processes contending;
* CPU used by a reader blocked in take(timeout=2 s) with nothing published (% of a core);
* resident memory of a consumer over 1,000,000 small rows (growth from 100k to 1M rows);
* gather of 64 EAGLE rows' hidden states against torch.cat and torch.stack of clones;
* the wall time of one CLI call (`shmslots ls`, `inspect NAME`) as a fresh process.

With two CPUs, A is pinned to the first and B to the second (os.sched_setaffinity); the report
says whether busy pollers ever shared a core and how often they were preempted.

`--out DIR` (default bench-out/) receives bench.json, bench.md, latency_cdf.png,
throughput_vs_payload.png and gather.png; the Markdown is also printed. `--quick` is a short
run (about 2 minutes); the full run takes about five minutes on a 2-core machine.
`--profile` adds a cProfile of both sides of the shmslots busy round trip (profile-a.txt,
profile-b.txt).
Every shared-memory name is unique to the run and removed, and every child is joined (or
killed) before the script exits, even on errors.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

EXTRAS = ("iceoryx2", "matplotlib")  # the `bench` extras of pyproject.toml
COMMANDS = ("ab", "steps", "one", "cli", "trace", "remote", "sglang", "pd")


def _extras_missing() -> bool:
    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"tools/bench.py: error: {' and '.join(missing)} not installed; install the bench "
            "extras: pip install --no-build-isolation -e '.[bench]'",
            file=sys.stderr,
        )
    return bool(missing)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        # imported here, not at the top: most import the extras (and torch)
        if argv[0] in ("ab", "one", "steps") and _extras_missing():
            return 2
        command = importlib.import_module(f"benchkit.{argv[0]}")
        return int(command.main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog=f"Commands: {', '.join(COMMANDS)}.  The targets are those of docs/performance.md.",
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about 2 minutes)")
    parser.add_argument("--out", default="bench-out", help="folder for bench.json/.md and plots")
    parser.add_argument("--profile", action="store_true", help="also cProfile the round trip")
    args = parser.parse_args(argv)
    if _extras_missing():
        return 2
    from benchkit import run

    return run.run(args.quick, Path(args.out), args.profile)


if __name__ == "__main__":
    sys.exit(main())
