"""The decode worker: a scheduler with a waiting queue and a batch builder.

Transferred requests are popped from the table (`pop_transferred`), wait in a
queue for a random number of scheduler iterations, and are then consumed by
`process_prebuilt`, which gathers their top-k and hidden state into batch
tensors (`table.gather`, straight from the rows of held leases) and
verifies every row against its tag.  Some requests are aborted while they
wait.

The consumption policy decides when the slot goes back:

* ``hold`` (correct): the request keeps its lease; the slot is released
  right after `process_prebuilt` consumed it, or at once on abort.
* ``clone`` (correct, slower): copy the fields at commit and release at once.
* ``early-release`` (the production bug): keep *views* and release at
  commit. A later transfer reuses the row and the draft state the batch
  reads is another request's; the leaked-view check reports it as well.

With ``leak_every`` N (an injected bug, with any policy) every Nth request the
worker takes is cancelled through an abort path that forgets the release: the
request's record, and with it the lease, stays in the scheduler's list of
cancelled requests, so its slot stays HELD until the worker shuts down.
The table runs out; on a traced table the call site that took the slots is
what SlotsExhausted and `shmslots inspect --by-site` name.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Literal

import torch

from shmslots import LeakedViewWarning, Lease, SlotTable, TableNotFound

from . import eagle

Policy = Literal["hold", "clone", "early-release"]
POLICIES: tuple[Policy, ...] = ("hold", "clone", "early-release")
_DRAFT = ("topk_p", "topk_index", "hidden")


@dataclass(frozen=True)
class DecodeConfig:
    policy: Policy = "hold"
    shape: eagle.RowShape = field(default_factory=eagle.RowShape)
    batch: int = 32
    max_pop: int = 64
    wait_iterations: tuple[int, int] = (1, 40)
    abort_fraction: float = 0.02
    seed: int = 0
    leak_every: int = 0  # never release every Nth request taken (0: no leak)


@dataclass
class DecodeReport:
    worker: int
    final: bool
    verified: int = 0
    corrupted: int = 0
    aborted: list[int] = field(default_factory=list)
    consumed: list[int] = field(default_factory=list)
    leaked: list[int] = field(default_factory=list)  # cancelled, their slots never handed back
    latencies_us: list[float] = field(default_factory=list)
    copies: int = 0
    first_ns: int = 0  # CLOCK_MONOTONIC (shared by all processes) of the first row handled
    last_ns: int = 0

    def handled_now(self) -> None:
        self.last_ns = time.monotonic_ns()
        self.first_ns = self.first_ns or self.last_ns


@dataclass
class Request:
    tag: int
    output_id: int
    commit_ns: int
    wait: int
    abort_at: int | None  # iteration at which the request is cancelled, if any
    lease: Lease | None = None  # hold: the slot stays owned until consumed
    draft: dict[str, torch.Tensor] | None = None  # clone / early-release
    leaks: bool = False  # leak_every: cancelled through the path that forgets the release


class DecodeScheduler:
    def __init__(self, table: SlotTable, config: DecodeConfig, report: DecodeReport) -> None:
        self.table = table
        self.config = config
        self.report = report
        self.waiting: deque[Request] = deque()
        self.rng = random.Random(config.seed * 104729 + report.worker)
        self.taken = 0
        # leak_every: cancelled requests kept for bookkeeping, each with the lease its
        # abort path forgot to hand back (the reference keeps the slot HELD)
        self.cancelled: list[Request] = []

    def pop_transferred(self, timeout: float) -> int:
        """Move READY rows into the waiting queue; block up to `timeout` when idle."""
        leases = self.table.poll(self.config.max_pop)
        if not leases and timeout:
            lease = self.table.take(timeout=timeout)
            leases = [lease] if lease is not None else []
        for lease in leases:
            self.waiting.append(self._admit(lease))
        return len(leases)

    def _admit(self, lease: Lease) -> Request:
        low, high = self.config.wait_iterations
        wait = self.rng.randint(low, high)
        aborts = self.rng.random() < self.config.abort_fraction
        self.taken += 1
        leaks = bool(self.config.leak_every) and self.taken % self.config.leak_every == 0
        request = Request(
            tag=lease.tag,
            output_id=int(lease.item("output_id")),
            commit_ns=int(lease.item("commit_ns")),
            wait=wait,
            abort_at=self.rng.randint(0, wait) if aborts or leaks else None,
        )
        if leaks:  # cancelled while it waits, by the path without the release
            request.lease, request.leaks = lease, True
            return request
        policy = self.config.policy
        if policy == "hold":
            request.lease = lease
        elif policy == "clone":
            request.draft = {n: lease.copy(n) for n in _DRAFT}
            self.report.copies += 1
            lease.release()
        else:
            request.draft = {n: lease.view(n) for n in _DRAFT}
            lease.release()  # the bug: views outlive the slot
        return request

    def step(self) -> None:
        """One scheduler iteration: age the queue, abort some, consume a batch."""
        ready: list[Request] = []
        still: deque[Request] = deque()
        for request in self.waiting:
            request.wait -= 1
            if request.abort_at is not None and request.wait <= request.abort_at:
                self._abort(request)
            elif request.wait <= 0 and len(ready) < self.config.batch:
                ready.append(request)
            else:
                still.append(request)
        self.waiting = still
        if ready:
            self.process_prebuilt(ready)

    def _abort(self, request: Request) -> None:
        if request.leaks:
            self._cancel_unusual(request)
            return
        if request.lease is not None:
            request.lease.abort()  # the abort path hands the slot back at once
        request.draft = None
        self.report.aborted.append(request.tag)
        self.report.handled_now()

    def _cancel_unusual(self, request: Request) -> None:
        """The injected bug (leak_every): a cancel path that files the request away and
        forgets `request.lease.abort()`.  The record keeps the lease, so the slot stays
        HELD, taken at pop_transferred, until the worker shuts down."""
        self.cancelled.append(request)
        self.report.leaked.append(request.tag)
        self.report.handled_now()

    def shut_down(self) -> None:
        """Drop the cancelled requests' records, aborting the leases they kept (leak_every).
        Left to close(), the slots would be handed back as a dead consumer's: queued again
        for the other decode worker, which would take those requests a second time."""
        for request in self.cancelled:
            if request.lease is not None:
                request.lease.abort()
        self.cancelled.clear()

    def process_prebuilt(self, batch: list[Request]) -> None:
        """Gather the batch's draft state, verify every row, then release the slots in one
        call."""
        topk_p, topk_index, hidden = self._stack(batch)
        now = time.monotonic_ns()
        shape = self.config.shape
        for i, request in enumerate(batch):
            ok = eagle.matches(
                request.tag, shape, request.output_id, topk_p[i], topk_index[i], hidden[i]
            )
            if ok:
                self.report.verified += 1
            else:
                self.report.corrupted += 1
            self.report.consumed.append(request.tag)
            self.report.latencies_us.append((now - request.commit_ns) / 1e3)
            request.draft = None
        self.table.release_all([r.lease for r in batch if r.lease is not None])
        self.report.handled_now()

    def _stack(self, batch: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch tensors: held leases are gathered straight from their rows (one compiled
        copy loop per field, no view); copied drafts are stacked."""
        leases = [r.lease for r in batch if r.lease is not None]
        if len(leases) == len(batch):
            topk_p, topk_index, hidden = (self.table.gather(leases, n) for n in _DRAFT)
            return topk_p, topk_index, hidden
        parts = [r.draft for r in batch if r.draft is not None]
        return (
            torch.stack([p["topk_p"] for p in parts]),
            torch.stack([p["topk_index"] for p in parts]),
            torch.stack([p["hidden"] for p in parts]),
        )


def _launcher_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def decode_worker(
    name: str,
    worker: int,
    config: DecodeConfig,
    results: Queue[DecodeReport],
    stop: Event,
    progress_every_s: float = 0.25,
) -> None:
    """Run the scheduler until told to stop and nothing is left to consume."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when to stop
    warnings.simplefilter("ignore", LeakedViewWarning)  # counted in stats() instead
    report = DecodeReport(worker, final=False)
    try:
        table = SlotTable.attach(name, "decode", label=f"decode-{worker}")
    except TableNotFound:  # unlinked from outside before this worker came up: the demo says so
        return
    with table:
        scheduler = DecodeScheduler(table, config, report)
        last = time.monotonic()
        while True:
            arrived = scheduler.pop_transferred(timeout=0.0 if scheduler.waiting else 0.02)
            scheduler.step()
            if time.monotonic() - last >= progress_every_s:
                if not _launcher_alive():
                    break  # orphaned (the launcher was killed): nobody will set `stop`
                results.put(report)
                report = scheduler.report = DecodeReport(worker, final=False)
                last = time.monotonic()
            idle = not arrived and not scheduler.waiting
            if idle and stop.is_set() and table.stats().queued == 0:
                break
        scheduler.shut_down()
    report.final = True
    results.put(report)
