"""Shared pieces of the benchmark in tools/bench.py: record kinds, child processes, pinning,
bounded waits, and the small statistics every figure is reported with.

Not run on its own; see tools/bench.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from queue import Empty
from typing import Any, Protocol, TypeVar

CTX = mp.get_context("spawn")
STALL_S = 30.0  # a wait longer than this means the peer is gone: fail instead of hanging
JOIN_S = 10.0
START_S = 120.0  # spawned children import torch; allow for a slow, loaded machine

# Message ids below zero steer the echo process (see session.py).
STOP = -1  # end of the round-trip phase: echoed once more
BATCH_END = -2  # end of one throughput batch: acknowledged
QUIT = -3  # end of the session: acknowledged, then the echo process exits

PAGE = 4096  # readers of tensor payloads touch one byte in every page of this size

T = TypeVar("T")


@dataclass(frozen=True)
class Kind:
    """One kind of record a transport carries.

    `tensor` False: a row of fixed fields (the small record or the EAGLE row);
    True: one uint8 CPU tensor of `nbytes` plus an int64 id. `in_flight` bounds
    messages in flight (slots, queue depth, ring cells) so every transport gets the
    same back-pressure.
    """

    name: str
    nbytes: int
    tensor: bool
    in_flight: int


SMALL = Kind("small", 8 + 5 * 8 + 64 * 4, False, 64)
EAGLE = Kind("eagle", 8 + 8 + 16 * 4 + 16 * 8 + 4096 * 2, False, 64)
TENSOR_1M = Kind("1MiB", 1 << 20, True, 16)
TENSOR_64M = Kind("64MiB", 64 << 20, True, 4)
KINDS = (SMALL, EAGLE, TENSOR_1M, TENSOR_64M)


def reply_kind(kind: Kind) -> Kind:
    """Rows are echoed whole; a tensor request is answered with a small row."""
    return SMALL if kind.tensor else kind


# Field values every transport sends (the same numbers in every representation).
INTS = list(range(1, 6))
VEC = [0.5 * i for i in range(64)]
CACHED_TOKENS = 1234
TOPK_P = [1.0 / (i + 1) for i in range(16)]
TOPK_INDEX = [1000 + i for i in range(16)]
HIDDEN_BITS = [0x3F80 + (i % 128) for i in range(4096)]  # bfloat16 bit patterns near 1.0


class End(Protocol):
    """One process's end of a request/reply transport, opened inside a child.

    Role "a" sends requests of the session's kind and receives replies; role "b"
    receives requests and answers them.
    """

    def send(self, rid: int) -> None:
        """Send one record with this id (a request from A, a reply from B)."""
        ...

    def recv(self) -> int:
        """Wait for the next record, read it, hand it back; returns its id."""
        ...

    def echo(self) -> int:
        """B only: receive a request, reply with the same row (or a small ack); its id."""
        ...

    def close(self) -> None: ...


# -- names, CPUs and resource use ---------------------------------------------------------


def unique_name(tag: str) -> str:
    """Unique per run, so a concurrent benchmark or test cannot collide with this one."""
    return f"bench-{os.getpid()}-{tag}"


def pin_plan() -> tuple[int, int] | None:
    """CPUs for A and B (the first two allowed), or None when only one CPU is allowed."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def pin_self(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


@contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Pin this process for the block and restore its affinity afterwards."""
    before = os.sched_getaffinity(0)
    pin_self(cpu)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def current_cpu() -> int:
    """The CPU this process last ran on (field 39 of /proc/self/stat)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def cpu_seconds() -> float:
    """User + system CPU time this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def involuntary_switches() -> int:
    """Times this process was preempted: high for a busy poller that shares its core."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def rss_mib() -> float:
    """Resident memory of this process now, in MiB (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def blocked_cpu_percent(wait: Callable[[], object], seconds: float) -> float:
    """% of one core this process uses while `wait()` blocks for about `seconds`."""
    cpu_before = cpu_seconds()
    start = time.perf_counter()
    wait()
    wall = time.perf_counter() - start
    if wall < 0.5 * seconds:
        raise RuntimeError(f"the blocked wait returned after {wall:.3f} s, not {seconds} s")
    return 100.0 * (cpu_seconds() - cpu_before) / wall


# -- bounded waits --------------------------------------------------------------------------


def check_stall(since: float, what: str) -> float:
    """For busy loops, every so many spins: when the wait began; fail once it passes STALL_S."""
    now = time.monotonic()
    if not since:
        return now
    if now - since > STALL_S:
        raise TimeoutError(f"{what}: nothing for {STALL_S} s")
    return since


def poll_until(attempt: Callable[[], T | None], what: str) -> T:
    """Busy-poll `attempt` until it returns a value; fail after STALL_S (clock read rarely)."""
    spins = 0
    since = 0.0
    while (got := attempt()) is None:
        spins += 1
        if not spins & 0x3FF:
            since = check_stall(since, what)
    return got


def touch(data: Any) -> int:
    """Read one byte in every page of a uint8 tensor or array: the data must really arrive.

    Every transport's reader reads through numpy (a tensor through its zero-copy .numpy()),
    so that none pays another library's per-operation cost for the same reads: torch's
    strided sum costs ~5 us more than numpy's here, which is not the transport's time."""
    if hasattr(data, "numpy"):
        data = data.numpy()
    return int(data[::PAGE].sum())


# -- child processes --------------------------------------------------------------------------


@contextmanager
def spawned(target: Callable[..., None], *args: Any) -> Iterator[BaseProcess]:
    """A spawned child that is always joined, and terminated or killed if it lingers."""
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        proc.join(JOIN_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


@contextmanager
def spawned_all(
    jobs: list[tuple[Callable[..., None], tuple[Any, ...]]],
) -> Iterator[list[BaseProcess]]:
    """Several children started together; all joined (or killed) on exit, like `spawned`."""
    with ExitStack() as stack:
        yield [stack.enter_context(spawned(target, *args)) for target, args in jobs]


@contextmanager
def results_queue() -> Iterator[Queue[Any]]:
    queue: Queue[Any] = CTX.Queue()
    try:
        yield queue
    finally:
        queue.close()
        queue.join_thread()


def get_result(queue: Queue[Any], procs: list[BaseProcess], timeout: float = START_S) -> Any:
    """The next result a child put, or a clear error if the children died instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.2)
        except Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode != 0]
            if dead and queue.empty():
                codes = ", ".join(str(p.exitcode) for p in dead)
                raise RuntimeError(f"child exited with code {codes}") from None
    raise TimeoutError(f"no result from the children within {timeout} s")


# -- statistics ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """Median of repeats with the lowest and highest, so noisy runs are visible."""

    median: float
    low: float
    high: float
    runs: int


def spread(values: list[float]) -> Spread:
    ordered = sorted(values)
    n = len(ordered)
    mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return Spread(mid, ordered[0], ordered[-1], n)


def percentile(ordered: list[int], q: float) -> int:
    """The q-th percentile (0..100) of an already sorted list, nearest rank."""
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
