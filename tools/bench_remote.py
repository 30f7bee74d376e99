"""Remote writes through the Mooncake Transfer Engine (TCP, loopback) beside the local path.

    python tools/bench_remote.py [--rows 5000] [--repeat 3] [--out bench-out]

Every path moves the same EAGLE rows (bf16[4096] hidden state) into one table
whose owner takes each row as soon as it is READY.  Reported: rows/s, and the
latency from the writer starting to pack a row to the owner taking it.
  local             a spawned transfer worker: claim -> write -> publish
  remote, 1/call    a remote writer process: one engine call and commit per row
  remote, 32/call   32 rows per engine call, one commit message behind them
Needs `pip install -e '.[remote]'` and Debian's libibverbs1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from shmslots import SlotTable
from shmslots.remote import Engine, RemoteServer
from workers import eagle
from workers.launcher import SPAWN
from workers.remote_flow import grant_batch, remote_writer
from workers.transfer import TransferConfig, TransferReport, transfer_worker

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


def remote(rows: int, name: str, per_call: int) -> Run:
    with (
        SlotTable.create(name, eagle.RowShape().fields(), slots=SLOTS) as table,
        RemoteServer(table, Engine()) as server,
        remote_writer(table, options=("--batch", str(per_call))) as link,
    ):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    paths: dict[str, Callable[[int, str], Run]] = {
        "local (claim, write, publish)": local,
        "remote, 1 row per engine call": lambda n, name: remote(n, name, 1),
        "remote, 32 rows per engine call": lambda n, name: remote(n, name, 32),
    }
    runs: dict[str, list[Run]] = {label: [] for label in paths}
    for r in range(args.repeat):  # interleaved, so drift hits every path alike
        for i, (label, path) in enumerate(paths.items()):
            runs[label].append(path(args.rows, f"shmslots-bench-remote-{os.getpid()}-{r}-{i}"))
    lines = [
        f"EAGLE rows, {args.rows} per run, median of {args.repeat} runs (min-max), "
        f"{os.cpu_count()} CPUs, TCP on 127.0.0.1",
        "",
        "| path | rows/s | p50 write->taken µs | p99 write->taken µs |",
        "|---|---:|---:|---:|",
    ]
    for label, got in runs.items():
        rate = [g.rows_per_s for g in got]
        lines.append(
            f"| {label} | {statistics.median(rate):,.0f} ({min(rate):,.0f}-{max(rate):,.0f}) "
            f"| {statistics.median(g.p50_us for g in got):,.0f} "
            f"| {statistics.median(g.p99_us for g in got):,.0f} |"
        )
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remote.md").write_text("\n".join(lines) + "\n")
    doc = {label: [asdict(g) for g in got] for label, got in runs.items()}
    (args.out / "remote.json").write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
