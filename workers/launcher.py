"""Run transfer and decode workers on one table, watch them, and always clean up.

Every child is reaped and the table unlinked on any exit — a normal end,
Ctrl-C in the launcher, or a worker's death (reported as an error).  A transfer
worker that finds no free slot (SlotsExhausted: with `leak_every`, the expected
end) ends the flow: the launcher keeps the message and a snapshot of the table at
that moment (who holds the slots), stops the transfer workers, and decode once they
have all stopped, and cleans up as always.
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
from shmslots.snapshot import TableSnapshot, TableView

from . import eagle
from .decode import DecodeConfig, DecodeReport, Policy, decode_worker
from .transfer import TransferConfig, TransferReport, transfer_worker

SPAWN = mp.get_context("spawn")
DECODE_START_S = 10.0  # how long decode workers may take to start on a loaded machine


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
    # decode never releases every Nth request it takes (0: no leak); the table is traced
    leak_every: int = 0
    # how long a transfer claim waits for a free slot; None: 1 s with a leak (where a full
    # table is the expected end), 60 s without
    claim_timeout_s: float | None = None

    @property
    def claim_wait_s(self) -> float:
        if self.claim_timeout_s is not None:
            return self.claim_timeout_s
        return 1.0 if self.leak_every else 60.0


@dataclass(frozen=True)
class Exhaustion:
    """A transfer worker's claim found no free slot: its message, and the table as it was
    read right after (decode still holding what it holds)."""

    worker: int
    message: str
    snapshot: TableSnapshot


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
    leaked_tags: list[int] = field(default_factory=list)  # taken by decode, never released
    exhaustion: Exhaustion | None = None
    unlinked: bool = False  # the table was unlinked from outside: the flow stopped early

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
        return self.verified + self.corrupted + self.decode_aborted + len(self.leaked_tags)

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
        self.leaked_tags += report.leaked


@dataclass(frozen=True)
class FlowResult:
    progress: FlowProgress
    published: int
    transfer_aborted: int
    final: Stats

    @property
    def accounted(self) -> bool:
        """Every published request was consumed, aborted or leaked by decode, exactly once."""
        p = self.progress
        published = sorted(t for r in p.transfers for t in r.published)
        handled = sorted(p.consumed_tags + p.aborted_tags + p.leaked_tags)
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
    stop = SPAWN.Event()  # decode: finish what is queued, then exit
    stop_transfer = SPAWN.Event()  # transfer: commit no more (set first on a full table)
    procs: list[SpawnProcess] = []
    progress = FlowProgress(config, time.monotonic(), name)
    tconf = TransferConfig(
        config.shape, config.burst, 0.002, config.transfer_abort, config.seed, config.claim_wait_s
    )
    dconf = DecodeConfig(
        config.policy,
        config.shape,
        abort_fraction=config.decode_abort,
        seed=config.seed,
        leak_every=config.leak_every,
    )
    trace = True if config.leak_every else None  # None: as SHMSLOTS_TRACE says
    with SlotTable.create(name, config.shape.fields(), slots=config.slots, trace=trace) as table:
        try:
            for w in range(config.decode_workers):
                args = (name, w, dconf, decode_results, stop)
                procs.append(SPAWN.Process(target=decode_worker, args=args))
            per = config.requests // config.transfer_workers
            for w in range(config.transfer_workers):
                tags = range(1 + w * per, 1 + (w + 1) * per)
                args2 = (name, w, tags, tconf, transfer_results, stop_transfer)
                procs.append(SPAWN.Process(target=transfer_worker, args=args2))
            if on_progress is not None:
                on_progress(progress)  # the table exists: show it before workers start
            decoders, transfers = procs[: config.decode_workers], procs[config.decode_workers :]
            for proc in decoders:
                proc.start()
            if config.claim_wait_s < DECODE_START_S:
                # a claim wait shorter than decode's start-up (importing torch) is meant to
                # measure decode's holding: transfer starts once decode is attached
                _await_decode(table, decoders, config.timeout_s)
            for proc in transfers:
                proc.start()
            finals = 0
            while finals < config.decode_workers and not progress.unlinked:
                if progress.seconds > config.timeout_s:
                    raise TimeoutError(f"flow did not finish in {config.timeout_s} s")
                finals += _collect(decode_results, progress)
                while not transfer_results.empty():
                    report = transfer_results.get()
                    progress.transfers.append(report)
                    if report.exhausted and progress.exhaustion is None:
                        progress.exhaustion = _exhaustion(name, report)
                        # a full table ends the flow: the other transfer workers stop too;
                        # decode goes on until they have (they may still publish a row)
                        stop_transfer.set()
                if len(progress.transfers) == config.transfer_workers:
                    stop.set()
                progress.unlinked = table.unlinked  # `shmslots unlink --force`: stop, summarise
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not progress.unlinked:
                    raise RuntimeError(f"worker pid {dead[0].pid} died (exit {dead[0].exitcode})")
                progress.stats = table.stats()
                progress.peak_owned = max(progress.peak_owned, progress.stats.owned)
                if on_progress is not None:
                    on_progress(progress)
            if progress.unlinked:  # the workers go on over their mappings: stop them now
                stop_transfer.set()
                stop.set()
            for proc in procs:
                proc.join(30)
        finally:
            stop_transfer.set()
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


def _await_decode(table: SlotTable, decoders: list[SpawnProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(p.role == "decode" and p.alive for p in table.participants()) < len(decoders):
        if table.unlinked:
            return  # the flow loop sees it and stops
        dead = [p for p in decoders if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"worker pid {dead[0].pid} died (exit {dead[0].exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode workers did not attach in {timeout_s} s")
        time.sleep(0.05)


def _exhaustion(name: str, report: TransferReport) -> Exhaustion:
    """What a full table looked like, read before anyone is told to stop."""
    assert report.exhausted is not None
    with TableView.open(name) as view:
        return Exhaustion(report.worker, report.exhausted, view.snapshot())


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
