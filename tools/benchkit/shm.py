"""shmslots in the benchmark (tools/bench.py): the request/reply transport over two tables,
and the measurements only shmslots has (claim cost, contention, an idle blocked reader).

Process A claims, writes and publishes into table REQ; B takes, reads and releases, and
answers through table RESP. Rows are read through zero-copy views; tensor payloads go
through a ref field in the table's arena and are opened with `lease.tensor` (zero copy).
Not run on its own; see tools/bench.py.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import torch

from shmslots import Field, Lease, SchemaError, SlotTable

from .common import (
    CACHED_TOKENS,
    EAGLE,
    HIDDEN_BITS,
    INTS,
    SMALL,
    STALL_S,
    START_S,
    TOPK_INDEX,
    TOPK_P,
    VEC,
    End,
    Kind,
    blocked_cpu_percent,
    pin_self,
    poll_until,
    reply_kind,
    touch,
    unique_name,
)

ARENA_PAGE = 16384
BLOCK_S = 1.0  # one blocking take(); repeated until STALL_S
BATCH = 64  # rows per batch call

SMALL_FIELDS = (Field("id", "int64"), Field("ints", "int64", (5,)), Field("vec", "float32", (64,)))
EAGLE_FIELDS = (
    Field("output_id", "int64"),
    Field("cached_tokens", "int64"),
    Field("topk_p", "float32", (16,)),
    Field("topk_index", "int64", (16,)),
    Field("hidden", "bfloat16", (4096,)),
)


def _ref_field(name: str) -> Field:
    """A ref field of variable length, in this checkout's spelling or in that of one before
    ref fields had their name (`tools/bench.py ab --base` runs this code against those)."""
    try:
        return Field(name, "uint8", (None,), kind="ref")
    except SchemaError:
        return Field(name, "uint8", (None,), kind="handle")


TENSOR_FIELDS = (Field("id", "int64"), _ref_field("x"))


def fields_for(kind: Kind) -> tuple[Field, ...]:
    if kind.tensor:
        return TENSOR_FIELDS
    return EAGLE_FIELDS if kind == EAGLE else SMALL_FIELDS


def id_field(kind: Kind) -> str:
    return "output_id" if kind == EAGLE else "id"


def record_values(kind: Kind) -> dict[str, torch.Tensor]:
    """The fields of one record except its id, as the tensors a producer writes."""
    if kind.tensor:
        pattern = torch.arange(kind.nbytes, dtype=torch.int64) % 251
        return {"x": pattern.to(torch.uint8)}
    if kind == EAGLE:
        return {
            "cached_tokens": torch.tensor(CACHED_TOKENS, dtype=torch.int64),
            "topk_p": torch.tensor(TOPK_P, dtype=torch.float32),
            "topk_index": torch.tensor(TOPK_INDEX, dtype=torch.int64),
            "hidden": torch.tensor(HIDDEN_BITS, dtype=torch.int16).view(torch.bfloat16),
        }
    return {
        "ints": torch.tensor(INTS, dtype=torch.int64),
        "vec": torch.tensor(VEC, dtype=torch.float32),
    }


# -- tables ---------------------------------------------------------------------------------


@contextmanager
def created_table(name: str, kind: Kind, batches: int = 0) -> Iterator[SlotTable]:
    """Create a table for `kind` (room for `batches` batches of BATCH rows, if given, else
    the kind's rows in flight) and always close and unlink it (nothing left in /dev/shm)."""
    slots = batches * BATCH or kind.in_flight
    arena = slots * (kind.nbytes + ARENA_PAGE) if kind.tensor else 0
    table = SlotTable.create(name, fields_for(kind), slots=slots, arena_bytes=arena)
    try:
        yield table
    finally:
        try:
            table.close()
        finally:
            table.unlink()


@contextmanager
def attached(name: str, role: str) -> Iterator[SlotTable]:
    table = SlotTable.attach(name, role)
    try:
        yield table
    finally:
        table.close()


@contextmanager
def table_pair(kind: Kind, batches: int = 0) -> Iterator[tuple[str, str]]:
    """REQ (the session's kind) and RESP (its reply kind), created here; yields their names."""
    with (
        created_table(unique_name(f"req-{kind.name}"), kind, batches) as req,
        created_table(unique_name(f"resp-{kind.name}"), reply_kind(kind), batches) as resp,
    ):
        yield req.name, resp.name


def batch_pair(kind: Kind) -> AbstractContextManager[tuple[str, str]]:
    """table_pair with room for two batches: one is filled while the other is read, as a
    batch pipeline runs (with one batch's room, each side would wait for the other)."""
    return table_pair(kind, batches=2)


# -- the transport ----------------------------------------------------------------------------


class ShmEnd:
    """One side of the REQ/RESP table pair; `timeout` 0 busy-polls, > 0 blocks in take()."""

    def __init__(self, names: tuple[str, str], kind: Kind, role: str, timeout: float) -> None:
        req_name, resp_name = names
        self._req = SlotTable.attach(req_name, f"bench-{role}")
        self._resp = SlotTable.attach(resp_name, f"bench-{role}")
        a_side = role == "a"
        self._out = self._req if a_side else self._resp
        self._in = self._resp if a_side else self._req
        self._out_kind = kind if a_side else reply_kind(kind)
        self._in_kind = reply_kind(kind) if a_side else kind
        self._out_id = id_field(self._out_kind)
        self._in_id = id_field(self._in_kind)
        self._values = record_values(self._out_kind)
        self._row = {self._out_id: 0, **self._values}  # send copies it: one dict reused
        self._names = tuple(f.name for f in fields_for(self._in_kind))
        self._other_names = tuple(n for n in self._names if n != self._in_id)
        self._timeout = timeout
        self._echo_rows = not kind.tensor
        self._put = getattr(self._out, "send", self._put_in_steps)

    def _put_in_steps(
        self, fields: dict[str, Any] | tuple[Any, ...], tag: int, timeout: float
    ) -> None:
        """table.send for a checkout from before it (`bench.py ab --base` of an older one)."""
        if isinstance(fields, tuple):
            fields = dict(zip((f.name for f in fields_for(self._out_kind)), fields, strict=True))
        with self._out.claim(tag=tag, timeout=timeout) as ws:
            ws.write(**fields)
            ws.publish(timeout)

    def send(self, rid: int) -> None:
        self._row[self._out_id] = rid
        self._put(self._row, tag=1, timeout=STALL_S)

    def recv(self) -> int:
        lease = self._take()
        rid = self._read(lease)
        lease.release()
        return rid

    def echo(self) -> int:
        lease = self._take()
        if not self._echo_rows:
            rid = self._read(lease)
            lease.release()
            self.send(rid)
            return rid
        views = lease.views(self._names)  # the schema's order: the reply's row by position
        rid = int(lease.item(self._in_id))
        self._put(views, tag=1, timeout=STALL_S)  # the request row copied into the reply
        del views
        lease.release()
        return rid

    def _take(self) -> Lease:
        table, timeout = self._in, self._timeout
        if not timeout:
            return poll_until(lambda: table.take(0.0), f"take from {table.name}")
        lease = table.take(timeout)
        if lease is not None:  # most calls: the deadline below is read only once one waits
            return lease
        give_up = time.monotonic() + STALL_S
        while (lease := table.take(timeout)) is None:
            if time.monotonic() > give_up:
                raise TimeoutError(f"take from {table.name}: nothing for {STALL_S} s")
        return lease

    def _read(self, lease: Lease) -> int:
        """The id as an int (`item`); every other field fetched zero copy, a tensor touched."""
        if self._in_kind.tensor:
            touch(lease.tensor("x"))
        else:
            lease.views(self._other_names)
        return int(lease.item(self._in_id))

    def close(self) -> None:
        try:
            self._req.close()
        finally:
            self._resp.close()


def open_busy(names: tuple[str, str], kind: Kind, role: str) -> End:
    return ShmEnd(names, kind, role, 0.0)


class LoanEnd(ShmEnd):
    """Busy-polled, tensor payloads written into a loan (ws.alloc) instead of copied in."""

    def send(self, rid: int) -> None:
        """The payload is filled into the loan by memmove, as the bare ring makes its copy
        (torch's copy_ into pages not in cache was slower here): the one copy a producer
        makes anyway, straight into the pages the reader maps."""
        if not self._out_kind.tensor:
            super().send(rid)
            return
        ws = self._out.claim(tag=1, timeout=STALL_S)
        payload = self._values["x"]
        loan = ws.alloc("x", tuple(payload.shape))
        ctypes.memmove(loan.data_ptr(), payload.data_ptr(), payload.nbytes)
        del loan
        ws.write(**{self._out_id: rid})
        ws.publish()


def open_loan(names: tuple[str, str], kind: Kind, role: str) -> End:
    return LoanEnd(names, kind, role, 0.0)


class CopyingEnd(ShmEnd):
    """Code as a user first writes it: claim, write() and publish() a step each, blocking
    take(timeout), an owned `lease.copy()` of every field (what outlives the lease), and
    `write()` of those tensors for the reply."""

    def send(self, rid: int) -> None:
        ws = self._out.claim(tag=1, timeout=STALL_S)
        ws.write(**{self._out_id: rid}, **self._values)
        ws.publish()

    def recv(self) -> int:
        lease = self._take()
        copies = [lease.copy(name) for name in self._names]
        lease.release()
        return int(copies[self._names.index(self._in_id)])

    def echo(self) -> int:
        lease = self._take()
        copies = {name: lease.copy(name) for name in self._names}
        lease.release()
        ws = self._out.claim(tag=1, timeout=STALL_S)
        ws.write(**copies)
        ws.publish()
        return int(copies[self._in_id])


def open_copying(names: tuple[str, str], kind: Kind, role: str) -> End:
    return CopyingEnd(names, kind, role, BLOCK_S)


def open_blocking(names: tuple[str, str], kind: Kind, role: str) -> End:
    return ShmEnd(names, kind, role, BLOCK_S)


class BatchEnd(ShmEnd):
    """Rows moved BATCH at a time, each step one batch call: claim_n, a scatter per field
    (from batch tensors, as a batch producer holds its outputs) and publish_all out; poll,
    gather of the id and release_all in.  Sends wait in a list until it is full, a control
    message is sent, or this side is about to wait (so a round trip still answers)."""

    def __init__(self, names: tuple[str, str], kind: Kind, role: str) -> None:
        super().__init__(names, kind, role, BLOCK_S)
        self._pending: list[int] = []
        self._got: list[int] = []
        self._batches = {
            name: value.expand(BATCH, *value.shape).contiguous()
            for name, value in self._values.items()
        }

    def send(self, rid: int) -> None:
        self._pending.append(rid)
        if len(self._pending) == BATCH or rid < 0:  # a control message goes out at once
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        out = self._out
        slots = out.claim_n(len(pending), tag=1)
        while len(slots) < len(pending):  # the reader has not freed enough yet
            slots.append(out.claim(tag=1, timeout=STALL_S))
        n = len(pending)
        out.scatter(slots, self._out_id, pending)  # the ids as the producer holds them
        for name, batch in self._batches.items():
            out.scatter(slots, name, batch if n == BATCH else batch[:n])
        out.publish_all(slots)

    def recv(self) -> int:
        if not self._got:
            self._flush()
            leases = self._in.poll(BATCH) or [self._take()]
            self._got = self._in.gather(leases, self._in_id).tolist()[::-1]
            self._in.release_all(leases)
        return self._got.pop()

    def echo(self) -> int:
        rid = self.recv()
        self.send(rid)
        return rid


def open_batch(names: tuple[str, str], kind: Kind, role: str) -> End:
    return BatchEnd(names, kind, role)


def time_gather(table: SlotTable, leases: list[Lease], ops: int) -> dict[str, float]:
    """µs per batch of the hidden states of `leases`: table.gather, torch.cat of the same
    bytes from private memory, and torch.stack of per-request clones (SGLang's way)."""
    private = [lease.copy("hidden").unsqueeze(0) for lease in leases]
    out = torch.empty((len(leases), *private[0].shape[1:]), dtype=private[0].dtype)

    def per_op(run: Callable[[], object]) -> float:
        run()
        start = time.perf_counter_ns()
        for _ in range(ops):
            run()
        return (time.perf_counter_ns() - start) / ops / 1e3

    return {
        "gather_us": per_op(lambda: table.gather(leases, "hidden")),
        "gather_out_us": per_op(lambda: table.gather(leases, "hidden", out)),
        "cat_us": per_op(lambda: torch.cat(private)),
        "stack_clones_us": per_op(lambda: torch.stack([lease.copy("hidden") for lease in leases])),
    }


def bench_gather(ops: int, repeats: int) -> dict[str, list[float]]:
    """time_gather over BATCH EAGLE rows, repeated."""
    with created_table(unique_name("gather"), EAGLE) as table:
        values = record_values(EAGLE)
        for i in range(BATCH):
            table.claim(tag=1).write(**{id_field(EAGLE): i}, **values).publish()
        leases = table.poll(BATCH)
        try:
            runs = [time_gather(table, leases, ops) for _ in range(repeats)]
        finally:
            table.release_all(leases)
    return {name: [run[name] for run in runs] for name in runs[0]}


# -- one process ------------------------------------------------------------------------------


def time_claim_abort(table: SlotTable, ops: int) -> float:
    """ns per claim+abort: taking slot ownership and handing it straight back."""
    start = time.perf_counter_ns()
    for _ in range(ops):
        table.claim(tag=1).abort()
    return (time.perf_counter_ns() - start) / ops


def time_local_cycle(table: SlotTable, ops: int) -> float:
    """ns per claim->write->publish->take->read->release of a small row, no IPC wait."""
    values = record_values(SMALL)
    start = time.perf_counter_ns()
    for i in range(ops):
        ws = table.claim(tag=1)
        ws.write(id=i, **values)
        ws.publish()
        lease = table.take(0.0)
        assert lease is not None
        lease.item("id")
        lease.view("ints")
        lease.view("vec")
        lease.release()
    return (time.perf_counter_ns() - start) / ops


def bench_one_process(ops: int, repeats: int) -> dict[str, list[float]]:
    """Both single-process costs, each repeated, after a warmup."""
    with created_table(unique_name("single"), SMALL) as table:
        time_claim_abort(table, ops // 10)
        time_local_cycle(table, ops // 10)
        return {
            "claim_abort_ns": [time_claim_abort(table, ops) for _ in range(repeats)],
            "local_cycle_ns": [time_local_cycle(table, ops) for _ in range(repeats)],
        }


# -- children: contention and an idle blocked reader -----------------------------------------


def contend_main(
    name: str, cpu: int | None, seconds: float, repeats: int, barrier: Barrier, out: Queue[Any]
) -> None:
    """Child: claim+abort in a loop for `seconds`, `repeats` times; reports claims/s each."""
    pin_self(cpu)
    with attached(name, "bench-contend") as table:
        rates = []
        for _ in range(repeats):
            barrier.wait(START_S)  # all contenders start each run together
            count = 0
            start = time.perf_counter()
            end = start + seconds
            while time.perf_counter() < end:
                for _ in range(64):
                    table.claim(tag=1).abort()
                count += 64
            rates.append(count / (time.perf_counter() - start))
        out.put(rates)


def blocked_reader_main(name: str, seconds: float, repeats: int, out: Queue[Any]) -> None:
    """Child: % of a core used while take(timeout=seconds) waits on a table nobody writes."""
    with attached(name, "bench-idle") as table:

        def wait() -> None:
            if table.take(timeout=seconds) is not None:
                raise RuntimeError("a row appeared in the idle table")

        out.put([blocked_cpu_percent(wait, seconds) for _ in range(repeats)])
