"""Run transfer and decode workers on one table, watch them, and always clean up.

Every child is reaped and the table unlinked on any exit — a normal end,
Ctrl-C in the launcher, or a worker's death (reported as an error).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess

from shmslots import SlotTable, Stats
from workers import eagle
from workers.decode import DecodeConfig, DecodeReport, Policy, decode_worker
from workers.transfer import TransferConfig, TransferReport, transfer_worker

SPAWN = mp.get_context("spawn")


@dataclass(frozen=True)
class FlowConfig:
    requests: int = 20_000
    transfer_workers: int = 2
    decode_workers: int = 2
    slots: int = 64
    policy: Policy = "hold"
    shape: eagle.RowShape = field(default_factory=eagle.RowShape)
    burst: int = 32
    transfer_abort: float = 0.02
    decode_abort: float = 0.02
    seed: int = 0
    timeout_s: float = 300.0


@dataclass
class FlowProgress:
    """What the launcher knows so far; passed to the live view."""

    config: FlowConfig
    started: float
    table: str = ""  # the table's name, for `shmslots inspect` while the flow runs
    stats: Stats | None = None
    verified: int = 0
    corrupted: int = 0
    decode_aborted: int = 0
    latencies_us: list[float] = field(default_factory=list)
    peak_owned: int = 0
    copies: int = 0
    transfers: list[TransferReport] = field(default_factory=list)
    consumed_tags: list[int] = field(default_factory=list)
    aborted_tags: list[int] = field(default_factory=list)

    first_ns: int = 0  # CLOCK_MONOTONIC of the first and last row decode handled
    last_ns: int = 0

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    @property
    def rate(self) -> float:
        """Rows consumed or aborted by decode per second, from first to last report
        (worker start-up, mostly importing torch, is left out)."""
        if not self.first_ns:
            return 0.0
        return self.handled / max((self.last_ns - self.first_ns) / 1e9, 1e-9)

    @property
    def handled(self) -> int:
        return self.verified + self.corrupted + self.decode_aborted

    def latency_us(self, q: float) -> float:
        if not self.latencies_us:
            return 0.0
        if len(self.latencies_us) == 1:
            return self.latencies_us[0]
        return statistics.quantiles(self.latencies_us, n=100)[int(q * 100) - 1]

    def add(self, report: DecodeReport) -> None:
        if report.first_ns:
            self.first_ns = min(self.first_ns or report.first_ns, report.first_ns)
            self.last_ns = max(self.last_ns, report.last_ns)
        self.verified += report.verified
        self.corrupted += report.corrupted
        self.decode_aborted += len(report.aborted)
        self.latencies_us += report.latencies_us
        self.copies += report.copies
        self.consumed_tags += report.consumed
        self.aborted_tags += report.aborted


@dataclass(frozen=True)
class FlowResult:
    progress: FlowProgress
    published: int
    transfer_aborted: int
    final: Stats

    @property
    def accounted(self) -> bool:
        """Every published request was consumed or aborted by decode, exactly once."""
        published = sorted(t for r in self.progress.transfers for t in r.published)
        handled = sorted(self.progress.consumed_tags + self.progress.aborted_tags)
        return published == handled


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While running, SIGTERM unwinds like Ctrl-C, so children are reaped and the table
    unlinked instead of the launcher vanishing and leaving both behind."""

    def unwind(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_flow(
    config: FlowConfig, on_progress: Callable[[FlowProgress], None] | None = None
) -> FlowResult:
    with sigterm_unwinds():
        return _run_flow(config, on_progress)


def _run_flow(config: FlowConfig, on_progress: Callable[[FlowProgress], None] | None) -> FlowResult:
    name = f"shmslots-flow-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"
    transfer_results: mp.Queue[TransferReport] = SPAWN.Queue()
    decode_results: mp.Queue[DecodeReport] = SPAWN.Queue()
    stop = SPAWN.Event()
    procs: list[SpawnProcess] = []
    progress = FlowProgress(config, time.monotonic(), name)
    tconf = TransferConfig(config.shape, config.burst, 0.002, config.transfer_abort, config.seed)
    dconf = DecodeConfig(
        config.policy, config.shape, abort_fraction=config.decode_abort, seed=config.seed
    )
    with SlotTable.create(name, config.shape.fields(), slots=config.slots) as table:
        try:
            for w in range(config.decode_workers):
                args = (name, w, dconf, decode_results, stop)
                procs.append(SPAWN.Process(target=decode_worker, args=args))
            per = config.requests // config.transfer_workers
            for w in range(config.transfer_workers):
                tags = range(1 + w * per, 1 + (w + 1) * per)
                args2 = (name, w, tags, tconf, transfer_results, stop)
                procs.append(SPAWN.Process(target=transfer_worker, args=args2))
            if on_progress is not None:
                on_progress(progress)  # the table exists: show it before workers start
            for proc in procs:
                proc.start()
            finals = 0
            while finals < config.decode_workers:
                if progress.seconds > config.timeout_s:
                    raise TimeoutError(f"flow did not finish in {config.timeout_s} s")
                finals += _collect(decode_results, progress)
                while not transfer_results.empty():
                    progress.transfers.append(transfer_results.get())
                if len(progress.transfers) == config.transfer_workers:
                    stop.set()
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"worker pid {dead[0].pid} died (exit {dead[0].exitcode})")
                progress.stats = table.stats()
                progress.peak_owned = max(progress.peak_owned, progress.stats.owned)
                if on_progress is not None:
                    on_progress(progress)
            for proc in procs:
                proc.join(30)
        finally:
            stop.set()
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        return FlowResult(
            progress,
            published=sum(len(r.published) for r in progress.transfers),
            transfer_aborted=sum(len(r.aborted) for r in progress.transfers),
            final=table.stats(),
        )


def _collect(results: mp.Queue[DecodeReport], progress: FlowProgress) -> int:
    """Fold decode reports into `progress`; returns how many were final."""
    reports = drain(results)
    for report in reports:
        progress.add(report)
    return sum(report.final for report in reports)


def drain(results: mp.Queue[DecodeReport]) -> list[DecodeReport]:
    """The reports waiting in `results`, after waiting up to 0.1 s for the first."""
    try:
        reports = [results.get(timeout=0.1)]
    except queue.Empty:
        return []
    while True:
        try:
            reports.append(results.get_nowait())
        except queue.Empty:
            return reports
