"""The compiled row writer agrees with the checked Python path: the same bytes for every
value it accepts, and for anything else it writes nothing and defers to Python."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmslots import Field, SchemaError, SlotTable
from shmslots._rowcodec import row_hash

FIELDS = (
    Field("i64", "int64"),
    Field("i32", "int32"),
    Field("u8", "uint8"),
    Field("f32", "float32"),
    Field("f16", "float16"),
    Field("bf16", "bfloat16"),
    Field("vec", "float32", (3,)),
    Field("idx", "int64", (2, 2)),
)
DTYPES = [torch.int64, torch.int32, torch.uint8, torch.float32, torch.float16, torch.bfloat16]

numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, width=64),
    st.booleans(),
    st.sampled_from([3.5e38, -3.5e38, 3.4028235e38, 255, 256, -1, 2**31, -(2**31) - 1]),
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(), (3,), (2, 2), (4,), (2, 3)]))
    t = torch.arange(1, 1 + int(torch.tensor(shape).prod()) * 2).to(dtype)
    t = t[::2] if draw(st.booleans()) else t[: t.numel() // 2]  # strided or not
    return t.reshape(shape) if t.is_contiguous() else t.view(-1)[: t.numel()]


values = st.dictionaries(
    st.sampled_from([f.name for f in FIELDS] + ["nope"]),
    st.one_of(numbers, tensors()),
    max_size=4,
)


def _row(table: SlotTable, slot: int) -> bytes:
    rows = table._rows
    return b"".join(rows.field_bytes(slot, f.name) for f in FIELDS)


def _outcome(write: Any) -> str:
    try:
        write()
    except SchemaError as exc:
        return f"SchemaError: {exc}"
    return "ok"


def test_compiled_and_python_writes_agree(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=2) as table:
        rows = table._rows

        @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(fields=values)
        def agree(fields: dict[str, Any]) -> None:
            fast, slow = table.claim(), table.claim()
            for ws in (fast, slow):  # same starting bytes: residue of earlier examples differs
                base = table.layout.row(ws.slot)
                rows._mv[base : base + table.layout.row_size] = bytes(table.layout.row_size)
            try:
                fast_outcome = _outcome(lambda: fast.write(**fields))
                slow_outcome = _outcome(lambda: rows.write(slow.slot, rows.prepare(fields)))
                assert fast_outcome == slow_outcome
                assert _row(table, fast.slot) == _row(table, slow.slot)
            finally:
                fast.abort()
                slow.abort()

        agree()


PLAIN = {"i64": -5, "i32": 2**31 - 1, "u8": 255, "f32": 1.5, "vec": torch.ones(3)}


@pytest.mark.parametrize(
    "odd",
    [
        {"nope": 1},  # unknown field
        {"f16": 1.0},  # half-precision scalars go through torch
        {"u8": 256},  # does not fit
        {"i64": True},  # bools are refused by the Python path
        {"f32": 1e39},  # does not fit a float32
        {"vec": torch.ones(6)[::2]},  # strided
        {"vec": torch.ones(3, dtype=torch.float64)},  # wrong dtype
        {"idx": torch.zeros(4, dtype=torch.int64)},  # wrong shape
    ],
)
def test_only_the_plain_case_is_compiled(name: str, odd: dict[str, Any]) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as table:
        ws = table.claim()
        assert table._rows.write_plain(ws.slot, PLAIN)
        assert not table._rows.write_plain(ws.slot, {**PLAIN, **odd})
        ws.abort()


def test_a_refused_write_changes_no_byte(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as table:
        ws = table.claim()
        before = _row(table, ws.slot)
        with pytest.raises(SchemaError):  # the good fields come first, the bad one last
            ws.write(i64=7, vec=torch.ones(3), idx=torch.zeros(2, 2, dtype=torch.int32))
        assert _row(table, ws.slot) == before
        ws.abort()


def test_the_checksum_sees_every_byte(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as table:
        rows = table._rows
        base = table.layout.row(0)
        payload = rows._mv[base + 16 : base + table.layout.row_size]
        assert rows.checksum(0) == row_hash(payload)
        seen = {rows.checksum(0)}
        for i in range(payload.nbytes):
            for bit in (0x01, 0x80):
                payload[i] ^= bit
                seen.add(rows.checksum(0))
                payload[i] ^= bit
        assert len(seen) == 1 + 2 * payload.nbytes  # every single-bit flip changes it
        payload.release()


def test_the_checksum_sees_where_bytes_are() -> None:
    words = [i.to_bytes(8, "little") for i in range(1, 1 + 8192 // 8)]  # an EAGLE-sized row
    seen = {row_hash(b"".join(words))}
    for i in range(len(words) - 1):  # swap each word with the next: same bytes, new places
        swapped = [*words[:i], words[i + 1], words[i], *words[i + 2 :]]
        seen.add(row_hash(b"".join(swapped)))
    assert len(seen) == len(words)


def test_the_codec_refuses_a_slot_outside_its_rows(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=2) as table:
        codec = table._rows._codec
        assert codec is not None
        for slot in (-1, 2, 2**62):
            with pytest.raises(IndexError):
                codec.write(slot, {"i64": 1})
            with pytest.raises(IndexError):
                codec.checksum(slot)
            with pytest.raises(IndexError):
                codec.seal(slot, 1)


def test_odd_tensors_take_the_python_path_and_land_right(name: str) -> None:
    """Tensors the compiled path must not copy raw: a lazily negated view, one without
    storage, and any write under a torch-function mode."""
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    negated = torch._neg_view(torch.arange(3, dtype=torch.float32))  # is_neg(): bits say +
    freed = torch.ones(3)
    freed.untyped_storage().resize_(0)  # how FSDP frees a parameter: data_ptr() is 0
    with SlotTable.create(name, FIELDS, slots=1) as table:
        rows = table._rows
        ws = table.claim()
        assert not rows.write_plain(ws.slot, {"vec": negated})
        ws.write(vec=negated)
        assert torch.equal(ws.view("vec"), torch.tensor([0.0, -1.0, -2.0]))
        assert not rows.write_plain(ws.slot, {"vec": freed})
        with pytest.raises(SchemaError, match="storage"):  # torch's own copy_ would crash
            ws.write(vec=freed)
        with Passthrough():
            assert not rows.write_plain(ws.slot, {"vec": torch.ones(3)})
            ws.write(vec=torch.full((3,), 7.0))
        assert torch.equal(ws.view("vec"), torch.full((3,), 7.0))
        ws.abort()


def test_a_codec_cannot_be_initialized_twice(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as table:
        codec = table._rows._codec
        assert codec is not None
        with pytest.raises(RuntimeError, match="already"):
            codec.__init__(bytearray(64), 0, 64, 1, 16, (), torch.Tensor, bool)  # type: ignore[misc]
        assert codec.checksum(0) == table._rows.checksum(0)
