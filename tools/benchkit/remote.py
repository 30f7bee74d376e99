"""Remote writes through both engines (Mooncake over TCP, NIXL over UCX; loopback) beside
the local path, the floor.

    python tools/bench.py remote [--rows 5000] [--repeat 3] [--out bench-out] [--base PATH]

Every path moves the same EAGLE rows (bf16[4096] hidden state) into one table
whose owner takes each row as soon as it is READY.  Reported: rows/s, and the
latency from the writer starting to pack a row to the owner taking it.
  local             a spawned transfer worker: claim -> write -> publish (a local copy)
  remote, 1/call    a remote writer process: one engine call and commit per row
  remote, 32/call   32 rows per engine call, one commit message behind them
each remote path once per engine.  Needs `pip install --no-build-isolation -e
'.[remote,nixl]'` and Debian's libibverbs1.

--base PATH compares this checkout with another in one run (before/after), Mooncake
paths only (older checkouts have no NIXL engine): PATH is a
checkout with its extensions built in place, as for `python tools/bench.py ab` (`git worktree add
PATH 9e220a3 && cd PATH && python setup.py build_ext --inplace` gives the landing-cell
design).  Each round runs every path in a fresh interpreter that imports this checkout,
then one that imports PATH (the order alternating from round to round, so that the
machine's drift hits both alike); medians over the rounds are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shmslots.workers import eagle
from shmslots.workers.launcher import SPAWN
from shmslots.workers.remote_flow import grant_batch, remote_writer
from shmslots.workers.transfer import TransferConfig, TransferReport, transfer_worker

from shmslots import SlotTable
from shmslots.remote import RemoteServer, open_engine

from . import command_parser
from .checkouts import TOOLS, run_probe

HERE = Path(__file__).resolve().parents[2]  # this checkout
SLOTS = 128
WINDOW = 64  # grants outstanding (remote) — the local writer is bounded by the slots
STALL_S = 60.0


@dataclass
class Run:
    rows_per_s: float
    p50_us: float
    p99_us: float


def _drain(table: SlotTable, latencies: list[float]) -> int:
    """Take every READY row now; latency = now - the writer's commit_ns stamp."""
    leases = table.poll(64)
    now = time.monotonic_ns()
    for lease in leases:
        with lease:
            latencies.append((now - int(lease.item("commit_ns"))) / 1e3)
    return len(leases)


def _summary(rows: int, seconds: float, latencies: list[float]) -> Run:
    q = statistics.quantiles(latencies, n=100)
    return Run(rows / seconds, q[49], q[98])


def _deadline(started: float) -> None:
    if time.monotonic() - started > STALL_S:
        raise TimeoutError(f"benchmark path stalled for {STALL_S} s")


def local(rows: int, name: str) -> Run:
    results = SPAWN.Queue()
    stop = SPAWN.Event()
    config = TransferConfig(burst=rows, pause_s=0.0, abort_fraction=0.0)
    with SlotTable.create(name, eagle.RowShape().fields(), slots=SLOTS) as table:
        proc = SPAWN.Process(
            target=transfer_worker, args=(name, 0, range(1, rows + 1), config, results, stop)
        )
        proc.start()
        try:
            latencies: list[float] = []
            started = time.monotonic()
            while not _drain(table, latencies):  # the clock starts at the first row
                _deadline(started)
            first = time.monotonic()
            while len(latencies) < rows:
                _deadline(started)
                _drain(table, latencies)
            seconds = time.monotonic() - first
            report: TransferReport = results.get(timeout=STALL_S)
            assert len(report.published) == rows
        finally:
            stop.set()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return _summary(rows - 1, seconds, latencies)


def remote(rows: int, name: str, per_call: int, engine: str = "mooncake") -> Run:
    with (
        SlotTable.create(name, eagle.RowShape().fields(), slots=SLOTS) as table,
        RemoteServer(table, open_engine(engine)) as server,
        remote_writer(server, options=("--batch", str(per_call))) as writer,
    ):
        link = writer.link
        latencies: list[float] = []
        granted = 0
        started = time.monotonic()
        first = 0.0
        while len(latencies) < rows:
            _deadline(started)
            grants = grant_batch(server, granted + 1, rows - granted, WINDOW, per_call)
            granted += len(grants)
            if grants:
                link.send({"grants": [g.encode() for g in grants]})
            server.poll()
            if _drain(table, latencies) and not first:
                first = time.monotonic()  # as for the local path: from the first row taken
        seconds = time.monotonic() - first
        link.send({"stop": True})
        link.recv(STALL_S)
        assert server.stats.committed == rows, server.stats
    return _summary(rows - 1, seconds, latencies)


# label -> (function of this file, its arguments after rows and name): the same names in
# every checkout compared, so that a probe can run either
PATHS: dict[str, tuple[str, tuple[int | str, ...]]] = {
    "local (claim, write, publish)": ("local", ()),
    "remote, Mooncake, 1 row per engine call": ("remote", (1,)),
    "remote, Mooncake, 32 rows per engine call": ("remote", (32,)),
    "remote, NIXL, 1 row per engine call": ("remote", (1, "nixl")),
    "remote, NIXL, 32 rows per engine call": ("remote", (32, "nixl")),
}

# what an older checkout can run too
AB_PATHS = {label: path for label, path in PATHS.items() if "nixl" not in path[1]}

# Runs with the checkout under test first on sys.path, and this checkout's benchmark code (the
# same code measures both); prints one JSON line.
PROBE = """
import json, signal, sys
# SIGTERM unwinds (SystemExit), so the probe's tables are unlinked and its children reaped.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
sys.path[:0] = [{root!r}, {tools!r}]
import shmslots
assert shmslots.__file__.startswith({root!r}), shmslots.__file__
from dataclasses import asdict
from benchkit import remote
if __name__ == "__main__":
    runs = {{}}
    for i, (label, (path, args)) in enumerate({paths!r}.items()):
        run = getattr(remote, path)({rows}, {prefix!r} + str(i), *args)
        runs[label] = asdict(run)
    print(json.dumps(runs))
"""


def in_process(rows: int, prefix: str) -> dict[str, Run]:
    """Every path once, here."""
    return {
        label: globals()[path](rows, f"{prefix}{i}", *args)
        for i, (label, (path, args)) in enumerate(PATHS.items())
    }


def probe(root: Path, rows: int, prefix: str) -> dict[str, Run]:
    """Every path once, in a fresh interpreter that imports the checkout at `root`."""
    code = PROBE.format(root=str(root), tools=str(TOOLS), paths=AB_PATHS, rows=rows, prefix=prefix)
    got = run_probe(root, code, 1200)
    return {label: Run(**run) for label, run in got.items()}


def revision(root: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "?"


def _cell(got: list[Run], key: str) -> float:
    return float(statistics.median(getattr(g, key) for g in got))


def _rate(got: list[Run]) -> str:
    rate = [g.rows_per_s for g in got]
    return f"{statistics.median(rate):,.0f} ({min(rate):,.0f}-{max(rate):,.0f})"


def single_table(args: argparse.Namespace, runs: dict[str, list[Run]]) -> list[str]:
    lines = [
        f"EAGLE rows, {args.rows} per run, median of {args.repeat} runs (min-max), "
        f"{os.cpu_count()} CPUs, TCP on 127.0.0.1 (both engines)",
        "",
        "| path | rows/s | p50 write->taken µs | p99 write->taken µs |",
        "|---|---:|---:|---:|",
    ]
    for label, got in runs.items():
        lines.append(
            f"| {label} | {_rate(got)} | {_cell(got, 'p50_us'):,.0f} "
            f"| {_cell(got, 'p99_us'):,.0f} |"
        )
    return lines


def ab_table(args: argparse.Namespace, runs: dict[str, dict[str, list[Run]]]) -> list[str]:
    lines = [
        f"EAGLE rows, {args.rows} per run, median of {args.repeat} alternated rounds "
        f"(min-max), {os.cpu_count()} CPUs, TCP on 127.0.0.1",
        f"base: {args.base} at {revision(args.base)}; this: {HERE} at {revision(HERE)}",
        "",
        "| path | rows/s base | rows/s this | this / base | p50 µs base | p50 µs this "
        "| p99 µs base | p99 µs this |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in AB_PATHS:
        base, this = runs["base"][label], runs["this"][label]
        ratio = _cell(this, "rows_per_s") / _cell(base, "rows_per_s")
        lines.append(
            f"| {label} | {_rate(base)} | {_rate(this)} | {ratio:.2f} "
            f"| {_cell(base, 'p50_us'):,.0f} | {_cell(this, 'p50_us'):,.0f} "
            f"| {_cell(base, 'p99_us'):,.0f} | {_cell(this, 'p99_us'):,.0f} |"
        )
    return lines


def measure_here(args: argparse.Namespace, prefix: str) -> tuple[list[str], object]:
    """Every path `repeat` times in this process: the table and the runs."""
    runs: dict[str, list[Run]] = {label: [] for label in PATHS}
    for r in range(args.repeat):  # interleaved, so drift hits every path alike
        for label, run in in_process(args.rows, f"{prefix}-{r}-").items():
            runs[label].append(run)
    return single_table(args, runs), {
        label: [asdict(g) for g in got] for label, got in runs.items()
    }


def measure_ab(args: argparse.Namespace, prefix: str) -> tuple[list[str], object]:
    """`repeat` rounds of every path in this checkout and the base, alternated."""
    sides = {"this": HERE, "base": args.base}
    runs: dict[str, dict[str, list[Run]]] = {side: {p: [] for p in AB_PATHS} for side in sides}
    for r in range(args.repeat):
        order = list(sides.items())
        for side, root in order if r % 2 == 0 else order[::-1]:
            for label, run in probe(root, args.rows, f"{prefix}-{side}-{r}-").items():
                runs[side][label].append(run)
                print(
                    f"round {r + 1} {side}: {label}: {run.rows_per_s:,.0f} rows/s, "
                    f"p50 {run.p50_us:,.0f} µs, p99 {run.p99_us:,.0f} µs",
                    flush=True,
                )
    doc = {
        side: {p: [asdict(g) for g in got] for p, got in by.items()} for side, by in runs.items()
    }
    return ab_table(args, runs), doc


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("remote", __doc__)
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3, help="runs (rounds, with --base)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--base", type=Path, help="another checkout to compare with")
    args = parser.parse_args(argv)
    prefix = f"shmslots-bench-remote-{os.getpid()}"
    if args.base is None:
        lines, doc = measure_here(args, prefix)
        name = "remote"
    else:
        args.base = args.base.resolve()
        lines, doc = measure_ab(args, prefix)
        name = "remote-ab"
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=2))
    return 0
