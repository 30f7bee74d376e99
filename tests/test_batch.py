"""Batch calls (claim_n, publish_all, release_all, abort_all, gather, scatter), cheap rows.

Each batch is one compiled call; a list with a bad item is refused whole, and an error
part-way leaves what was done done (and says so) and the rest owned by its handles.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Sequence

import pytest
import torch
from conftest import SMALL, Children, row_bytes, small_row
from torch.utils._python_dispatch import TorchDispatchMode

from shmslots import (
    Field,
    InvalidArgument,
    LeakedViewError,
    Lease,
    SchemaError,
    SlotTable,
    StaleLeaseError,
    WriteSlot,
)

SCALARS = (
    Field("i64", "int64", (1,)),
    Field("f16", "float16", (1,)),
    Field("bf16", "bfloat16", (1, 1)),
    Field("f32", "float32"),
    Field("pair", "float32", (2,)),
)


def _publish(t: SlotTable, n: int, start: int = 0) -> None:
    slots = t.claim_n(n, tag=7)
    assert len(slots) == n
    for i, ws in enumerate(slots):
        ws.write(**small_row(start + i))
    t.publish_all(slots)


def _states(t: SlotTable) -> dict[str, int]:
    return {k: v for k, v in t.stats().states.items() if v}


def test_a_batch_round_trip_in_batch_calls(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=8) as t:
        _publish(t, 6)
        assert _states(t) == {"READY": 6, "FREE": 2}
        leases = t.poll(8)
        assert t.gather(leases, "id").tolist() == list(range(6))
        h = t.gather(leases, "h")
        assert h.shape == (6, 2, 8) and h.dtype == torch.bfloat16
        assert torch.equal(h, torch.stack([x.copy("h") for x in leases]))
        t.release_all(leases[:3])
        t.abort_all(tuple(leases[3:]))
        assert all(not x._open for x in leases)
        assert _states(t) == {"FREE": 8} and t.stats().queued == 0


def test_claim_n_takes_what_is_free_and_never_waits(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=4) as t:
        assert t.claim_n(0) == []
        first = t.claim_n(3, tag=1)
        rest = t.claim_n(3, tag=2)
        assert [type(x) for x in first + rest] == [WriteSlot] * 4
        assert [x.tag for x in rest] == [2] and t.claim_n(1) == []
        for bad in (-1, 1.0, True):
            with pytest.raises(InvalidArgument, match="n must be"):
                t.claim_n(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="tag"):
            t.claim_n(1, tag=-1)
        for ws in first + rest:
            ws.abort()
        assert _states(t) == {"FREE": 4}


def test_a_list_with_a_bad_item_is_refused_whole(name: str) -> None:
    with (
        SlotTable.create(name, SMALL, slots=8) as t,
        SlotTable.create(name + "-other", SMALL, slots=2) as other,
    ):
        _publish(t, 4)
        leases = t.poll(4)
        gone = leases.pop()
        gone.release()
        _publish(other, 1)
        foreign = other.poll(1)[0]
        cases: list[tuple[list[object], type[Exception], str]] = [
            ([*leases, "x"], InvalidArgument, r"item 3 is 'x', not a Lease"),
            ([*leases, foreign], InvalidArgument, "not a Lease of table"),
            ([leases[0], *leases], InvalidArgument, "item 1 is item 0 again"),
            ([*leases, gone], StaleLeaseError, "already handed back"),
        ]
        for items, error, match in cases:
            for call in (t.release_all, t.abort_all):
                with pytest.raises(error, match=match) as info:
                    call(items)  # type: ignore[arg-type]
                assert all(x._open for x in leases)
                assert _states(t) == {"HELD": 3, "FREE": 5}
            if error is StaleLeaseError:
                assert "nothing was done" in info.value.__notes__[0]
        for items, error, match in cases[:1]:
            with pytest.raises(error, match=match):
                t.gather(items, "id")  # type: ignore[arg-type]
        with pytest.raises(StaleLeaseError, match="cannot gather"):
            t.gather([*leases, gone], "id")
        t.release_all(leases)
        foreign.release()


def test_publish_all_refuses_unwritten_rows_with_nothing_published(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=4) as t:
        slots = t.claim_n(3)
        for ws in slots[:2]:
            ws.write(**small_row(1))
        slots[2].write(id=1)
        with pytest.raises(SchemaError, match=r"never written") as info:
            t.publish_all(slots)
        assert info.value.__notes__ == ["publish_all: item 2 was refused; nothing was done"]
        assert _states(t) == {"WRITING": 3, "FREE": 1}
        with pytest.raises(InvalidArgument, match="item 1 is 'x'"):
            t.publish_all([slots[0], "x"])  # type: ignore[list-item]
        slots[2].write(**small_row(2))
        t.publish_all(iter(slots))  # any iterable
        assert _states(t) == {"READY": 3, "FREE": 1}
        t.abort_all(t.poll(3))


def test_an_error_part_way_leaves_done_items_done_and_says_so(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=8, strict=True) as t:
        _publish(t, 5)
        leases = t.poll(5)
        kept = leases[2].view("p")  # strict: releasing while it lives is refused
        with pytest.raises(LeakedViewError) as info:
            t.release_all(leases)
        assert info.value.batch_done == 2  # type: ignore[attr-defined]
        assert "items 0..1 were released, items 2 on are still owned" in info.value.__notes__[0]
        assert [x._open for x in leases] == [False, False, True, True, True]
        assert _states(t) == {"HELD": 3, "FREE": 5}
        del kept
        t.release_all(leases[2:])
        assert _states(t) == {"FREE": 8}

        slots = t.claim_n(3)
        for i, ws in enumerate(slots):
            ws.write(**small_row(i))
        held = slots[1].view("p")
        with pytest.raises(LeakedViewError) as info:
            t.publish_all(slots)
        assert info.value.batch_done == 1  # type: ignore[attr-defined]
        assert "items 0..0 were published" in info.value.__notes__[0]
        assert _states(t) == {"READY": 1, "WRITING": 2, "FREE": 5}
        del held
        t.publish_all(slots[1:])
        leases = t.poll(3)
        assert t.gather(leases, "id").tolist() == [0, 1, 2]
        t.abort_all(leases)


def test_gather_checks_field_and_out_and_writes_nothing_when_wrong(name: str) -> None:
    fields = (*SMALL, Field("blob", "float32", (None,), kind="ref"))
    with SlotTable.create(name, fields, slots=4, arena_bytes=1 << 16) as t:
        for i, ws in enumerate(t.claim_n(3)):
            ws.write(**small_row(i), blob=torch.zeros(3))
            ws.publish()
        leases = t.poll(3)
        resized = torch.zeros(3, 4)
        resized.untyped_storage().resize_(8)
        bad_outs: list[tuple[object, str]] = [
            (torch.zeros(3, 4, dtype=torch.float64), "out is torch.float64"),
            (torch.zeros(2, 4), r"needs \(3, 4\)"),
            (torch.zeros(4, 3).t(), "contiguous"),
            (resized, "storage no longer holds"),
            ([0.0] * 12, "must be a torch.Tensor"),
        ]
        for out, match in bad_outs:
            before = out.clone() if isinstance(out, torch.Tensor) and out is not resized else None
            with pytest.raises(SchemaError, match=match):
                t.gather(leases, "p", out)  # type: ignore[arg-type]
            if before is not None:
                assert isinstance(out, torch.Tensor) and torch.equal(out, before)
        for field, match in (("blob", "ref field"), ("nope", "not a field")):
            with pytest.raises(SchemaError, match=match):
                t.gather(leases, field)
            with pytest.raises(SchemaError, match=match):
                t.gather(leases, field, torch.zeros(3, 4))
        batch = torch.full((5, 4), -1.0)
        assert t.gather(leases, "p", batch[1:4]).data_ptr() == batch[1].data_ptr()
        assert batch[:, 0].tolist() == [-1.0, 0.0, 1.0, 2.0, -1.0]
        assert t.gather([], "p").shape == (0, 4)
        t.release_all(leases)


def _batch_of(start: int, n: int) -> dict[str, torch.Tensor]:
    """small_row(start), ..., small_row(start + n - 1), field by field, as batch tensors."""
    rows = [small_row(start + i) for i in range(n)]
    return {
        "id": torch.tensor([r["id"] for r in rows]),
        "p": torch.stack([r["p"] for r in rows]),
        "h": torch.stack([r["h"] for r in rows]),
    }


def test_scatter_writes_a_batch_field_by_field(name: str) -> None:
    """Each field of n write slots from one batch, as n write()s would; any layout."""
    with SlotTable.create(name, SMALL, slots=8) as t:
        slots = t.claim_n(3, tag=1)
        batch = _batch_of(10, 3)
        t.scatter(slots, "id", batch["id"].tolist())  # numbers
        t.scatter(slots, "p", batch["p"].t().contiguous().t())  # strided: copied first
        with pytest.raises(SchemaError, match="never written"):
            t.publish_all(slots)
        t.scatter(slots, "h", batch["h"])
        t.publish_all(slots)
        leases = t.poll(8)
        assert t.gather(leases, "id").tolist() == [10, 11, 12]
        for field in ("p", "h"):
            assert torch.equal(t.gather(leases, field), batch[field])
        t.release_all(leases)
        slots = t.claim_n(2, tag=1)
        t.scatter(slots, "id", torch.tensor([5, 6]))
        for field in ("p", "h"):
            t.scatter(slots, field, _batch_of(5, 2)[field])
        t.scatter([], "p", torch.zeros(0, 4))
        with _Passthrough():  # a torch-function mode: admit_batch, then one call with it off
            t.scatter(slots, "p", torch.full((2, 4), 9.0))
        t.publish_all(slots)
        leases = t.poll(8)
        assert t.gather(leases, "p").tolist() == [[9.0] * 4] * 2
        assert t.gather(leases, "id").tolist() == [5, 6]
        t.release_all(leases)


def test_scatter_refuses_bad_input_and_writes_nothing(name: str) -> None:
    fields = (*SMALL, Field("blob", "float32", (None,), kind="ref"))
    with SlotTable.create(name, fields, slots=4, arena_bytes=1 << 16) as t:
        slots = t.claim_n(3, tag=1)
        done = t.claim(tag=2)
        done.abort()
        before = [row_bytes(t, slot) for slot in range(4)]
        short = torch.zeros(3, 4)
        short.untyped_storage().resize_(8)
        bad: list[tuple[Sequence[object], str, object, type[Exception], str]] = [
            (slots, "p", torch.zeros(3, 4, dtype=torch.float64), SchemaError, "float32 tensor"),
            (slots, "p", torch.zeros(2, 4), SchemaError, r"shape \(3, 4\)"),
            (slots, "p", "nope", SchemaError, "got 'nope'"),
            (slots, "p", short, SchemaError, "storage no longer holds"),
            (slots, "id", [1, 2, 2**70], SchemaError, "int64 tensor"),
            (slots, "blob", torch.zeros(3, 4), SchemaError, "ref field"),
            (slots, "nope", torch.zeros(3, 4), SchemaError, "not a field"),
            ([*slots[:2], slots[0]], "p", torch.zeros(3, 4), InvalidArgument, "item 0 again"),
            ([*slots[:2], done], "p", torch.zeros(3, 4), StaleLeaseError, "handed back"),
            ([*slots[:2], "x"], "p", torch.zeros(3, 4), InvalidArgument, "not a WriteSlot"),
        ]
        for items, field, values, error, match in bad:
            with pytest.raises(error, match=match):
                t.scatter(items, field, values)  # type: ignore[arg-type]
        assert [row_bytes(t, slot) for slot in range(4)] == before
        assert all(ws._written == set() for ws in slots)
        for ws in slots:
            ws.abort()


def test_scatter_checks_a_batch_before_torch_copies_it(name: str) -> None:
    """A strided batch whose storage was resized down is refused before torch is asked for
    a contiguous copy (which would read past the storage: a crash, or heap bytes in the
    row); numbers are taken only as write() takes them; a layout without storage, a meta
    tensor or a subclass whose torch functions raise gets a SchemaError, not torch's."""
    fields = (*SMALL, Field("u", "uint8", (2,)), Field("x", "float16"), Field("f", "bool"))

    class Raising(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            raise KeyError("no torch functions")

    with SlotTable.create(name, fields, slots=4) as t:
        slots = t.claim_n(3, tag=1)
        before = [row_bytes(t, slot) for slot in range(4)]
        for size in (0, 8):
            short = torch.full((4, 3), 7.0).t()  # (3, 4), strided
            short.untyped_storage().resize_(size)
            with pytest.raises(SchemaError, match="storage no longer holds"):
                t.scatter(slots, "p", short)
        numbers = [
            ("id", [1, 2.5, 3]),
            ("id", [1, True, 3]),
            ("u", [[1, 2], [3, -1], [4, 5]]),  # torch would wrap it to 255
            ("x", [1.0, 1e10, 2.0]),  # torch would make it inf
            ("f", [True, 5, False]),
            ("u", [[1, 2], [3], [4, 5]]),
            ("h", [[[10**400] * 8] * 2] * 3),  # bfloat16: torch says it does not fit
        ]
        for field, values in numbers:
            with pytest.raises(SchemaError, match=f"field '{field}' takes"):
                t.scatter(slots, field, values)
        with warnings.catch_warnings():  # torch: nested tensors are a prototype
            warnings.simplefilter("ignore", UserWarning)
            nested = torch.nested.nested_tensor([torch.zeros(4)] * 3)
        for values in (torch.zeros(3, 4, device="meta"), torch.zeros(3, 4).to_sparse(), nested):
            with pytest.raises(SchemaError):
                t.scatter(slots, "p", values)
        assert [row_bytes(t, slot) for slot in range(4)] == before
        assert all(ws._written == set() for ws in slots)
        t.scatter(slots, "p", torch.full((3, 4), 2.0).as_subclass(Raising))  # copied first
        t.scatter(slots, "u", [[1, 2], [3, 4], [5, 6]])
        t.scatter([], "p", [])
        assert all(ws._written == {"p", "u"} for ws in slots)
        for ws in slots:
            ws.abort()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("how", ["scatter", "write"])
def test_no_write_lands_in_a_row_its_handle_was_handed_back_from(
    name: str, k: int, how: str
) -> None:
    """A garbage collection between the check that a write slot is open and the copy runs
    Python that may abort it and give its slot to a new owner: none happens in between."""
    with SlotTable.create(name, SMALL, slots=3) as t:
        slots = t.claim_n(3, tag=1)
        state: dict[str, object] = {"n": 0}

        def collected(phase: str, info: object) -> None:
            n = state["n"]
            if phase != "start" or not isinstance(n, int) or n < 0:
                return
            state["n"] = n + 1
            if n + 1 == k:  # the k-th collection from here on
                state["n"] = -1
                slots[1].abort()
                new = t.claim(tag=9)
                assert new is not None
                new.write(p=torch.full((4,), 99.0))
                state["new"] = new

        threshold = gc.get_threshold()
        gc.callbacks.append(collected)
        gc.set_threshold(1)
        try:
            if how == "scatter":
                t._core.scatter(tuple(slots), "p", torch.ones(3, 4))
            else:
                with contextlib.suppress(StaleLeaseError):  # handed back before the check
                    slots[1].write(p=torch.ones(4))
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(collected)
        new = state.get("new")
        if isinstance(new, WriteSlot):
            assert t._rows.field_bytes(new.slot, "p") == torch.full((4,), 99.0).numpy().tobytes()
            new.abort()
        for ws in slots:
            if ws._open:
                ws.abort()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("into", [False, True])
def test_copy_never_returns_a_row_its_lease_was_handed_back_from(
    name: str, k: int, into: bool
) -> None:
    """A collection between copy()'s check that the lease is open and its copy (torch.empty
    allocates) may run Python that hands the lease back and lets a new owner fill the slot:
    copy() then refuses, rather than return the new owner's row as this lease's."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim().write(**small_row(1)).publish()
        lease = t.take()
        assert lease is not None
        state: dict[str, int] = {"n": 0}

        def collected(phase: str, info: object) -> None:
            if phase != "start" or state["n"] < 0:
                return
            state["n"] += 1
            if state["n"] == k:  # the k-th collection from here on
                state["n"] = -1
                lease.release()
                t.claim(tag=9).write(**small_row(99)).publish()

        out = torch.empty(4) if into else None
        threshold = gc.get_threshold()
        gc.callbacks.append(collected)
        gc.set_threshold(1)
        try:
            try:
                got: torch.Tensor | None = lease.copy("p", out=out)
            except StaleLeaseError:
                got = None
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(collected)
        if got is not None:
            assert got.tolist() == [1.0] * 4
        if lease._open:
            lease.release()
        if (other := t.take(timeout=0)) is not None:
            other.release()


def test_scatter_and_gather_of_a_batch_over_the_rows_themselves(name: str) -> None:
    """A batch tensor that is a view of other slots' items moves as if copied first."""
    with SlotTable.create(name, (Field("q", "float32", (16,)),), slots=4) as t:
        slots = t.claim_n(4, tag=1)
        for i, ws in enumerate(slots):
            ws.write(q=torch.full((16,), float(i)))
        column = t._rows.item(0, "q")
        rows = torch.frombuffer(t._segment.mm, dtype=torch.float32, count=64, offset=column)
        t.scatter(slots[1:], "q", rows.view(4, 16)[:3])  # slot k + 1 <- slot k
        assert rows.view(4, 16)[:, 0].tolist() == [0.0, 0.0, 1.0, 2.0]
        t.publish_all(slots)
        leases = t.poll(4)
        assert [lease.slot for lease in leases] == [0, 1, 2, 3]
        t.gather(leases[:3], "q", rows.view(4, 16)[1:])  # row k + 1 <- slot k
        assert rows.view(4, 16)[:, 0].tolist() == [0.0, 0.0, 0.0, 1.0]
        del rows
        t.release_all(leases)


class _Passthrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_gather_and_copy_under_a_torch_function_mode_go_through_torch(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=4) as t:
        _publish(t, 3)
        leases = t.poll(3)
        plain = t.gather(leases, "h")
        with _Passthrough():
            moded = t.gather(leases, "h")
            one = leases[1].copy("p", out=torch.zeros(4))
        assert torch.equal(plain, moded) and one.tolist() == [1.0] * 4
        del plain, moded
        t.release_all(leases)


def test_copy_makes_an_owned_tensor_of_every_shape_and_dtype(name: str) -> None:
    """copy() without out: a fresh, plain CPU tensor of the field's dtype and shape, equal
    to the view and sharing nothing with the row, with or without a torch-function mode."""
    with SlotTable.create(name, SCALARS, slots=2) as t:
        ws = t.claim()
        ws.write(**_scalar_row(torch.tensor([1.0, 2.0]))).publish()
        lease = t.take()
        assert lease is not None
        for field in SCALARS:
            view = lease.view(field.name)
            for made in (lease.copy(field.name), _moded_copy(lease, field.name)):
                assert type(made) is torch.Tensor and made.device.type == "cpu"
                assert (made.dtype, made.shape) == (view.dtype, view.shape)
                assert torch.equal(made, view) and made.is_contiguous()
                assert made.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
            del view
        kept = lease.copy("pair")
        lease.release()
        t.claim().write(**_scalar_row(torch.tensor([9.0, 9.0]))).publish()
        assert kept.tolist() == [1.0, 2.0]
        with pytest.raises(StaleLeaseError):
            lease.copy("pair")
        leased = t.take()
        assert leased is not None
        with pytest.raises(SchemaError, match="no field"):
            leased.copy("nope")
        leased.release()


class _OtherEmpty(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: untyped
    """A dispatch mode (no torch-function mode is on) whose torch.empty makes another dtype
    or a smaller tensor than asked."""

    def __init__(self, small: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.small = small

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten.empty.memory_format:
            if self.small:
                return func([1], dtype=torch.float32, device="cpu")
            return func(*args, **{**kwargs, "dtype": torch.float16})
        return func(*args, **kwargs)


@pytest.mark.parametrize("small", [False, True])
def test_copy_makes_its_tensor_whatever_a_dispatch_mode_answers(name: str, small: bool) -> None:
    """A dispatch mode may answer torch.empty with another dtype or a smaller tensor: copy()
    makes its tensor with torch's CPU allocator itself, so it is what was asked, and the
    mode is not asked."""
    n = 1 << 18
    with SlotTable.create(name, (Field("a", "float32", (n,)),), slots=1) as t:
        t.claim().write(a=torch.ones(n)).publish()
        lease = t.take()
        assert lease is not None
        with _OtherEmpty(small):
            made = lease.copy("a")
        assert (made.dtype, made.shape) == (torch.float32, (n,))
        assert torch.equal(made, torch.ones(n))
        lease.release()


def _scalar_row(pair: torch.Tensor) -> dict[str, object]:
    return {
        "i64": torch.tensor([7]),
        "f16": torch.tensor([0.5], dtype=torch.float16),
        "bf16": torch.tensor([[-3.25]], dtype=torch.bfloat16),
        "f32": 1.5,
        "pair": pair,
    }


def _moded_copy(lease: Lease, field: str) -> torch.Tensor:
    with _Passthrough():
        return lease.copy(field)


def test_copy_into_a_callers_buffer_and_item_of_one_element_fields(name: str) -> None:
    with SlotTable.create(name, SCALARS, slots=2) as t:
        ws = t.claim()
        ws.write(
            i64=torch.tensor([-(2**40)]),
            f16=torch.tensor([0.1], dtype=torch.float16),
            bf16=torch.tensor([[-3.25]], dtype=torch.bfloat16),
            f32=0.5,
            pair=torch.tensor([1.0, 2.0]),
        )
        ws.publish()
        lease = t.take()
        assert lease is not None
        for field in ("i64", "f16", "bf16", "f32"):
            got = lease.item(field)
            assert type(got) is type(lease.copy(field).item()) and got == lease.copy(field).item()
        with pytest.raises(SchemaError, match="one element"):
            lease.item("pair")
        rows = torch.zeros(3, 2)
        assert lease.copy("pair", out=rows[1]).data_ptr() == rows[1].data_ptr()
        assert rows.tolist() == [[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]
        with pytest.raises(SchemaError, match="needs"):
            lease.copy("pair", out=torch.zeros(3))
        with pytest.raises(SchemaError, match="float16"):
            lease.copy("f16", out=torch.zeros(1))
        lease.release()
        with pytest.raises(StaleLeaseError):
            lease.copy("pair", out=rows[0])
        assert rows[0].tolist() == [0.0, 0.0]


def _batch_producer(name: str, batches: int, n: int) -> None:
    with SlotTable.attach(name, "producer") as t:
        for b in range(batches):
            slots: list[WriteSlot] = []
            while len(slots) < n:  # bounded by the consumer, which frees slots
                slots += t.claim_n(n - len(slots), tag=b)
            if b % 2:  # row by row, or field by field from batch tensors
                for i, ws in enumerate(slots):
                    ws.write(**small_row(b * n + i))
            else:
                for field, values in _batch_of(b * n, n).items():
                    t.scatter(slots, field, values)
            t.publish_all(slots, timeout=10.0)


@pytest.mark.timeout(120)
def test_batches_between_spawned_processes(name: str, children: Children) -> None:
    batches, n = 20, 16
    with SlotTable.create(name, SMALL, slots=2 * n) as t:
        children.start(_batch_producer, name, batches, n)
        seen: list[int] = []
        while len(seen) < batches * n:
            leases: list[Lease] = t.poll(n)
            if not leases:  # the first wait covers the child's start (importing torch)
                first = t.take(timeout=10.0 if seen else 60.0)
                assert first is not None, "the producer stopped early"
                leases = [first]
            seen += t.gather(leases, "id").tolist()
            assert torch.equal(t.gather(leases, "p")[:, 0], t.gather(leases, "id").float())
            t.release_all(leases)
        children.join_all(10.0)
        assert seen == list(range(batches * n))
        assert _states(t) == {"FREE": 2 * n}
