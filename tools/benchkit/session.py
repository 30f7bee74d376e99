"""Sessions of tools/bench.py: one transport, one record kind, two spawned processes.

Process A times round trips (send a request, wait for the reply), then throughput batches
(send rows back to back, then one BATCH_END that B acknowledges). Process B echoes in the
round-trip phase and consumes in the throughput phase, noting its resident memory every
`rss_every` rows. With two CPUs, A is pinned to the first and B to the second. Both report
where they last ran and how often they were preempted, so busy pollers sharing a core show.
Not run on its own; see tools/bench.py.
"""

from __future__ import annotations

import cProfile
import pstats
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import torch

from . import iceoryx, peers, shm
from .common import (
    BATCH_END,
    CTX,
    EAGLE,
    KINDS,
    QUIT,
    SMALL,
    START_S,
    STOP,
    End,
    Kind,
    current_cpu,
    get_result,
    involuntary_switches,
    pin_self,
    results_queue,
    rss_mib,
    spawned,
)

ROWS = (SMALL, EAGLE)
SHM_BUSY, SHM_BLOCK = "shmslots busy", "shmslots blocking"
SHM_BATCH = f"shmslots batch {shm.BATCH}"  # claim_n/publish_all, poll/gather/release_all
SHM_LOAN = "shmslots loan"  # tensors filled into ws.alloc, busy-polled
SHM_COPYING = "shmslots copying"  # blocking take, lease.copy() of every field, write() them
TENSORS = tuple(kind for kind in KINDS if kind.tensor)
SESSION_S = 600.0  # the longest any session may take before it counts as hung


@dataclass(frozen=True)
class Transport:
    """How to set a transport up in the parent and open each end in a child."""

    name: str
    setup: Callable[[Kind], AbstractContextManager[Any]]
    open_end: Callable[[Any, Kind, str], End]
    kinds: tuple[Kind, ...]
    busy: bool  # both ends busy-poll: they must not share a core


TRANSPORTS = (
    Transport(SHM_BUSY, shm.table_pair, shm.open_busy, KINDS, True),
    Transport(SHM_BLOCK, shm.table_pair, shm.open_blocking, KINDS, False),
    Transport(SHM_BATCH, shm.batch_pair, shm.open_batch, ROWS, False),
    Transport(SHM_LOAN, shm.table_pair, shm.open_loan, TENSORS, True),
    Transport(SHM_COPYING, shm.table_pair, shm.open_copying, ROWS, False),
    Transport("bare ring", peers.bare_segment, peers.open_bare, KINDS, True),
    Transport("iceoryx2 busy", iceoryx.service_pair, iceoryx.open_busy, ROWS, True),
    Transport("iceoryx2 blocking", iceoryx.service_pair, iceoryx.open_blocking, ROWS, False),
    Transport("mp.Queue", peers.queue_pair, peers.open_queue, KINDS, False),
    Transport("mp.Pipe", peers.pipe_pair, peers.open_pipe, ROWS, False),
    Transport("torch.mp Queue", peers.torch_queue_pair, peers.open_torch_queue, KINDS, False),
)
BY_NAME = {t.name: t for t in TRANSPORTS}


@dataclass(frozen=True)
class Plan:
    """How much of each phase a session runs; every phase also stops at its time budget."""

    warmup: int
    trips: int
    rtt_repeats: int
    rtt_budget_s: float
    stream_rows: int
    stream_repeats: int
    stream_budget_s: float
    rss_every: int = 100_000
    check_every: int = 64  # rows between two looks at the clock in a throughput batch
    profile_to: str | None = None  # write cProfile stats of both sides to PATH-a/b.txt


@dataclass
class Session:
    """What one session measured."""

    transport: str
    kind: str
    rtt_ns: list[list[int]]  # round-trip samples, one list per repeat
    rows: list[int]  # rows sent in each throughput batch
    rows_s: list[float]  # rows/s of each batch
    cpus: tuple[int, int]  # the CPUs A and B last ran on
    preempted: tuple[int, int]  # involuntary context switches of A and B while timed
    rss_mib: list[tuple[int, float]] = field(default_factory=list)  # B: (rows consumed, RSS)
    seconds: float = 0.0


# -- process A ----------------------------------------------------------------------------------


def expect(got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"reply carries id {got}, expected {want}")


def time_trips(end: End, first: int, n: int, budget_s: float) -> list[int]:
    """ns per round trip, for up to `n` trips or until the budget is spent."""
    samples = []
    deadline = time.perf_counter_ns() + int(budget_s * 1e9)
    for rid in range(first, first + n):
        start = time.perf_counter_ns()
        end.send(rid)
        got = end.recv()
        stop = time.perf_counter_ns()
        expect(got, rid)
        samples.append(stop - start)
        if stop > deadline:
            break
    return samples


def time_stream(end: End, plan: Plan) -> tuple[int, float]:
    """(rows sent, rows/s) for one batch: rows back to back, until B acknowledges the end."""
    start = time.perf_counter_ns()
    deadline = start + int(plan.stream_budget_s * 1e9)
    sent = 0
    while sent < plan.stream_rows:
        end.send(sent)
        sent += 1
        if not sent % plan.check_every and time.perf_counter_ns() > deadline:
            break
    end.send(BATCH_END)
    expect(end.recv(), BATCH_END)
    return sent, sent / ((time.perf_counter_ns() - start) / 1e9)


def run_a(t: Transport, res: Any, kind: Kind, plan: Plan, barrier: Barrier) -> dict[str, Any]:
    end = t.open_end(res, kind, "a")
    try:
        barrier.wait(START_S)
        time_trips(end, 0, plan.warmup, START_S)
        switches = involuntary_switches()
        with profiled(plan.profile_to, "a"):
            rtt = [
                time_trips(end, plan.warmup + r * plan.trips, plan.trips, plan.rtt_budget_s)
                for r in range(plan.rtt_repeats)
            ]
        end.send(STOP)
        expect(end.recv(), STOP)
        batches = [time_stream(end, plan) for _ in range(plan.stream_repeats)]
        end.send(QUIT)
        expect(end.recv(), QUIT)
        barrier.wait(START_S)  # B stays until its last reply is in (torch serves fds from B)
        return {
            "rtt_ns": rtt,
            "rows": [rows for rows, _ in batches],
            "rows_s": [rate for _, rate in batches],
            "cpu": current_cpu(),
            "preempted": involuntary_switches() - switches,
        }
    finally:
        end.close()


# -- process B ----------------------------------------------------------------------------------


def consume(end: End, rss_every: int) -> list[tuple[int, float]]:
    """Throughput phase: take rows until QUIT; RSS every `rss_every` rows."""
    rows = 0
    rss = []
    while True:
        rid = end.recv()
        if rid >= 0:
            rows += 1
            if not rows % rss_every:
                rss.append((rows, rss_mib()))
        elif rid == BATCH_END:
            end.send(BATCH_END)
        elif rid == QUIT:
            end.send(QUIT)
            return rss


def run_b(t: Transport, res: Any, kind: Kind, plan: Plan, barrier: Barrier) -> dict[str, Any]:
    end = t.open_end(res, kind, "b")
    try:
        barrier.wait(START_S)
        switches = involuntary_switches()
        with profiled(plan.profile_to, "b"):
            while end.echo() != STOP:
                pass
        rss = consume(end, plan.rss_every)
        barrier.wait(START_S)
        return {
            "rss_mib": rss,
            "cpu": current_cpu(),
            "preempted": involuntary_switches() - switches,
        }
    finally:
        end.close()


# -- both ----------------------------------------------------------------------------------------


@contextmanager
def profiled(path: str | None, role: str) -> Iterator[None]:
    """cProfile the block when `path` is set; the top entries go to PATH-ROLE.txt."""
    if path is None:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        with open(f"{path}-{role}.txt", "w") as f:
            pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(25)


def side_main(
    role: str,
    t: Transport,
    res: Any,
    kind: Kind,
    plan: Plan,
    cpu: int | None,
    barrier: Barrier,
    out: Queue[Any],
) -> None:
    """Child entry point for A or B: pin, run, and report the result or the traceback.

    torch runs single-threaded: on a pinned process its worker threads would only compete
    with the thread that does the work.
    """
    pin_self(cpu)
    torch.set_num_threads(1)
    run = run_a if role == "a" else run_b
    try:
        result = run(t, res, kind, plan, barrier)
    except BaseException:
        out.put((role, "error", traceback.format_exc()))
        raise
    out.put((role, "ok", result))


def run_session(
    t: Transport, kind: Kind, plan: Plan, pins: tuple[int, int] | None, timeout: float = SESSION_S
) -> Session:
    """Set the transport up, spawn A and B, collect both results; always clean everything."""
    a_cpu, b_cpu = pins or (None, None)
    started = time.perf_counter()
    barrier = CTX.Barrier(2)
    with t.setup(kind) as res, results_queue() as out, ExitStack() as children:
        procs = [
            children.enter_context(spawned(side_main, role, t, res, kind, plan, cpu, barrier, out))
            for role, cpu in (("a", a_cpu), ("b", b_cpu))
        ]
        got: dict[str, dict[str, Any]] = {}
        try:
            while len(got) < 2:
                role, status, value = get_result(out, procs, timeout)
                if status == "error":
                    raise RuntimeError(f"{t.name} / {kind.name}: process {role} failed:\n{value}")
                got[role] = value
        except BaseException:
            barrier.abort()
            raise
    a, b = got["a"], got["b"]
    return Session(
        t.name,
        kind.name,
        a["rtt_ns"],
        a["rows"],
        a["rows_s"],
        (a["cpu"], b["cpu"]),
        (a["preempted"], b["preempted"]),
        [(rows, mib) for rows, mib in b["rss_mib"]],
        time.perf_counter() - started,
    )
