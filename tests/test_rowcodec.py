"""The compiled row writer agrees with the checked Python path: the same bytes for every
value it accepts, and for anything else it writes nothing and defers to Python."""

from __future__ import annotations

import platform
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import row_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmslots import Field, SchemaError, SlotTable
from shmslots._core import RowCodec, _row_hash_ways, row_hash
from shmslots.layout import VERSION
from shmslots.rows import RULES, Rows
from shmslots.schema import DTYPE_INDEX

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
                for f, fs in table.schema.slots.items():
                    at = rows.item(ws.slot, f)
                    rows._mv[at : at + fs.item_len] = bytes(fs.item_len)
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
        items = [
            rows._mv[at : at + fs.field.nbytes]
            for f, fs in table.schema.slots.items()
            for at in (rows.item(0, f),)
        ]
        assert rows.checksum(0) == row_hash(items)
        seen = {rows.checksum(0)}
        for item in items:
            for i in range(item.nbytes):
                for bit in (0x01, 0x80):
                    item[i] ^= bit
                    seen.add(rows.checksum(0))
                    item[i] ^= bit
        nbytes = sum(item.nbytes for item in items)
        assert len(seen) == 1 + 2 * nbytes  # every single-bit flip of a field's bytes changes it
        for item in items:
            item.release()


def test_a_read_only_rows_checksums_as_the_codec_does(name: str) -> None:
    """Rows over a mapping nobody writes through (no codec) hash the same items."""
    with SlotTable.create(name, FIELDS, slots=3) as table:
        table.claim().write(i64=-5, i32=7, u8=3, f32=1.5, vec=torch.arange(3.0)).abort()
        reader = Rows(table._segment.mm, table.layout, table.schema)
        try:
            assert reader._codec is None
            for slot in range(3):
                assert reader.checksum(slot) == table._rows.checksum(slot)
        finally:
            assert reader.close() == []


def test_the_checksum_sees_where_bytes_are() -> None:
    words = [i.to_bytes(8, "little") for i in range(1, 1 + 8192 // 8)]  # an EAGLE-sized row
    seen = {row_hash([b"".join(words)])}
    for i in range(len(words) - 1):  # swap each word with the next: same bytes, new places
        swapped = [*words[:i], words[i + 1], words[i], *words[i + 2 :]]
        seen.add(row_hash([b"".join(swapped)]))
    assert len(seen) == len(words)
    # the same bytes split between fields differently are another row
    whole = b"".join(words)
    assert row_hash([whole[:8], whole[8:]]) != row_hash([whole[:16], whole[16:]])


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
    """Tensors the compiled path must not copy raw (a lazily negated view, one without
    storage) take Python's path; a torch-function mode changes nothing, since the compiled
    path reads the tensor's facts without running Python."""
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
            assert rows.write_plain(ws.slot, {"vec": torch.ones(3)})
            ws.write(vec=torch.full((3,), 7.0))
        assert torch.equal(ws.view("vec"), torch.full((3,), 7.0))
        ws.abort()


def test_a_codec_cannot_be_initialized_twice(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as table:
        codec = table._rows._codec
        assert codec is not None
        with pytest.raises(RuntimeError, match="already"):
            codec.__init__(bytearray(64), 0, 64, 1, 16, (), RULES)  # type: ignore[misc]
        assert codec.checksum(0) == table._rows.checksum(0)


def _shrunk(n: int, keep: int = 16) -> torch.Tensor:
    """A float32 tensor whose storage was resized down to `keep` bytes under it."""
    t = torch.ones(n)
    t.untyped_storage().resize_(keep)
    return t


SHRUNK_FIELDS = (Field("v", "float32", (1 << 16,)), Field("i", "int64"))


def test_the_compiled_path_refuses_a_storage_resized_down(name: str) -> None:
    """The compiled write used to copy the tensor in full: heap bytes past the storage
    landed in a row every process can read (a segfault at a few million elements)."""
    with SlotTable.create(name, SHRUNK_FIELDS, slots=1) as table:
        ws = table.claim()
        before = row_bytes(table, ws.slot)
        shrunk = _shrunk(1 << 16)
        assert not table._rows.write_plain(ws.slot, {"i": 1, "v": shrunk})
        with pytest.raises(SchemaError, match="no longer holds its elements"):
            ws.write(i=1, v=shrunk)
        assert row_bytes(table, ws.slot) == before
        ws.abort()


def test_the_python_path_refuses_a_storage_resized_after_the_check(name: str) -> None:
    """prepare() admits a value, write() copies it: a storage resized in between (another
    thread) is refused at the copy too, not read past."""
    with SlotTable.create(name, SHRUNK_FIELDS, slots=1) as table:
        rows = table._rows
        ws = table.claim()
        value = torch.ones(1 << 16)
        plan = rows.prepare({"v": value})
        value.untyped_storage().resize_(16)
        with pytest.raises(SchemaError, match="no longer holds its elements"):
            rows.write(ws.slot, plan)
        with pytest.raises(SchemaError, match="no longer holds its elements"):
            rows.prepare({"v": value})
        strided = torch.ones(1 << 17)[::2]  # the path torch copies first must not read it either
        strided.untyped_storage().resize_(16)
        with pytest.raises(SchemaError, match="no longer holds its elements"):
            ws.write(v=strided)
        ws.abort()


def test_the_arena_path_refuses_a_storage_resized_down(name: str) -> None:
    blob = Field("blob", "float32", (None,), kind="ref")
    with SlotTable.create(name, (blob,), slots=1, arena_bytes=1 << 20) as table:
        ws = table.claim()
        with pytest.raises(SchemaError, match="no longer holds its elements"):
            ws.write(blob=_shrunk(1 << 16))
        value = torch.ones(1 << 16)
        plan = table._rows.prepare({"blob": value})  # admitted, then resized under the copy
        value.untyped_storage().resize_(16)
        with pytest.raises(SchemaError, match="no longer holds its elements"):
            table._refs.pin(ws.slot, ws.generation, blob, plan[0][1])
        assert table.stats().arena_bytes_used == 0 and table._refs.pinned() == (0, 0)
        ws.abort()


class _Sub(torch.Tensor):
    pass


def test_one_rule_set_answers_for_every_kind_of_tensor() -> None:
    """The reason codes rows.py words: 0 plain, > 0 copied by torch first, < 0 refused."""
    f32, shape = torch.float32, (4,)
    past_the_end = torch.empty(0).set_(torch.ones(8).untyped_storage(), 6, (4,), (1,))
    past_the_end.untyped_storage().resize_(8 * 4)  # offset 6 + 4 elements > 8 elements
    lying = torch.arange(8.0)[::2]
    lying.is_contiguous = lambda *a, **k: True  # type: ignore[method-assign]
    cases: list[tuple[object, int]] = [
        (torch.ones(4), 0),
        (torch.ones(8)[::2], 1),  # strided
        (torch._neg_view(torch.ones(4)), 2),  # lazily negated
        (torch.ones(4).as_subclass(_Sub), 8),
        (lying, 1),  # a method set on the instance does not vouch for it
        ([1.0, 2.0, 3.0, 4.0], -1),
        (torch.ones(4, dtype=torch.float64), -2),
        (torch.ones(5), -3),
        (torch.ones(4, device="meta"), -4),
        (torch.ones(4).to_sparse(), -5),
        (_shrunk(4, keep=8), -6),
        (_shrunk(4, keep=0), -6),  # freed, as FSDP frees a parameter
        (past_the_end, -6),
    ]
    assert [RULES.check(v, f32, shape) for v, _ in cases] == [want for _, want in cases]
    assert RULES.check(torch.ones(0), f32, (None,)) == 0  # nothing to read, nothing to hold
    assert RULES.check(torch.ones(3, 7), f32, (None, 7)) == 0  # a handle's free dimension
    assert RULES.check(torch.ones(3, 8), f32, (None, 7)) == -3
    huge = torch.ones(1).expand(2**62)  # stride 0: inside its storage, but 2**64 bytes
    assert RULES.check(huge, f32, (None,)) == -7


def test_neither_a_subclass_nor_a_mode_answers_for_the_tensor(name: str) -> None:
    """The rules ask the tensor itself, with torch functions off: no Python of a subclass or
    a mode runs between the checks and the copy."""
    from torch.overrides import TorchFunctionMode

    class Asked(AssertionError):
        pass

    class Liar(torch.Tensor):
        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise Asked(f"the subclass was asked {func}")

    class Meddler(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise Asked(f"the mode was asked {func}")

    liar = torch.tensor([1.0, 2.0, 3.0]).as_subclass(Liar)
    shrunk, sevens = _shrunk(3, keep=8), torch.full((3,), 7.0)
    with SlotTable.create(name, FIELDS, slots=1) as table:
        ws = table.claim()
        ws.write(vec=liar)
        assert ws.view("vec").tolist() == [1.0, 2.0, 3.0]
        with Meddler():
            with pytest.raises(SchemaError, match="no longer holds"):
                ws.write(vec=shrunk)
            ws.write(vec=sevens)
        assert ws.view("vec").tolist() == [7.0] * 3
        ws.abort()


def test_the_codec_refuses_a_field_whose_bytes_are_not_its_shape(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as table:
        rows = table._rows
        column = table.layout.column(0)
        int32 = DTYPE_INDEX["int32"]
        spec = ("f", column, 64, 4096, 0, 0, torch.int32, int32, (4,))  # claims 4096 B for 16
        with pytest.raises(ValueError, match="dtype times its shape"):
            RowCodec(table._segment.mm, table.layout.seals, 1, (spec,), RULES)
        assert rows.checksum(0) == rows.checksum(0)


LONG_LENGTHS = [255, 256, 257, 319, 320, 321, 1023, 1024, 1025, 1088, 2049, 8192, 8193, 65536 + 65]


def test_every_way_of_computing_the_checksum_gives_the_same_value() -> None:
    """rowhash.c computes long items by AVX2, SSE2 or a portable loop, whichever the CPU has;
    a remote writer's row_hash is checked against the reader's seal, so all must agree."""
    ways = _row_hash_ways([b""])
    if platform.machine() == "x86_64":
        has_avx2 = "avx2" in Path("/proc/cpuinfo").read_text()
        assert len(ways) == (3 if has_avx2 else 2)
    rng = random.Random(7)
    for length in [*range(0, 600), *LONG_LENGTHS, *(rng.randrange(600, 40000) for _ in range(50))]:
        data = rng.randbytes(length)
        cut = rng.randrange(0, length + 1)
        for items in ([data], [data[:cut], data[cut:]], [b"head", data, b"tail"]):
            sums = _row_hash_ways(items)
            assert len(set(sums)) == 1 and sums[0] == row_hash(items), (length, cut, sums)


@pytest.mark.parametrize("length", LONG_LENGTHS)
def test_a_long_items_checksum_sees_every_bit_and_every_stripe_moved(length: int) -> None:
    """Every single-bit flip in a long item changes its checksum, by every way of computing
    it, and so does swapping two 64-byte stripes (the lanes add, so order must still count)."""
    data = bytearray(random.Random(length).randbytes(length))
    whole = row_hash([data])
    seen = {whole}
    flipped = range(0, length, max(1, length // 2048))
    for i in flipped:
        for bit in (0x01, 0x80):
            data[i] ^= bit
            sums = set(_row_hash_ways([data]))
            data[i] ^= bit
            assert len(sums) == 1
            seen |= sums
    assert len(seen) == 1 + 2 * len(flipped)
    for a, b in ((0, 64), (0, 1024), (64, 1088), (length // 128 * 64 - 64, length // 128 * 64)):
        if b + 64 <= length:
            swapped = bytearray(data)
            swapped[a : a + 64], swapped[b : b + 64] = data[b : b + 64], data[a : a + 64]
            assert row_hash([swapped]) != whole, (a, b)


def test_the_checksum_is_the_one_the_format_names() -> None:
    """Fixed values, at lengths each side of the two constructions' boundary, of a stripe, a
    block and a last stripe that overlaps: a checksum that changes must change
    layout.VERSION with it, or a table (and a remote writer's row_hash) of one build is
    misread by another."""
    data = bytes(i * 7 % 251 for i in range(8192))
    sums = [row_hash([data[:n]]) for n in (0, 200, 255, 256, 321, 1025, 8192)]
    assert sums == [
        1942769647,
        2318978598,
        2336569658,
        313831709,
        938998554,
        3064549864,
        3455477859,
    ]
    assert row_hash([data[:200], data]) == 1037284810  # chained through two items
    assert VERSION == 12  # the version these values belong to
