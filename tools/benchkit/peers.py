"""The peers shmslots is measured against (tools/bench.py), as request/reply transports.

* `multiprocessing.Queue` and `multiprocessing.Pipe`: records pickled as tuples of raw bytes;
* `torch.multiprocessing` queue: records as torch tensors, each message in fresh shared
  memory (what putting a tensor on the queue does), received through fd passing;
* the bare ring: busy-polled shared memory (posix_ipc + mmap + struct) with no ownership,
  checks or schema, one single-producer ring per direction. It is the floor.

Not run on its own; see tools/bench.py.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import posix_ipc
import torch
import torch.multiprocessing as torch_mp

from .common import (
    CACHED_TOKENS,
    CTX,
    EAGLE,
    HIDDEN_BITS,
    INTS,
    STALL_S,
    TOPK_INDEX,
    TOPK_P,
    VEC,
    End,
    Kind,
    blocked_cpu_percent,
    check_stall,
    reply_kind,
    touch,
    unique_name,
)

TORCH_CTX = torch_mp.get_context("spawn")


# -- payloads ---------------------------------------------------------------------------------


def plain_fields(kind: Kind) -> tuple[Any, ...]:
    """A record's fields after its id as raw bytes: the cheapest thing to pickle (numpy arrays
    cost a Queue round trip ~70 us more); bfloat16 travels as its bits."""
    if kind.tensor:
        return (pattern(kind.nbytes).tobytes(),)
    if kind == EAGLE:
        return (
            CACHED_TOKENS,
            np.array(TOPK_P, dtype=np.float32).tobytes(),
            np.array(TOPK_INDEX, dtype=np.int64).tobytes(),
            np.array(HIDDEN_BITS, dtype=np.uint16).tobytes(),
        )
    return np.array(INTS, dtype=np.int64).tobytes(), np.array(VEC, dtype=np.float32).tobytes()


def pattern(nbytes: int) -> Any:
    """The bytes of a tensor payload, as a numpy uint8 array."""
    return (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)


def torch_fields(kind: Kind) -> tuple[Any, ...]:
    """The same fields as torch tensors (the hidden state as real bfloat16)."""
    if kind.tensor:
        return ((torch.arange(kind.nbytes, dtype=torch.int64) % 251).to(torch.uint8),)
    if kind == EAGLE:
        hidden = torch.tensor(HIDDEN_BITS, dtype=torch.int16).view(torch.bfloat16)
        return (
            CACHED_TOKENS,
            torch.tensor(TOPK_P, dtype=torch.float32),
            torch.tensor(TOPK_INDEX, dtype=torch.int64),
            hidden,
        )
    return torch.tensor(INTS, dtype=torch.int64), torch.tensor(VEC, dtype=torch.float32)


def shared_copy(value: Any) -> Any:
    """A tensor copied into fresh shared memory (one copy); other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    fresh = torch.empty_like(value).share_memory_()  # type: ignore[no-untyped-call]
    fresh.copy_(value)
    return fresh


def read_message(msg: tuple[Any, ...], kind: Kind) -> int:
    """The id of a received message; a tensor payload is touched page by page."""
    if kind.tensor:
        payload = msg[1]
        touch(np.frombuffer(payload, np.uint8) if isinstance(payload, bytes) else payload)
    return int(msg[0])


# -- message passing: Queue, Pipe, torch queue ------------------------------------------------


class MessageEnd:
    """A transport that moves whole Python messages (rid, *fields); subclasses move them."""

    def __init__(self, kind: Kind, role: str, use_torch: bool) -> None:
        make = torch_fields if use_torch else plain_fields
        a_side = role == "a"
        self._out_kind = kind if a_side else reply_kind(kind)
        self._in_kind = reply_kind(kind) if a_side else kind
        self._fields = make(self._out_kind)
        self._fresh = use_torch
        self._echo_rows = not kind.tensor

    def _put(self, msg: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def _get(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _message(self, rid: int) -> tuple[Any, ...]:
        if self._fresh:
            return (rid, *(shared_copy(v) for v in self._fields))
        return (rid, *self._fields)

    def send(self, rid: int) -> None:
        self._put(self._message(rid))

    def recv(self) -> int:
        return read_message(self._get(), self._in_kind)

    def echo(self) -> int:
        msg = self._get()
        rid = read_message(msg, self._in_kind)
        self._put(msg if self._echo_rows else self._message(rid))
        return rid

    def close(self) -> None:
        pass


class QueueEnd(MessageEnd):
    def __init__(self, queues: tuple[Queue[Any], Queue[Any]], kind: Kind, role: str, fresh: bool):
        super().__init__(kind, role, fresh)
        req, resp = queues
        self._out, self._in = (req, resp) if role == "a" else (resp, req)

    def _put(self, msg: tuple[Any, ...]) -> None:
        self._out.put(msg, timeout=STALL_S)

    def _get(self) -> tuple[Any, ...]:
        msg: tuple[Any, ...] = self._in.get(timeout=STALL_S)
        return msg


class PipeEnd(MessageEnd):
    def __init__(self, conns: tuple[Connection, Connection], kind: Kind, role: str):
        super().__init__(kind, role, False)
        self._conn = conns[0] if role == "a" else conns[1]

    def _put(self, msg: tuple[Any, ...]) -> None:
        self._conn.send(msg)

    def _get(self) -> tuple[Any, ...]:
        if not self._conn.poll(STALL_S):
            raise TimeoutError(f"pipe: nothing for {STALL_S} s")
        msg: tuple[Any, ...] = self._conn.recv()
        return msg


@contextmanager
def _bounded_queues(ctx: Any, kind: Kind) -> Iterator[tuple[Queue[Any], Queue[Any]]]:
    """Two bounded queues (REQ, RESP) from `ctx`, closed afterwards."""
    queues = (ctx.Queue(kind.in_flight), ctx.Queue(kind.in_flight))
    try:
        yield queues
    finally:
        for q in queues:
            q.close()
            q.join_thread()


def queue_pair(kind: Kind) -> AbstractContextManager[tuple[Queue[Any], Queue[Any]]]:
    """Two bounded multiprocessing queues (REQ, RESP)."""
    return _bounded_queues(CTX, kind)


def torch_queue_pair(kind: Kind) -> AbstractContextManager[tuple[Queue[Any], Queue[Any]]]:
    """Two bounded torch.multiprocessing queues (REQ, RESP)."""
    return _bounded_queues(TORCH_CTX, kind)


@contextmanager
def pipe_pair(kind: Kind) -> Iterator[tuple[Connection, Connection]]:
    """One duplex pipe: A's end and B's end, closed afterwards."""
    a_end, b_end = CTX.Pipe(duplex=True)
    try:
        yield a_end, b_end
    finally:
        a_end.close()
        b_end.close()


def open_queue(queues: tuple[Queue[Any], Queue[Any]], kind: Kind, role: str) -> End:
    return QueueEnd(queues, kind, role, False)


def open_torch_queue(queues: tuple[Queue[Any], Queue[Any]], kind: Kind, role: str) -> End:
    return QueueEnd(queues, kind, role, True)


def open_pipe(conns: tuple[Connection, Connection], kind: Kind, role: str) -> End:
    return PipeEnd(conns, kind, role)


def queue_blocked_reader_main(
    queue: Queue[Any], seconds: float, repeats: int, out: Queue[Any]
) -> None:
    """Child: % of a core used while Queue.get(timeout=seconds) waits on an empty queue."""

    def wait() -> None:
        try:
            queue.get(timeout=seconds)
        except Exception:  # queue.Empty, as expected
            return
        raise RuntimeError("a message appeared in the idle queue")

    out.put([blocked_cpu_percent(wait, seconds) for _ in range(repeats)])


# -- the bare ring ------------------------------------------------------------------------------

WORD = struct.Struct("<q")
SMALL_ROW = struct.Struct("<q5q64f")
EAGLE_HEAD = struct.Struct("<qq16f16q")
LINE = 64


def bare_payload(kind: Kind) -> bytes:
    """The record's bytes, its int64 id first (overwritten per message)."""
    if kind.tensor:
        data: bytes = pattern(kind.nbytes).tobytes()
        return bytes(8) + data
    if kind == EAGLE:
        head = EAGLE_HEAD.pack(0, CACHED_TOKENS, *TOPK_P, *TOPK_INDEX)
        return head + np.array(HIDDEN_BITS, dtype=np.uint16).tobytes()
    return SMALL_ROW.pack(0, *INTS, *VEC)


@dataclass(frozen=True)
class Ring:
    """One single-producer ring in the bare segment: two counters, then the cells."""

    head: int  # messages published (written by the producer)
    tail: int  # messages consumed (written by the consumer)
    base: int
    stride: int
    cells: int
    size: int  # payload bytes in a cell

    def cell(self, seq: int) -> int:
        return self.base + (seq % self.cells) * self.stride


def ring_layout(kind: Kind) -> tuple[Ring, Ring, int]:
    """REQ and RESP rings for `kind` and the segment size that holds both."""
    req_size, resp_size = kind.nbytes + 8 * kind.tensor, reply_kind(kind).nbytes
    req_stride = -(-req_size // LINE) * LINE
    resp_stride = -(-resp_size // LINE) * LINE
    cells = kind.in_flight
    req = Ring(0, LINE, 4 * LINE, req_stride, cells, req_size)
    resp_base = req.base + cells * req_stride
    resp = Ring(2 * LINE, 3 * LINE, resp_base, resp_stride, cells, resp_size)
    return req, resp, resp_base + cells * resp_stride


@contextmanager
def bare_segment(kind: Kind) -> Iterator[str]:
    """Create the bare ring segment; always unlinked afterwards. Yields its name."""
    name = "/" + unique_name(f"bare-{kind.name}")
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=ring_layout(kind)[2])
    shm.close_fd()
    try:
        yield name
    finally:
        posix_ipc.unlink_shared_memory(name)


class BareEnd:
    """Busy-polled rings with no ownership, checks or schema: the floor."""

    def __init__(self, name: str, kind: Kind, role: str) -> None:
        req, resp, size = ring_layout(kind)
        shm = posix_ipc.SharedMemory(name)
        self._mm = mmap.mmap(shm.fd, size)
        shm.close_fd()
        self._mv = memoryview(self._mm)
        a_side = role == "a"
        self._out, self._in = (req, resp) if a_side else (resp, req)
        out_kind = kind if a_side else reply_kind(kind)
        self._in_tensor = (reply_kind(kind) if a_side else kind).tensor
        self._payload = bare_payload(out_kind)
        self._sent = 0
        self._taken = 0
        self._echo_rows = not kind.tensor

    def _cell_to_write(self) -> int:
        """Busy-poll until the consumer has left a free cell (inline: this is the floor)."""
        mv, ring, sent = self._mv, self._out, self._sent
        spins = 0
        since = 0.0
        while sent - WORD.unpack_from(mv, ring.tail)[0] >= ring.cells:
            spins += 1
            if not spins & 0x3FF:
                since = check_stall(since, "bare ring: no free cell")
        return ring.cell(sent)

    def _publish(self) -> None:
        self._sent += 1
        WORD.pack_into(self._mv, self._out.head, self._sent)

    def _cell_to_read(self) -> int:
        """Busy-poll until the producer has published the next cell."""
        mv, ring, taken = self._mv, self._in, self._taken
        spins = 0
        since = 0.0
        while WORD.unpack_from(mv, ring.head)[0] <= taken:
            spins += 1
            if not spins & 0x3FF:
                since = check_stall(since, "bare ring: nothing published")
        return ring.cell(taken)

    def _consume(self) -> None:
        self._taken += 1
        WORD.pack_into(self._mv, self._in.tail, self._taken)

    def send(self, rid: int) -> None:
        at = self._cell_to_write()
        self._mv[at : at + len(self._payload)] = self._payload
        WORD.pack_into(self._mv, at, rid)
        self._publish()

    def recv(self) -> int:
        rid = self._read(self._cell_to_read())
        self._consume()
        return rid

    def echo(self) -> int:
        at = self._cell_to_read()
        rid = self._read(at)
        if self._echo_rows:
            to = self._cell_to_write()
            self._mv[to : to + self._in.size] = self._mv[at : at + self._in.size]
            self._consume()
            self._publish()
        else:
            self._consume()
            self.send(rid)
        return rid

    def _read(self, at: int) -> int:
        """The id; rows are seen through a memoryview, tensor payloads touched page by page."""
        if self._in_tensor:
            touch(np.frombuffer(self._mm, np.uint8, self._in.size - 8, at + 8))
        else:
            row = self._mv[at : at + self._in.size]  # zero copy, like a row view
            row.release()
        rid: int = WORD.unpack_from(self._mv, at)[0]
        return rid

    def close(self) -> None:
        self._mv.release()
        self._mm.close()


def open_bare(name: str, kind: Kind, role: str) -> End:
    return BareEnd(name, kind, role)
