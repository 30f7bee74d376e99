"""The transfer worker: commits per-request EAGLE metadata into table rows.

Models the prefill->decode transfer step: for each request it claims a slot,
writes the row (values derived from the request's tag) and publishes it —
in steady traffic or in bursts of back-to-back commits (cache hits) — and
aborts a fraction of transfers before publishing.  A claim that finds no free slot
within `claim_timeout_s` ends the worker's run: the SlotsExhausted message (which
names the top holders by call site on a traced table) goes into its report.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

from shmslots import SlotsExhausted, SlotTable, TableNotFound

from . import eagle


@dataclass(frozen=True)
class TransferConfig:
    shape: eagle.RowShape = field(default_factory=eagle.RowShape)
    burst: int = 32  # commits back to back; 1 means steady traffic
    pause_s: float = 0.002  # idle time between bursts
    abort_fraction: float = 0.02
    seed: int = 0
    claim_timeout_s: float = 60.0


@dataclass
class TransferReport:
    worker: int
    published: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    exhausted: str | None = None  # the SlotsExhausted message that ended the run, if any


def transfer_worker(
    name: str,
    worker: int,
    tags: range,
    config: TransferConfig,
    results: Queue[TransferReport],
    stop: Event,
) -> None:
    """Commit one row per tag (tags are unique and non-zero), then report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when to stop
    rng = random.Random(config.seed * 7919 + worker)
    report = TransferReport(worker)
    try:
        table = SlotTable.attach(name, "transfer", label=f"transfer-{worker}")
    except TableNotFound:  # unlinked from outside before this worker came up: the demo says so
        return
    with table:
        for n, tag in enumerate(tags, 1):
            if stop.is_set():
                break
            try:
                ws = table.claim(tag=tag, timeout=config.claim_timeout_s)
            except SlotsExhausted as exc:
                report.exhausted = str(exc)
                break
            ws.write(**eagle.row_values(tag, config.shape, time.monotonic_ns()))
            if rng.random() < config.abort_fraction:
                ws.abort()
                report.aborted.append(tag)
            else:
                ws.publish(timeout=60.0)
                report.published.append(tag)
            if n % config.burst == 0:
                time.sleep(config.pause_s)
    results.put(report)
