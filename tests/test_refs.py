"""Ref fields: CPU tensors through the arena, CUDA tensors by IPC, alive until release."""

from __future__ import annotations

import os
import signal
from multiprocessing.queues import Queue
from typing import Any

import msgpack
import pytest
import torch
from conftest import SPAWN, Children, row_bytes

from shmslots import (
    CorruptTable,
    Field,
    InvalidSlot,
    LeakedViewError,
    LeakedViewWarning,
    SchemaError,
    SlotsExhausted,
    SlotTable,
    State,
    WriteSlot,
)
from shmslots._core import arena_ref, cuda_ref, parse_ref
from shmslots.ref_codec import decode
from shmslots.schema import DTYPE_INDEX

MiB = 1 << 20
HIDDEN = 4096
FIELDS = (
    Field("id", "int64"),
    Field("blob", "float32", (None,), kind="ref"),
    Field("hidden", "bfloat16", (None, HIDDEN), kind="ref"),
)


def blob(tag: int, n: int = MiB // 4) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + tag


def hidden(tag: int, n: int) -> torch.Tensor:
    return (torch.arange(n * HIDDEN, dtype=torch.float32).view(n, HIDDEN) % 251 + tag).to(
        torch.bfloat16
    )


def _table(name: str, **kw: object) -> SlotTable:
    return SlotTable.create(name, FIELDS, slots=4, arena_bytes=8 * MiB, **kw)  # type: ignore[arg-type]


def test_ref_fields_validate_their_declaration() -> None:
    with pytest.raises(SchemaError, match="at most one None"):
        Field("h", "float32", (None, None), kind="ref")
    with pytest.raises(SchemaError, match="positive ints"):
        Field("h", "float32", (None, 4))  # inline fields have fixed shapes
    with pytest.raises(SchemaError, match="budget"):
        Field("h", "float32", (4,), kind="ref", budget=8)
    with pytest.raises(SchemaError, match="kind"):
        Field("h", "float32", (4,), kind="pointer")
    with pytest.raises(SchemaError, match="kind 'handle' is now called 'ref'"):  # its old name
        Field("h", "float32", (4,), kind="handle")


def test_cpu_tensor_travels_zero_copy_and_is_pinned_until_release(name: str) -> None:
    with _table(name) as t:
        ws = t.claim(tag=1)
        ws.write(id=1, blob=blob(1), hidden=hidden(1, 3)).publish()
        used = t.stats().arena_bytes_used
        assert used >= MiB + 3 * HIDDEN * 2
        lease = t.take()
        assert lease is not None
        got = lease.tensor("blob")
        assert torch.equal(got, blob(1)) and lease.tensor("hidden").shape == (3, HIDDEN)
        assert torch.equal(lease.tensor("hidden"), hidden(1, 3))
        again = t._refs.open(t._rows, lease.slot, 0, "blob")
        again[0] = -5.0  # same memory: zero copy
        assert got[0] == -5.0
        del got, again
        assert t.collect() == 0 and t.stats().arena_bytes_used == used  # still held
        lease.release()
        assert t.stats().arena_bytes_used == used  # pages go when the producer notices
        assert t.collect() >= 1
        assert t.stats().arena_bytes_used == 0 and t.stats().pinned_here == 0


@pytest.mark.parametrize("where", ["write", "lease"])
def test_abort_frees_the_block_too(name: str, where: str) -> None:
    with _table(name) as t:
        ws = t.claim()
        ws.write(id=1, blob=blob(1), hidden=hidden(1, 1))
        if where == "write":
            ws.abort()
        else:
            ws.publish()
            lease = t.take()
            assert lease is not None
            lease.abort()
        t.claim().abort()  # the producer's next claim notices the generation moved on
        assert t.stats().arena_bytes_used == 0


def test_overwriting_a_ref_before_publish_frees_the_old_block(name: str) -> None:
    with _table(name) as t:
        ws = t.claim()
        ws.write(blob=blob(1))
        first = t.stats().arena_bytes_used
        ws.write(blob=blob(2))
        assert t.stats().arena_bytes_used == first
        ws.abort()


def test_leaked_ref_view_is_caught_in_strict_mode(name: str) -> None:
    with _table(name, strict=True) as t:
        t.claim().write(id=1, blob=blob(1), hidden=hidden(1, 1)).publish()
        lease = t.take()
        assert lease is not None
        kept = lease.tensor("hidden")[0, :10]
        with pytest.raises(LeakedViewError, match="hidden"):
            lease.release()
        del kept
        lease.release()


@pytest.mark.parametrize("kept_first", ["blob", "hidden"])
def test_opening_a_second_ref_keeps_watching_the_first(name: str, kept_first: str) -> None:
    other = "hidden" if kept_first == "blob" else "blob"
    with _table(name, strict=True) as t:
        t.claim().write(id=1, blob=blob(1), hidden=hidden(1, 1)).publish()
        lease = t.take()
        assert lease is not None
        kept = lease.tensor(kept_first)
        lease.tensor(other)  # opened after the first was kept: must not reset its baseline
        with pytest.raises(LeakedViewError, match=kept_first):
            lease.release()
        del kept
        lease.release()


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (torch.zeros(8, 4)[:, 0], SchemaError, "contiguous"),
        (torch.zeros(4, dtype=torch.float64), SchemaError, "float32"),
        (torch.zeros(4, 4), SchemaError, "shape"),
        (torch.zeros(4, device="meta"), SchemaError, "cannot be shared"),
        (torch.zeros(16 * MiB // 4), SchemaError, "whole arena"),
    ],
)
def test_bad_ref_tensors_change_nothing(
    name: str, value: torch.Tensor, error: type[Exception], message: str
) -> None:
    with _table(name) as t:
        ws = t.claim()
        before = row_bytes(t, ws.slot)
        with pytest.raises(error, match=message):
            ws.write(id=3, hidden=hidden(3, 1), blob=value)
        assert row_bytes(t, ws.slot) == before
        assert t.stats().arena_bytes_used == 0
        ws.abort()


def test_a_full_arena_is_backpressure_not_corruption(name: str) -> None:
    with _table(name) as t:
        held = [t.claim(), t.claim()]
        for ws in held:
            ws.write(blob=torch.zeros(3 * MiB // 4))
        ws = t.claim()
        with pytest.raises(SlotsExhausted, match="arena"):
            ws.write(blob=torch.zeros(3 * MiB // 4))
        held[0].abort()
        ws.write(blob=torch.zeros(3 * MiB // 4))  # the producer collects the aborted block
        ws.abort()
        held[1].abort()


def test_tables_without_an_arena_refuse_cpu_refs(name: str) -> None:
    with (
        SlotTable.create(name, FIELDS, slots=1) as t,
        t.claim() as ws,
        pytest.raises(SchemaError, match="arena_bytes"),
    ):
        ws.write(blob=blob(1))


def test_ref_over_budget_is_refused(name: str) -> None:
    fields = (Field("b", "float32", (None, 3, 3, 3), kind="ref", budget=64),)
    with SlotTable.create(name, fields, slots=1, arena_bytes=MiB) as t, t.claim() as ws:
        with pytest.raises(SchemaError, match="budget"):
            ws.write(b=torch.zeros(100, 3, 3, 3))
        assert t.stats().arena_bytes_used == 0


def test_corrupt_refs_are_refused_not_followed(name: str) -> None:
    """An arena ref is opened only into this table's own arena, for its field's dtype, as
    many bytes as its shape: anything else is CorruptTable, never a tensor over it."""
    with _table(name) as t:
        t.claim().write(id=1, blob=blob(1), hidden=hidden(1, 1)).publish()
        lease = t.take()
        assert lease is not None
        off = t._rows.item(lease.slot, "blob")
        good = parse_ref(t._rows.field_bytes(lease.slot, "blob"))
        assert len(good) == 6  # an arena ref
        _, dtype, start, nbytes, shape, _ = good
        forged = [
            (arena_ref(dtype, 0, nbytes, shape, name), "outside the arena"),
            (arena_ref(dtype, start, nbytes, shape, name + "x"), "another table's arena"),
            (arena_ref(DTYPE_INDEX["int32"], start, nbytes, shape, name), "another dtype"),
            (arena_ref(dtype, start, nbytes - 4, shape, name), "as many bytes as its shape"),
            (arena_ref(dtype, 2**64 - 8, 64, (16,), name), "outside the arena"),
            (arena_ref(dtype, start, 0, (0, 2**62, 2**62), name), "as many bytes as its shape"),
            (arena_ref(dtype, start, nbytes, (2, shape[0] // 2), name), "its field's shape"),
            (b"\xff\xff", "no valid ref"),
            (b"\x05\x00\x09abcd", "no valid ref"),  # no such kind
        ]
        for item, match in forged:
            t._segment.mm[off : off + len(item)] = item
            with pytest.raises(CorruptTable, match=match):
                lease.tensor("blob")
        lease.release()


def test_cuda_ref_description_round_trips_through_the_row_format() -> None:
    description = {
        "b": "cuda",
        "pid": 1,
        "uuid": "GPU-0000",
        "handle": b"\x01" * 64,
        "size": 4096,
        "soff": 0,
        "rc": b"\x02" * 40,
        "rcoff": 8,
        "event": b"\x03" * 64,
        "sync": True,
        "off": 0,
        "shape": [2, 8],
        "stride": [8, 1],
        "dtype": "bfloat16",
    }
    raw = cuda_ref(msgpack.packb(description)) + b"\0" * 10
    assert decode(raw) == description
    if not torch.cuda.is_available():
        from shmslots.cuda_ipc import open_tensor

        with pytest.raises(SchemaError, match="CUDA is not available"):
            open_tensor(description)


def produce_refs(name: str, n: int, done: Queue[int]) -> None:
    with SlotTable.attach(name, "producer") as t:
        for tag in range(1, n + 1):
            t.claim(tag=tag, timeout=10).write(
                id=tag, blob=blob(tag), hidden=hidden(tag, tag % 5 + 1)
            ).publish()
        while t.stats().states["FREE"] != t.slots:  # wait for the consumer, then collect
            t.collect()
        t.collect()
        done.put(t.stats().arena_bytes_used)


def test_refs_across_spawned_processes(name: str, children: Children) -> None:
    done: Queue[int] = SPAWN.Queue()
    with _table(name) as t:
        children.start(produce_refs, name, 12, done)
        for _ in range(12):
            lease = t.take(timeout=30)
            assert lease is not None
            assert torch.equal(lease.tensor("blob"), blob(lease.tag))
            assert torch.equal(lease.tensor("hidden"), hidden(lease.tag, lease.tag % 5 + 1))
            lease.release()
        assert done.get(timeout=30) == 0  # every block went back after its release
        children.join_all(30)


def take_and_die(name: str) -> None:
    t = SlotTable.attach(name, "consumer")
    lease = t.take(timeout=10)
    assert lease is not None
    lease.tensor("blob")
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("mode", ["redeliver", "drop"])
def test_dead_consumer_does_not_leak_the_block(name: str, children: Children, mode: str) -> None:
    with _table(name, on_consumer_death=mode) as t:
        t.claim(tag=7).write(id=7, blob=blob(7), hidden=hidden(7, 2)).publish()
        proc = children.start(take_and_die, name)
        proc.join(60)
        t.reap()
        if mode == "redeliver":
            lease = t.take()
            assert lease is not None and lease.deliveries == 1
            assert torch.equal(lease.tensor("blob"), blob(7))
            lease.release()
        assert t.slot_info(0)[0] is State.FREE
        t.collect()
        assert t.stats().arena_bytes_used == 0


def _cuda_producer(name: str, ready: Queue[int], release_seen: Queue[int]) -> None:
    with SlotTable.attach(name, "producer") as t:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        h = hidden(1, 3).cuda()
        ws = t.claim(tag=1)
        ws.write(id=1, blob=x, hidden=h)
        ws.publish()
        ready.put(1)
        release_seen.get(timeout=60)
        t.claim().abort()  # notices the release and lets go of x
        ready.put(t.stats().pinned_here)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensor_between_spawned_processes(name: str, children: Children) -> None:
    ready: Queue[int] = SPAWN.Queue()
    release_seen: Queue[int] = SPAWN.Queue()
    with SlotTable.create(name, FIELDS, slots=2) as t:
        children.start(_cuda_producer, name, ready, release_seen)
        assert ready.get(timeout=60) == 1
        lease = t.take(timeout=10)
        assert lease is not None
        got = lease.tensor("blob")
        assert got.is_cuda
        assert torch.equal(got.cpu(), torch.arange(1 << 20, dtype=torch.float32))
        assert torch.equal(lease.tensor("hidden").cpu(), hidden(1, 3))
        desc = decode(t._rows.field_bytes(lease.slot, "blob"))
        from shmslots.cuda_ipc import device_uuid

        assert desc["uuid"] == device_uuid(got.device.index or 0)
        del got
        assert t._refs.pinned() == (0, 0)
        lease.release()
        release_seen.put(1)
        assert ready.get(timeout=60) == 0  # the producer dropped its pin after the release
        children.join_all(60)


PAIR = (
    Field("k", "float32", (None,), kind="ref"),
    Field("v", "float32", (None,), kind="ref"),
)


def _cuda_pair_producer(name: str, ready: Queue[int], done: Queue[int]) -> None:
    with SlotTable.attach(name, "producer") as t:
        kv = torch.arange(2 * 4096, device="cuda", dtype=torch.float32).view(2, 4096)
        for _ in range(2):  # two rows, all four refs into one allocation
            t.claim().write(k=kv[0], v=kv[1]).publish()
        ready.put(1)
        done.get(timeout=60)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_refs_into_one_allocation_are_watched_apart(name: str, children: Children) -> None:
    ready: Queue[int] = SPAWN.Queue()
    done: Queue[int] = SPAWN.Queue()
    with SlotTable.create(name, PAIR, slots=2, strict=True) as t:
        children.start(_cuda_pair_producer, name, ready, done)
        assert ready.get(timeout=60) == 1
        first, second = t.take(timeout=10), t.take(timeout=10)
        assert first is not None and second is not None
        k, v = first.tensor("k"), first.tensor("v")
        assert float(v[0]) == 4096.0
        kept = second.tensor("k")[1:]  # another lease's view of the same allocation
        del k, v
        first.release()  # strict: must not count the other lease's view, or its own other field
        with pytest.raises(LeakedViewError):
            second.release()
        del kept
        second.release()
        done.put(1)
        children.join_all(60)


def _loan_reader(name: str, out: Any) -> None:
    with SlotTable.attach(name, "reader") as t:
        lease = t.take(timeout=10)
        assert lease is not None
        blob = lease.tensor("blob")
        same = lease.tensor("blob").data_ptr() == blob.data_ptr()  # one opened tensor, zero copy
        out.put((blob.shape[0], float(blob.sum()), same))
        del blob
        lease.release()


@pytest.mark.timeout(60)
def test_a_loaned_arena_tensor_is_filled_in_place_and_read_zero_copy(
    name: str, children: Children
) -> None:
    got = SPAWN.Queue()
    with _table(name) as t:
        ws = t.claim()
        loan = ws.alloc("blob", (1000,))  # arena pages; the row refers to them already
        loan.fill_(2.5)  # filled in place: no copy into the table
        ws.write(id=1, hidden=hidden(1, 1))
        del loan  # a loan is the writer's until publish
        ws.publish()
        assert t.stats().arena_bytes_used >= 4000
        children.start(_loan_reader, name, got)
        assert got.get(timeout=30) == (1000, 2500.0, True)
        children.join_all(timeout=30)


def test_alloc_refuses_bad_input_and_a_loan_kept_past_publish_is_reported(name: str) -> None:
    with _table(name) as t:
        ws = t.claim()
        for field, shape in (("id", (1,)), ("blob", (3, 4)), ("blob", (-1,)), ("nope", (1,))):
            with pytest.raises(SchemaError):
                ws.alloc(field, shape)
        with pytest.raises(SchemaError, match="whole arena"):
            ws.alloc("blob", (3 * MiB,))  # 12 MiB of float32 in an 8 MiB arena
        assert t.stats().arena_bytes_used == 0  # nothing was taken by the refusals
        first = ws.alloc("blob", (10,))
        kept_at = first.data_ptr()
        with pytest.warns(LeakedViewWarning, match="previous loan"):
            second = ws.alloc("blob", (20,))  # replaces `first`, whose pages go at once
        ws.write(id=2, hidden=hidden(2, 1))  # but to no other block of this row
        with pytest.warns(LeakedViewWarning, match="blob"):
            ws.publish()  # `second` is still referenced: it would see the next row's data
        assert t.stats().counters["leaked_views"] == 2
        del first, second
        lease = t.take()
        assert lease is not None and lease.tensor("blob").shape == (20,)
        at, nbytes = lease.tensor("hidden").data_ptr(), lease.tensor("hidden").nbytes
        assert not at <= kept_at < at + nbytes  # `first` does not write into this row
        lease.release()


def test_a_loan_is_the_same_through_the_compiled_path_and_the_slow_one(name: str) -> None:
    """alloc's plain case is compiled (csrc/leases.c); a shape given as a list, a replacement
    and every refusal take the Python path.  Both lend the same block and write the same ref,
    and a refusal on either lends nothing."""
    with _table(name) as t:
        ws = t.claim()
        bad = [
            ("blob", (True,)), ("blob", (2.0,)), ("blob", (3, 4)), ("blob", (2**63,)),
            ("blob", (2**62 - 1,)), ("hidden", (2**51 - 1, HIDDEN)),  # bytes just under 2**64
            ("hidden", (1, 8)), ("hidden", (1,)), ("id", (1,)), ("nope", (1,)), (3, (1,)),
        ]  # fmt: skip
        for field, shape in bad:
            with pytest.raises(SchemaError):
                ws.alloc(field, shape)  # type: ignore[arg-type]
            assert t._refs.pinned() == (0, 0) and t.stats().arena_blocks == 0, (field, shape)
        stray = WriteSlot(t, 99, 0, 0)  # a handle made in Python for a slot past the table
        with pytest.raises(InvalidSlot):  # worded by Python: the compiled path hands it over
            stray.alloc("blob", (1,))
        refs: list[tuple[Any, ...]] = []
        shapes: list[Any] = [(10,), [10]]  # compiled, then Python
        for shape in shapes:
            w = ws if not refs else t.claim()
            w.alloc("blob", shape).fill_(1.5)
            w.write(id=len(refs), hidden=hidden(1, 1)).publish()
            lease = t.take()
            assert lease is not None
            refs.append(parse_ref(t._rows.field_bytes(lease.slot, "blob")))
            assert lease.tensor("blob").tolist() == [1.5] * 10
            lease.release()
        assert refs[0][0:1] + refs[0][3:] == refs[1][0:1] + refs[1][3:]  # all but the place
        ws = t.claim()
        ws.alloc("blob", (10,))  # compiled
        ws.alloc("blob", (30,))  # a replacement: Python, which gives the first block back
        assert t._refs.pinned() == (1, 120) and t.stats().arena_blocks == 1
        ws.abort()
        assert t._refs.collect_own() == 1 and t.stats().arena_blocks == 0


def test_a_loan_refused_late_lends_nothing(name: str) -> None:
    """A ref over its field's budget (here: the table's name is long) and a full arena are
    found by the compiled path, then worded by the slow one; neither leaves a block lent."""
    long_name = name + "-" + "n" * 60
    fields = (Field("blob", "float32", (None,), kind="ref", budget=64),)
    with SlotTable.create(long_name, fields, slots=2, arena_bytes=MiB) as t:
        ws = t.claim()
        with pytest.raises(SchemaError, match="budget"):
            ws.alloc("blob", (4,))
        assert t._refs.pinned() == (0, 0) and t.stats().arena_blocks == 0
        ws.abort()
    with _table(name) as t:
        page = t.layout.arena_page_size
        held = []
        for floats in (MiB, (t.layout.arena_pages - 2) * page // 4 - MiB):  # all pages but 2
            ws = t.claim()
            ws.alloc("blob", (floats,))
            ws.alloc("hidden", (0, HIDDEN))  # a page
            held.append(ws)
        ws = t.claim()
        with pytest.raises(SlotsExhausted):
            ws.alloc("blob", (1,))
        assert t._refs.pinned()[0] == 4 and t.stats().arena_bytes_used == 8 * MiB  # as before
        for w in [*held, ws]:
            w.abort()


def test_a_producers_next_block_of_a_size_starts_where_its_last_was_freed(name: str) -> None:
    """Row after row, each ref field's block lands on the pages the last row's block of its
    size freed, still in this process's cache (a ring reusing its cell does the same); a
    block of another size goes past them, so it does not split the hole."""
    with _table(name) as t:
        placed = []
        for i in range(3):
            ws = t.claim()
            loan = ws.alloc("blob", (MiB // 4,))  # 1 MiB
            loan.fill_(float(i))
            del loan
            ws.write(id=i, hidden=hidden(i, 2)).publish()
            lease = t.take()
            assert lease is not None
            placed.append(tuple(lease.tensor(f).data_ptr() for f in ("blob", "hidden")))
            lease.release()
        assert placed[0] == placed[1] == placed[2]
        ws = t.claim()  # a blob of 256 KiB, a size no block freed had: not in the 1 MiB hole
        ws.write(id=9, blob=torch.ones(MiB // 16), hidden=hidden(9, 2)).publish()
        lease = t.take()
        assert lease is not None
        small, warm = (lease.tensor(f).data_ptr() for f in ("blob", "hidden"))
        assert not placed[0][0] <= small < placed[0][0] + MiB and warm == placed[0][1]
        lease.release()


def test_a_loan_moved_out_of_the_arena_is_refused_at_publish(name: str) -> None:
    with _table(name) as t:
        ws = t.claim()
        loan = ws.alloc("blob", (8,))
        loan.share_memory_()  # type: ignore[no-untyped-call]  # now a private copy
        loan.fill_(1.0)  # these writes miss the arena
        del loan  # the watch still sees where it points
        ws.write(id=3, hidden=hidden(3, 1))
        with pytest.raises(SchemaError, match="no longer show"):
            ws.publish()
        with pytest.raises(SchemaError, match="never written"):
            ws.publish()  # the field must be filled again
        ws.abort()


def test_forged_cuda_refs_are_corrupt_tables_not_key_errors(name: str) -> None:
    """Every key opening a CUDA ref reads is required and type-checked, and the ref must be
    of its field's dtype and shape, as an arena ref must (#36 item 4)."""
    fields = (Field("blob", "float32", (None, 4), kind="ref", budget=512),)
    good = {
        "b": "cuda", "pid": 1, "uuid": "GPU-0000", "handle": b"\x01" * 64, "size": 4096,
        "soff": 0, "rc": b"\x02" * 40, "rcoff": 8, "event": b"\x03" * 64, "sync": True,
        "off": 0, "shape": [2, 4], "stride": [4, 1], "dtype": "float32",
    }  # fmt: skip
    forged = [
        ({k: v for k, v in good.items() if k != "pid"}, "malformed"),
        ({**good, "stride": [1]}, "malformed"),
        ({**good, "sync": 1}, "malformed"),
        ({**good, "off": -8}, "malformed"),
        ({**good, "dtype": "int32"}, "its field is"),
        ({**good, "shape": [2, 5], "stride": [5, 1]}, "its field is"),
        ({**good, "shape": [1, 2, 4], "stride": [8, 4, 1]}, "its field is"),
        ({**good, "pid": os.getpid()}, "lent none"),  # this process lent an arena tensor
    ]
    with SlotTable.create(name, fields, slots=1, arena_bytes=MiB) as t:
        t.claim().write(blob=torch.zeros(2, 4)).publish()
        lease = t.take()
        assert lease is not None
        off = t._rows.item(lease.slot, "blob")
        for description, match in forged:
            item = cuda_ref(msgpack.packb(description))
            t._segment.mm[off : off + len(item)] = item
            with pytest.raises(CorruptTable, match=match):
                lease.tensor("blob")
        lease.release()


def test_an_arena_ref_must_have_its_fields_rank_and_fixed_sizes(name: str) -> None:
    """A field declared (None, HIDDEN) opens no (1, 2, n, HIDDEN) or (2n, HIDDEN/2) tensor from
    a forged ref, though dtype, byte count and place are right (#36 item 5)."""
    with _table(name) as t:
        t.claim().write(id=1, blob=blob(1), hidden=hidden(1, 4)).publish()
        lease = t.take()
        assert lease is not None
        off = t._rows.item(lease.slot, "hidden")
        good = parse_ref(t._rows.field_bytes(lease.slot, "hidden"))
        assert len(good) == 6  # an arena ref
        _, dtype, start, nbytes, shape, _ = good
        assert shape == (4, HIDDEN)
        for forged in [(1, 2, 2, HIDDEN), (8, HIDDEN // 2), (4 * HIDDEN,)]:
            item = arena_ref(dtype, start, nbytes, forged, name)
            t._segment.mm[off : off + len(item)] = item
            with pytest.raises(CorruptTable, match="its field's shape"):
                lease.tensor("hidden")
        item = arena_ref(dtype, start, nbytes // 2, (2, HIDDEN), name)  # a free size may differ
        t._segment.mm[off : off + len(item)] = item
        assert lease.tensor("hidden").shape == (2, HIDDEN)
        lease.release()
