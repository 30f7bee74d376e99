"""iceoryx2 (Rust zero-copy IPC, Python bindings) as a peer in tools/bench.py.

Publish-subscribe with one service per direction: loan -> write -> send, then receive.
Busy mode polls `receive()`; blocking mode pairs each direction with an event service: the
sender notifies after `send()`, the receiver sleeps in `Listener.timed_wait` when nothing is
there. The payload is a ctypes struct (rows only: the small record and the EAGLE row).

iceoryx2 keeps its files under a root folder and /dev/shm with a prefix; both are unique
per run here (config Global.root_path and Global.prefix) and removed afterwards, so nothing
is left behind. Not run on its own; see tools/bench.py.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

import iceoryx2 as iox2

from .common import (
    CACHED_TOKENS,
    EAGLE,
    HIDDEN_BITS,
    INTS,
    TOPK_INDEX,
    TOPK_P,
    VEC,
    End,
    Kind,
    blocked_cpu_percent,
    check_stall,
    unique_name,
)

SHM_DIR = "/dev/shm"
BLOCK_S = 1.0  # one Listener.timed_wait; repeated until STALL_S


class SmallRecord(ctypes.Structure):
    _fields_ = (("id", ctypes.c_int64), ("ints", ctypes.c_int64 * 5), ("vec", ctypes.c_float * 64))


class EagleRecord(ctypes.Structure):
    _fields_ = (
        ("output_id", ctypes.c_int64),
        ("cached_tokens", ctypes.c_int64),
        ("topk_p", ctypes.c_float * 16),
        ("topk_index", ctypes.c_int64 * 16),
        ("hidden", ctypes.c_uint16 * 4096),  # bfloat16 bits: ctypes has no bfloat16
    )


def record_type(kind: Kind) -> type[ctypes.Structure]:
    if kind.tensor:
        raise ValueError("the iceoryx2 peer carries rows only")
    return EagleRecord if kind == EAGLE else SmallRecord


def record(kind: Kind) -> ctypes.Structure:
    """One filled record with id 0 (the id sits at offset 0 in both structs)."""
    if kind == EAGLE:
        return EagleRecord(
            0,
            CACHED_TOKENS,
            (ctypes.c_float * 16)(*TOPK_P),
            (ctypes.c_int64 * 16)(*TOPK_INDEX),
            (ctypes.c_uint16 * 4096)(*HIDDEN_BITS),
        )
    return SmallRecord(0, (ctypes.c_int64 * 5)(*INTS), (ctypes.c_float * 64)(*VEC))


@dataclass(frozen=True)
class Place:
    """Where one run's iceoryx2 files live, and the service names of one session."""

    prefix: str
    root: str
    req: str
    resp: str


def run_place(tag: str) -> Place:
    base = unique_name(tag)
    return Place(f"{base}-", f"/tmp/{base}-iox2/", f"{base}/req", f"{base}/resp")


def config(place: Place) -> Any:
    """A default iceoryx2 config whose files go under this run's prefix and root folder."""
    iox2.set_log_level(iox2.LogLevel.Error)
    cfg = iox2.config.default()
    cfg.global_cfg.prefix = iox2.FileName.new(place.prefix)
    cfg.global_cfg.root_path = iox2.Path.new(place.root)
    return cfg


def node(place: Place) -> Any:
    return iox2.NodeBuilder.new().config(config(place)).create(iox2.ServiceType.Ipc)


def remove_files(place: Place) -> None:
    """Delete whatever iceoryx2 left under this run's prefix and root folder."""
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(place.prefix):
            os.unlink(os.path.join(SHM_DIR, entry))
    shutil.rmtree(place.root, ignore_errors=True)


def create_services(owner: Any, place: Place, kind: Kind) -> list[Any]:
    """Both pub-sub services (no loss: safe overflow off) and their event services."""
    services = []
    for name in (place.req, place.resp):
        pubsub = (
            owner.service_builder(iox2.ServiceName.new(name))
            .publish_subscribe(record_type(kind))
            .max_publishers(1)
            .max_subscribers(1)
            .history_size(0)
            .subscriber_max_buffer_size(kind.in_flight)
            .enable_safe_overflow(False)
            .create()
        )
        event = owner.service_builder(iox2.ServiceName.new(name + "-event")).event().create()
        services += [pubsub, event]
    return services


@contextmanager
def scratch_place(tag: str) -> Iterator[Place]:
    """A fresh prefix and root folder whose files are always removed afterwards."""
    place = run_place(tag)
    try:
        yield place
    finally:
        remove_files(place)


@contextmanager
def service_pair(kind: Kind) -> Iterator[Place]:
    """Create the services of one session here; always drop them and remove the files."""
    with scratch_place(f"iox-{kind.name}") as place:
        owner = node(place)
        services = create_services(owner, place, kind)
        try:
            yield place
        finally:
            del services, owner


class IoxEnd:
    """One side: a publisher (+ notifier) on its out service, a subscriber (+ listener) in."""

    def __init__(self, place: Place, kind: Kind, role: str, blocking: bool) -> None:
        self._node = node(place)
        out_name, in_name = (place.req, place.resp) if role == "a" else (place.resp, place.req)
        rtype = record_type(kind)
        self._pub = (
            self._open(out_name, rtype)
            .publisher_builder()
            .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered)
            .create()
        )
        subscribers = self._open(in_name, rtype).subscriber_builder()
        self._sub = subscribers.buffer_size(kind.in_flight).create()
        self._blocking = blocking
        self._notifier = self._event(out_name).notifier_builder().create()
        self._listener = self._event(in_name).listener_builder().create()
        self._template = record(kind)
        self._size = ctypes.sizeof(rtype)
        self._wait = iox2.Duration.from_secs_f64(BLOCK_S)

    def _open(self, name: str, rtype: type[ctypes.Structure]) -> Any:
        return (
            self._node.service_builder(iox2.ServiceName.new(name)).publish_subscribe(rtype).open()
        )

    def _event(self, name: str) -> Any:
        return self._node.service_builder(iox2.ServiceName.new(name + "-event")).event().open()

    def send(self, rid: int) -> None:
        sample = self._pub.loan_uninit()
        ptr = sample.payload_ptr
        ctypes.memmove(ptr, ctypes.addressof(self._template), self._size)
        ctypes.c_int64.from_address(ptr).value = rid
        sample.assume_init().send()
        if self._blocking:
            self._notifier.notify()

    def _receive(self) -> Any:
        """The next sample: busy-polled, or slept for on the event service."""
        spins = 0
        since = 0.0
        while (sample := self._sub.receive()) is None:
            if self._blocking:
                self._listener.timed_wait(self._wait)
                since = check_stall(since, "iceoryx2 receive")
            else:
                spins += 1
                if not spins & 0x3FF:
                    since = check_stall(since, "iceoryx2 receive")
        return sample

    def _read(self, sample: Any) -> int:
        """The id; every field is reachable zero copy through the ctypes struct."""
        fields = sample.payload().contents
        rid: int = fields.output_id if isinstance(fields, EagleRecord) else fields.id
        return rid

    def recv(self) -> int:
        sample = self._receive()
        rid = self._read(sample)
        sample.delete()
        return rid

    def echo(self) -> int:
        sample = self._receive()
        rid = self._read(sample)
        reply = self._pub.loan_uninit()
        ctypes.memmove(reply.payload_ptr, sample.payload_ptr, self._size)
        sample.delete()
        reply.assume_init().send()
        if self._blocking:
            self._notifier.notify()
        return rid

    def close(self) -> None:
        for port in (self._listener, self._notifier, self._sub, self._pub):
            port.delete()


def open_busy(place: Place, kind: Kind, role: str) -> End:
    return IoxEnd(place, kind, role, False)


def open_blocking(place: Place, kind: Kind, role: str) -> End:
    return IoxEnd(place, kind, role, True)


def blocked_listener_main(place: Place, seconds: float, repeats: int, out: Queue[Any]) -> None:
    """Child: % of a core used while Listener.timed_wait(seconds) waits with no notifier."""
    owner = node(place)
    event = owner.service_builder(iox2.ServiceName.new(place.req + "-idle")).event().create()
    listener = event.listener_builder().create()
    wait = iox2.Duration.from_secs_f64(seconds)

    def block() -> None:
        start = time.monotonic()
        while time.monotonic() - start < 0.9 * seconds:  # a spurious wake waits again
            if listener.timed_wait(wait):
                raise RuntimeError("an event arrived on the idle listener")

    out.put([blocked_cpu_percent(block, seconds) for _ in range(repeats)])
    listener.delete()
