"""Hardening (issue 8): hostile segments, memory limits, permissions, leaks and signals.

Every test states the exact error it expects and checks that nothing changed
on the way: a refused attach writes no byte of the segment and keeps no file
descriptor, a refused create leaves no /dev/shm entry, and a process that is
interrupted leaves a table its peers can go on using.

1. Untrusted segments: property-based mutations of a valid header and
   forged schema blobs.  The only acceptable outcomes of `SlotTable.attach`
   and `TableView.open` are success (harmless mutation) or the documented
   `IncompatibleTable` family, never struct.error, TypeError, RecursionError,
   a hang or a huge allocation.
2. Memory limits: a table bigger than /dev/shm fails at create time.
3. Permissions: another uid cannot attach, whatever the file mode says.
4. Leaks: thousands of create/attach/close/unlink cycles and refusals leave
   descriptors, mappings, /dev/shm and resident memory flat.
5. Signals: SIGINT or SIGTERM in the middle of a write or read loop, and an
   interrupt that lands between a transition and its handle noting it.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import mmap
import os
import random
import re
import signal
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import msgpack
import posix_ipc
import pytest
import torch
from conftest import SMALL, SPAWN, Children, small_row
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmslots import (
    CorruptTable,
    Field,
    IncompatibleTable,
    Lease,
    OutOfSharedMemory,
    OwnershipError,
    ShmSlotsError,
    SlotsExhausted,
    SlotTable,
    State,
    TableExists,
    TableNotFound,
    TableNotReady,
    TablePermissionError,
    _core,
    validate,
)
from shmslots import layout as L
from shmslots.schema import DTYPE_SIZES, RowSchema
from shmslots.snapshot import TableView
from shmslots.states import Event

_examples = itertools.count()
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- helpers ----------------------------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps() -> list[str]:
    return Path("/proc/self/maps").read_text().splitlines()


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _shm_entries(prefix: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _segment(name: str) -> bytes:
    return Path(f"/dev/shm/{name}").read_bytes()


def _poke(name: str, offset: int, data: bytes) -> None:
    """Overwrite bytes of a segment through its file, as a hostile process would."""
    with open(f"/dev/shm/{name}", "r+b") as f:
        f.seek(offset)
        f.write(data)


def _attach_and_use(name: str) -> RowSchema:
    with SlotTable.attach(name, "fuzz") as t:
        t.stats()
        t.check_consistency()
        return t.schema


def _view_and_use(name: str) -> RowSchema:
    with TableView.open(name) as view:
        view.snapshot()
        return view.schema


def _open_both(name: str) -> list[RowSchema | Exception]:
    """What `SlotTable.attach` and `TableView.open` give: the schema, or what they raised."""
    outcomes: list[RowSchema | Exception] = []
    for opener in (_attach_and_use, _view_and_use):
        try:
            outcomes.append(opener(name))
        except Exception as exc:  # every kind is caught so the assertion can name it
            outcomes.append(exc)
    return outcomes


def _assert_outcome(
    name: str, expected: type[Exception] | None, match: str = "", schema: RowSchema | None = None
) -> None:
    """Both openers succeed (expected None) or raise exactly `expected`; refusals change nothing."""
    before = _segment(name)
    fds = _fds()
    with mock.patch.object(validate, "INIT_WAIT_S", 0.02):  # a zeroed magic waits for a creator
        outcomes = _open_both(name)
    for got in outcomes:
        if expected is None:
            assert isinstance(got, RowSchema), f"harmless change refused: {got!r}"
            assert schema is None or got == schema
        else:
            assert type(got) is expected, f"expected {expected.__name__}, got {got!r}"
            assert re.search(match, str(got)), f"{str(got)!r} does not match {match!r}"
    if expected is not None:
        assert _segment(name) == before, "a refused attach wrote into the segment"
    assert _fds() == fds, "a descriptor was left open"


def _field_offsets() -> dict[str, int]:
    offsets, at = {}, 0
    for field, code in L._HEADER_FIELDS:
        offsets[field] = at
        at += struct.calcsize("<" + code)
    return offsets


_FIELDS = [field for field, _ in L._HEADER_FIELDS]
_CODES = dict(L._HEADER_FIELDS)
_OFFSETS = _field_offsets()
# Header fields whose value does not decide where anything lies: any value is a valid table.
_HARMLESS = frozenset({"creator_pid", "created_ns", "flags", "max_hold_ns"})


def _expected_for(original: bytes, mutated: bytes) -> tuple[type[Exception] | None, str]:
    """What attach must say about a header changed from `original` to `mutated`.

    Checks run in the order magic, version, structure, uid; every field not in
    `_HARMLESS` fixes the layout, so changing it must be noticed.
    """
    before = dict(zip(_FIELDS, L.HEADER.unpack_from(original), strict=True))
    after = dict(zip(_FIELDS, L.HEADER.unpack_from(mutated), strict=True))
    changed = {f for f in _FIELDS if before[f] != after[f]}
    if "magic" in changed:  # none at all: a table its creator has not finished making
        return (TableNotReady if after["magic"] == b"\0" * 8 else IncompatibleTable), (
            "not a shmslots table"
        )
    if "version" in changed:
        return IncompatibleTable, "format version"
    # the header's uid is for display: trust comes from the file's owner and mode (#36)
    structural = changed - _HARMLESS - {"creator_uid"}
    if structural == {"schema_len"} and _registry_at(before) == _registry_at(after):
        return CorruptTable, "."  # the layout stands; the blob's length fails with the schema
    if structural:
        return CorruptTable, "."
    return None, ""


def _registry_at(header: dict[str, Any]) -> int:
    """Where the registry starts for this header's schema offset and length (layout.py)."""
    end: int = header["schema"] + header["schema_len"]
    return -(-end // L.CACHE_LINE) * L.CACHE_LINE


def _value_for(code: str, original: int | bytes) -> st.SearchStrategy[Any]:
    """Any value of the field's width, biased to edges and to near the valid value."""
    if code == "8s":
        return st.binary(min_size=8, max_size=8) | st.sampled_from([b"\0" * 8, b"SHMSLOTZ"])
    top = (1 << (8 * struct.calcsize("<" + code))) - 1
    assert isinstance(original, int)
    near = st.integers(-5000, 5000).map(lambda d: min(max(original + d, 0), top))
    return st.integers(0, top) | near | st.sampled_from([0, 1, 64, top, top // 2 + 1])


# A ready-ring cell is empty for position p when it holds p << POS_SHIFT (csrc/core.h).
_RING_POS_SHIFT = _core.CELL_BITS["POS_SHIFT"]


def _forge(name: str, blob: bytes, row_size: int = 64) -> None:
    """A table made by hand: a consistent header (one slot) around any schema blob."""
    lay = L.Layout.compute(1, row_size, 4, len(blob))
    header = lay.pack_header(
        uid=os.getuid(),
        pid=os.getpid(),
        created_ns=time.time_ns(),
        flags=0,
        max_hold_ns=0,
        magic=L.MAGIC,
    )
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=lay.total_size)
    try:
        with mmap.mmap(shm.fd, lay.total_size) as mm:
            mm[lay.schema : lay.schema + len(blob)] = blob
            for pos in range(lay.ring_capacity):
                struct.pack_into("<Q", mm, lay.ring + 8 * pos, pos << _RING_POS_SHIFT)
            mm[: len(header)] = header
    finally:
        os.close(shm.fd)


@contextmanager
def _forged(name: str, blob: bytes, row_size: int = 64) -> Iterator[str]:
    _forge(name, blob, row_size)
    try:
        yield name
    finally:
        posix_ipc.unlink_shared_memory("/" + name)


def _check_blob(base: str, blob: bytes) -> None:
    """Attach to a table carrying `blob`: success iff it is a valid schema, else CorruptTable."""
    try:
        schema: RowSchema | None = RowSchema.decode(blob)
    except Exception:
        schema = None
    if not 0 < len(blob) <= L.MAX_SCHEMA_LEN:
        schema = None
    row_size = schema.row_size if schema is not None else 64
    with _forged(f"{base}-{next(_examples)}", blob, row_size) as name:
        if schema is None:
            _assert_outcome(name, CorruptTable, ".")
        else:
            _assert_outcome(name, None, schema=schema)


# -- 1. untrusted segments: the header ------------------------------------------------------


@pytest.mark.timeout(60)
@FUZZ
@given(data=st.data())
def test_any_header_field_value_is_refused_or_harmless(name: str, data: st.DataObject) -> None:
    """Random values in random header fields: only harmless fields may change freely."""
    table = f"{name}-{next(_examples)}"
    with SlotTable.create(table, SMALL, slots=3):
        original = _segment(table)[: L.HEADER.size]
        values = dict(zip(_FIELDS, L.HEADER.unpack_from(original), strict=True))
        mutated = bytearray(original)
        chosen = data.draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3, unique=True))
        for field in chosen:
            value = data.draw(_value_for(_CODES[field], values[field]), label=field)
            struct.pack_into("<" + _CODES[field], mutated, _OFFSETS[field], value)
        _poke(table, 0, bytes(mutated))
        _assert_outcome(table, *_expected_for(original, bytes(mutated)))


@pytest.mark.timeout(60)
@FUZZ
@given(
    flips=st.lists(
        st.tuples(st.integers(0, L.HEADER_SIZE - 1), st.integers(1, 255)), min_size=1, max_size=8
    )
)
def test_header_byte_flips_are_refused_or_harmless(name: str, flips: list[tuple[int, int]]) -> None:
    """Random bit flips anywhere in the 256-byte header, padding included."""
    table = f"{name}-{next(_examples)}"
    with SlotTable.create(table, SMALL, slots=3):
        original = _segment(table)[: L.HEADER_SIZE]
        mutated = bytearray(original)
        for offset, xor in flips:
            mutated[offset] ^= xor
        _poke(table, 0, bytes(mutated))
        _assert_outcome(table, *_expected_for(original, bytes(mutated)))


def test_segment_too_large_to_map_is_refused(name: str) -> None:
    """A sparse object claiming 4 EiB cannot be mapped: a clear refusal, not OSError ENOMEM."""
    size = 1 << 62
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
    os.close(shm.fd)
    try:
        fds = _fds()
        for opener in (SlotTable.attach, TableView.open):
            with pytest.raises(IncompatibleTable, match="cannot be mapped") as info:
                opener(name)
            assert type(info.value) is IncompatibleTable
        assert _fds() == fds
        assert os.stat(f"/dev/shm/{name}").st_size == size
    finally:
        posix_ipc.unlink_shared_memory("/" + name)


# -- 1. untrusted segments: the schema blob ---------------------------------------------


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=12)
)
_anything = st.recursive(
    _scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=16,
)
_names = st.sampled_from(["a", "x1", "_", "é", "a" * 65]) | st.text(max_size=70) | _anything
_dtypes = (
    st.sampled_from(sorted(DTYPE_SIZES)) | st.sampled_from(["complex64", "", "INT32"]) | _anything
)
_dims = (
    st.integers(1, 8)
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.sampled_from([0, -1, 1 << 26, (1 << 64) - 1, None, True, 1.0])
    | _anything
)
_shapes = st.lists(_dims, max_size=6) | _anything
_kinds = st.sampled_from(["inline", "ref", "handle", "remote"]) | _anything
_budgets = st.integers(-(1 << 63), (1 << 64) - 1) | st.sampled_from([0, 63, 4097]) | _anything
# What may stand at each position of a [name, dtype, shape, kind, budget] entry.
_POSITIONS = (_names, _dtypes, _shapes, _kinds, _budgets)
_valid_fields = st.lists(
    st.builds(
        Field,
        st.from_regex(r"[a-z_][a-z0-9_]{0,20}", fullmatch=True),
        st.sampled_from(sorted(DTYPE_SIZES)),
        st.lists(st.integers(1, 16), max_size=4).map(tuple),
        st.sampled_from(["inline", "ref"]),
        st.integers(64, 4096),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda f: f.name,
)


def _entry_of(f: Field) -> list[Any]:
    return [f.name, f.dtype, list(f.shape), f.kind, f.budget]


@st.composite
def _documents(draw: st.DrawFn) -> Any:
    """A valid schema document with hostile parts: mostly in its entries, where they bite."""
    entries: list[Any] = [_entry_of(f) for f in draw(_valid_fields)]
    whole = draw(st.sampled_from(["entries"] * 17 + ["v", "fields", "document"]))
    if whole == "v":
        return {"v": draw(_anything), "fields": entries}
    if whole == "fields":
        return {"v": 1, "fields": draw(_anything)}
    if whole == "document":
        return draw(_anything)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(entries) - 1))
        entry = entries[i]
        well_formed = isinstance(entry, list) and len(entry) == 5
        target = draw(st.sampled_from(["value"] * 6 + ["dim"] * 2 + ["entry", "many"]))
        if target == "value" and well_formed:
            pos = draw(st.integers(0, 4))
            entry[pos] = draw(_POSITIONS[pos])
        elif target == "dim" and well_formed and isinstance(entry[2], list):
            entry[2].insert(draw(st.integers(0, len(entry[2]))), draw(_dims))
        elif target == "entry":
            entries[i] = draw(st.lists(_anything, max_size=7) | _anything)
        elif target == "many":  # more fields than a schema may have
            count = draw(st.integers(60, 400))
            entries.extend([f"f{j}", "uint8", [], "inline", 512] for j in range(count))
    return {"v": 1, "fields": entries}


@pytest.mark.timeout(60)
@FUZZ
@given(blob=st.binary(max_size=512))
def test_random_schema_bytes_are_refused(name: str, blob: bytes) -> None:
    """Random bytes where the msgpack schema should be."""
    _check_blob(name, blob)


@pytest.mark.timeout(60)
@FUZZ
@given(doc=_documents())
def test_random_schema_documents_are_refused(name: str, doc: Any) -> None:
    """Valid msgpack with wrong types, huge or negative dims, unknown dtypes, odd nesting."""
    _check_blob(name, msgpack.packb(doc))


@pytest.mark.timeout(60)
@FUZZ
@given(fields=_valid_fields)
def test_valid_schema_documents_attach(name: str, fields: list[Field]) -> None:
    """The forger is faithful: a real schema's blob attaches and decodes to the same schema."""
    schema = RowSchema(fields)
    with _forged(f"{name}-{next(_examples)}", schema.encode(), schema.row_size) as table:
        _assert_outcome(table, None, schema=schema)


@pytest.mark.timeout(60)
@FUZZ
@given(depth=st.integers(0, 1100), position=st.integers(0, 4))
def test_deeply_nested_schema_values_are_refused(name: str, depth: int, position: int) -> None:
    """One value of an entry nested `depth` arrays deep, around Python's and msgpack's limits."""
    valid: tuple[object, ...] = ("a", "int32", [], "inline", 512)
    items = [msgpack.packb(v) for v in valid]
    items[position] = b"\x91" * depth + b"\xc0"  # 0x91: an array of one; 0xc0: nil
    _check_blob(name, b"\x82\xa1v\x01\xa6fields\x91\x95" + b"".join(items))


def _doc(*entries: object, v: object = 1) -> bytes:
    blob: bytes = msgpack.packb({"v": v, "fields": list(entries)})
    return blob


def _nested(depth: int) -> bytes:
    """A field entry nested `depth` lists deep (0x91: a one-element array)."""
    return b"\x82\xa1v\x01\xa6fields\x91" + b"\x91" * depth + b"\xc0"


def _entry(dtype: object = "int32", shape: object = (), kind: object = "inline") -> list[object]:
    return ["a", dtype, list(shape) if isinstance(shape, tuple) else shape, kind, 512]


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        pytest.param(_doc(_entry(dtype=["x"])), r"is not \[name, dtype", id="unhashable-dtype"),
        pytest.param(_doc(_entry(dtype={"k": 1})), r"is not \[name, dtype", id="dict-dtype"),
        pytest.param(_nested(1000), r"\[\[\[.*is not \[name", id="nested-1000"),
        pytest.param(_nested(5000), "not valid msgpack", id="nested-beyond-msgpack-limit"),
        pytest.param(_doc(_entry(dtype="complex128")), "dtype", id="unknown-dtype"),
        pytest.param(_doc(_entry(shape=(-1,))), "shape", id="negative-dim"),
        pytest.param(_doc(_entry(shape=((1 << 64) - 1,) * 4)), "shape", id="huge-shape"),
        pytest.param(_doc(_entry(shape=(1 << 13,) * 3)), "shape", id="over-64MiB-row"),
        pytest.param(_doc(_entry(shape=(1, 1, 1, 1, 1))), "shape", id="five-dims"),
        pytest.param(_doc(_entry(kind="remote")), "kind", id="unknown-kind"),
        pytest.param(
            _doc(*[[f"f{i}", "uint8", [], "inline", 512] for i in range(2000)]),
            "2000 fields, at most 64",
            id="2000-fields",
        ),
        pytest.param(_doc(_entry(), v=2), "version-1", id="version-2"),
        pytest.param(msgpack.packb([1, 2, 3]), "version-1", id="not-a-map"),
        pytest.param(msgpack.packb({1: 2}), "not valid msgpack", id="int-map-key"),
        pytest.param(b"\x82\xa1v\x01\xa6fields\xdd\xff\xff\xff\xff", "max_array_len", id="4G-list"),
        pytest.param(b"\xdb\xff\xff\xff\xff", "not valid msgpack", id="4GiB-str"),
        pytest.param(b"\xdf\xff\xff\xff\xff", "not valid msgpack", id="4G-map"),
        pytest.param(b"\xc4\x01\x00", "not valid msgpack", id="bin"),
        pytest.param(b"\x93\xc1\xc1\xc1", "not valid msgpack", id="reserved-byte"),
        pytest.param(b"\x00" * 100_000, "schema length 100000", id="blob-over-the-cap"),
    ],
)
def test_hostile_schema_blobs_are_corrupt_tables(name: str, blob: bytes, message: str) -> None:
    """Named cases the fuzzers might take long to find; each one a CorruptTable with a reason."""
    with _forged(name, blob) as table:
        _assert_outcome(table, CorruptTable, message)


def test_row_size_disagreeing_with_the_schema_is_refused(name: str) -> None:
    schema = RowSchema(list(SMALL))
    with _forged(name, schema.encode(), schema.row_size + 64) as table:
        _assert_outcome(table, CorruptTable, "schema gives")


# -- 1. untrusted segments: bitmap and state words -----------------------------------------


def _set_bitmap_word(name: str, t: SlotTable, value: int) -> None:
    _poke(name, t.layout.bitmap, struct.pack("<Q", value))


def test_bitmap_bit_set_on_a_free_slot(name: str) -> None:
    """Attach does not check the bitmap; a stray bit makes a FREE slot unclaimable, reported.

    The bitmap is the truth for "is this slot free", so the slot counts as
    owned: it is never handed out, and `check_consistency` names it.
    """
    with SlotTable.create(name, SMALL, slots=2) as t:
        _set_bitmap_word(name, t, 0b10)
        with SlotTable.attach(name, "peer") as peer:
            assert peer.check_consistency() == ["slot 1: bit 1 but state FREE"]
            ws = peer.claim()
            assert ws.slot == 0
            with pytest.raises(SlotsExhausted, match="'FREE': 1"):
                peer.claim(timeout=0.05)
            ws.abort()
            peer.reap()
            assert peer.check_consistency() == ["slot 1: bit 1 but state FREE"]
        _set_bitmap_word(name, t, 0)
        assert t.check_consistency() == []


def test_bitmap_bit_clear_on_an_owned_slot(name: str) -> None:
    """A missing bit never lets a second owner in (the state word's CAS decides); it heals."""
    with SlotTable.create(name, SMALL, slots=2) as t:
        ws = t.claim(tag=7)
        assert ws.slot == 0
        _set_bitmap_word(name, t, 0)
        with SlotTable.attach(name, "peer") as peer:
            assert peer.check_consistency() == ["slot 0: bit 0 but state WRITING"]
            other = peer.claim()
            assert other.slot == 1
            with pytest.raises(SlotsExhausted):
                peer.claim(timeout=0.05)
            other.abort()
        ws.write(**small_row(7)).publish()
        lease = t.take()
        assert lease is not None and lease.tag == 7 and lease.verify()
        lease.release()
        assert t.check_consistency() == []


def test_unknown_state_word_of_a_dead_owner_is_a_corrupt_table(name: str) -> None:
    """Attach reaps dead owners; a state word it cannot decode must be a refusal, not a crash."""
    with SlotTable.create(name, SMALL, slots=2) as t:
        dead = 5  # an ACTIVE registry entry whose lock nobody holds: a dead participant
        entry, word = t.layout.registry_entry(dead), t.layout.slot_entry(1)
        _poke(name, entry, struct.pack("<Q", 1))
        _poke(name, word, struct.pack("<Q", ((dead + 1) << 16) | 0x77))
        try:
            with pytest.raises(CorruptTable):
                SlotTable.attach(name)
        finally:
            _poke(name, entry, bytes(8))
            _poke(name, word, bytes(8))


# -- 2. memory limits -----------------------------------------------------------------------

BIG = Field("blob", "uint8", (16 << 20,))
MARGIN = 256 << 20


def _slots_beyond_dev_shm() -> int | None:
    """Slots of BIG rows that overshoot all of /dev/shm by MARGIN; None if impossible."""
    vfs = os.statvfs("/dev/shm")
    free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    slots = -(-(max(free, total) + MARGIN) // RowSchema([BIG]).row_size)
    return slots if total and slots <= L.MAX_SLOTS else None


@pytest.mark.timeout(60)
def test_table_bigger_than_dev_shm_is_out_of_shared_memory(name: str) -> None:
    """A table that cannot fit in /dev/shm fails at create and leaves nothing behind.

    The size aims past the whole tmpfs (and so past its free space by at
    least the margin): tmpfs refuses such a fallocate before allocating any
    page, whereas one between "free" and "total" would first fill the free
    space of this shared machine page by page.
    """
    slots = _slots_beyond_dev_shm()
    if slots is None:
        pytest.skip("/dev/shm has no size limit, or is bigger than the biggest table")
    fds = _fds()
    message = r"cannot reserve [\d.]+ [KMGT]iB \([\d,]+ bytes\) .* in /dev/shm, which has [\d.]+ "
    with pytest.raises(OutOfSharedMemory, match=message) as info:
        SlotTable.create(name, [BIG], slots=slots)
    assert isinstance(info.value, ShmSlotsError) and isinstance(info.value, MemoryError)
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(TableNotFound):
        SlotTable.attach(name)
    assert _fds() == fds


# -- 3. permissions -------------------------------------------------------------------------

NOBODY = 65534
ALL_REFUSED = 100  # child exit code: 100 + bit i set when attempt i was not refused as it should


def _attach_as_nobody(attempts: list[tuple[str, str]]) -> None:
    """Child: drop to uid/gid 65534, try attach and a read-only view of each table."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    failures = 0
    openers: list[Callable[[str], SlotTable | TableView]] = [SlotTable.attach, TableView.open]
    for i, ((table, message), opener) in enumerate(itertools.product(attempts, openers)):
        try:
            opener(table).close()
        except TablePermissionError as exc:
            if isinstance(exc, PermissionError) and re.search(message, str(exc)):
                continue
            print(f"attempt {i}: {exc!r}", file=sys.stderr)
        except BaseException as exc:
            print(f"attempt {i}: {exc!r}", file=sys.stderr)
        failures |= 1 << i
    sys.exit(ALL_REFUSED + failures)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")
@pytest.mark.timeout(90)
def test_another_uid_cannot_attach(name: str, children: Children) -> None:
    """Mode 0600 stops another uid; were the mode widened, the file's owner still would."""
    private, widened = f"{name}-private", f"{name}-widened"
    with SlotTable.create(private, SMALL, slots=2) as t, SlotTable.create(widened, SMALL, slots=2):
        os.chmod(f"/dev/shm/{widened}", 0o666)  # a mistake in the mode must not let anyone in
        before = {n: _segment(n) for n in (private, widened)}
        proc = children.start(
            _attach_as_nobody,
            [(private, "cannot open"), (widened, f"owned by uid {os.getuid()}")],
        )
        proc.join(60)
        assert proc.exitcode == ALL_REFUSED, (
            f"exit code {proc.exitcode}: attempts {(proc.exitcode or 0) - ALL_REFUSED:04b} "
            "(bit i: attempt i was not refused with TablePermissionError)"
        )
        assert {n: _segment(n) for n in (private, widened)} == before
        assert [p.pid for p in t.participants()] == [os.getpid()]
        st_ = os.stat(f"/dev/shm/{private}")
        assert (st_.st_mode & 0o777, st_.st_uid) == (0o600, os.getuid())


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277, 0o777])
def test_mode_and_owner_do_not_depend_on_the_umask(name: str, umask: int) -> None:
    """0600 and owned by the creator, whatever the umask (one too wide or too narrow)."""
    old = os.umask(umask)
    try:
        table = SlotTable.create(name, SMALL, slots=1)
    finally:
        os.umask(old)
    with table:
        st_ = os.stat(f"/dev/shm/{name}")
        assert (st_.st_mode & 0o777, st_.st_uid, st_.st_gid) == (0o600, os.getuid(), os.getgid())
        with SlotTable.attach(name, "peer") as peer:
            peer.claim().abort()


# -- 4. leaks -------------------------------------------------------------------------------

CYCLES = 10_000
WARM_UP = 200
RSS_SLACK_KIB = 8 * 1024
TINY = [Field("x", "int64")]


def _usage(prefix: str) -> tuple[int, int, set[str]]:
    gc.collect()
    maps = _maps()
    shm_maps = sum(f"/dev/shm/{prefix}" in line for line in maps)
    return _fds(), shm_maps, _shm_entries(prefix)


def _assert_flat(prefix: str, cycle: Callable[[int], None], n: int) -> tuple[int, float]:
    """Run `cycle` WARM_UP times, then `n` times; descriptors, mappings and RSS stay flat."""
    for i in range(WARM_UP):
        cycle(i)
    before = _usage(prefix)
    maps_before, rss_before = len(_maps()), _rss_kib()
    start = time.perf_counter()
    for i in range(n):
        cycle(i)
    elapsed = time.perf_counter() - start
    assert _usage(prefix) == before  # fds, mappings of our segments, /dev/shm entries
    assert len(_maps()) <= maps_before + 8, "mappings grew"  # the allocator may add an arena
    growth = _rss_kib() - rss_before
    assert growth < RSS_SLACK_KIB, f"RSS grew by {growth} KiB"
    return growth, elapsed


@pytest.mark.timeout(120)
def test_create_attach_close_unlink_cycles_leak_nothing(name: str) -> None:
    """10,000 full lifecycles, one row through each, leave the process as they found it."""

    def cycle(i: int) -> None:
        with SlotTable.create(name, TINY, slots=1) as t, SlotTable.attach(name, "peer") as peer:
            peer.claim(tag=i).write(x=i).publish()
            lease = t.take()
            assert lease is not None
            with lease:
                assert int(lease.view("x")) == i

    assert _usage(name) == (_fds(), 0, set())
    _assert_flat(name, cycle, CYCLES)
    assert _usage(name)[1:] == (0, set())


@pytest.mark.timeout(120)
def test_refusals_leak_nothing(name: str) -> None:
    """Every refusal path (corrupt, foreign, too big, taken name) closes what it opened."""
    corrupt, foreign, taken = f"{name}-corrupt", f"{name}-foreign", f"{name}-taken"
    too_many = _slots_beyond_dev_shm()
    with (
        SlotTable.create(corrupt, TINY, slots=1) as c,
        SlotTable.create(taken, TINY, slots=1),
    ):
        _poke(corrupt, _OFFSETS["columns"], struct.pack("<Q", c.layout.columns + 64))
        shm = posix_ipc.SharedMemory("/" + foreign, posix_ipc.O_CREX, mode=0o600, size=4096)
        os.close(shm.fd)
        _poke(foreign, 0, b"NOTSHMSL")
        try:

            def cycle(i: int) -> None:
                for opener in (SlotTable.attach, TableView.open):
                    with pytest.raises(CorruptTable, match="columns offset"):
                        opener(corrupt)
                    with pytest.raises(IncompatibleTable, match="not a shmslots table"):
                        opener(foreign)
                    with pytest.raises(TableNotFound):
                        opener(f"{name}-missing")
                with pytest.raises(TableExists):
                    SlotTable.create(taken, TINY, slots=1)
                if too_many is not None and i % 10 == 0:
                    with pytest.raises(OutOfSharedMemory):
                        SlotTable.create(f"{name}-big", [BIG], slots=too_many)

            _assert_flat(name, cycle, 2000)
        finally:
            posix_ipc.unlink_shared_memory("/" + foreign)


# -- 5. signals -----------------------------------------------------------------------------

INTERRUPTED = 3  # child exit: KeyboardInterrupt unwound the `with` blocks
MASKED = 5  # child exit: an OwnershipError from a handle's __exit__ replaced the interrupt
BAD_ROW = 7  # child exit: a row failed verification
MAX_ROWS = 200_000


def _row_id(lease: Lease) -> int:
    """The row's id, after checking the row is intact and self-consistent."""
    row = int(lease.copy("id").item())
    assert lease.verify(), f"row {row} fails its checksum"
    assert torch.equal(lease.copy("p"), torch.full((4,), float(row)))
    return row


def _interrupted(exc: BaseException) -> int:
    """Exit code for how an interrupted loop ended (see INTERRUPTED, MASKED)."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(exc, OwnershipError) and isinstance(exc.__context__, KeyboardInterrupt):
        return MASKED
    raise exc


def _interruptible() -> None:
    """SIGINT raises KeyboardInterrupt here even when the tests were started in the
    background, where the shell makes every child ignore it (and Python then keeps it so)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _write_forever(name: str) -> None:
    """Child: claim → write → publish rows 0, 1, 2, … until a signal ends it."""
    _interruptible()
    try:
        with SlotTable.attach(name, "writer") as t:
            for i in itertools.count():
                with t.claim(tag=i, timeout=30.0) as ws:
                    ws.write(**small_row(i))
                    ws.publish()
    except (KeyboardInterrupt, OwnershipError) as exc:
        sys.exit(_interrupted(exc))


def _read_forever(name: str, seen: ctypes.Array[ctypes.c_int64]) -> None:
    """Child: take → read → release, counting each row it consumed in `seen`."""
    _interruptible()
    try:
        with SlotTable.attach(name, "reader") as t:
            while True:
                lease = t.take(timeout=30.0)
                if lease is None:
                    continue
                with lease:
                    try:
                        row = _row_id(lease)
                    except AssertionError:
                        sys.exit(BAD_ROW)
                    seen[row] += 1
    except (KeyboardInterrupt, OwnershipError) as exc:
        sys.exit(_interrupted(exc))


def _expected_exit(sig: signal.Signals) -> set[int | None]:
    return {INTERRUPTED} if sig == signal.SIGINT else {-sig}


def _drain(t: SlotTable) -> list[int]:
    rows = []
    while (lease := t.take()) is not None:
        rows.append(_row_id(lease))
        lease.release()
    return rows


def _assert_usable_after(t: SlotTable, dead: int) -> list[int]:
    """After reap: consistent, nothing owned by `dead`, READY rows verify, round trip works.

    Returns the ids of the rows still queued (drained here).
    """
    t.reap()
    assert t.check_consistency() == []
    assert dead not in [p.index for p in t.participants()]
    for slot in range(t.slots):
        state, _, owner, _ = t.slot_info(slot)
        assert owner != dead and state in (State.FREE, State.READY), (slot, state, owner)
    queued = _drain(t)
    with t.claim(tag=1) as ws:
        ws.write(**small_row(MAX_ROWS))
        ws.publish()
    assert _drain(t) == [MAX_ROWS]
    stats = t.stats()
    assert stats.owned == 0 and stats.queued == 0
    return queued


def _index_of(t: SlotTable, role: str) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p.index for p in t.participants() if p.role == role and p.alive]
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no live {role} attached")


SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", SIGNALS)
def test_signal_in_write_loop_leaves_the_table_usable(
    name: str, children: Children, sig: signal.Signals
) -> None:
    """Every row the writer published arrives once, in order; its unfinished slot is reclaimed."""
    with SlotTable.create(name, SMALL, slots=4) as t:
        proc = children.start(_write_forever, name)
        writer = _index_of(t, "writer")
        after = random.randint(200, 600)
        rows: list[int] = []
        sent = False
        deadline = time.monotonic() + 90
        while proc.is_alive():
            assert time.monotonic() < deadline, "writer never ended"
            lease = t.take(timeout=0.05)
            if lease is not None:
                rows.append(_row_id(lease))
                lease.release()
            if not sent and len(rows) >= after:
                os.kill(proc.pid or 0, sig)
                sent = True
        proc.join(30)
        assert len(rows) >= after, f"writer ended early, exit code {proc.exitcode}"
        assert proc.exitcode in _expected_exit(sig)
        rows += _assert_usable_after(t, writer)
        assert rows == list(range(len(rows)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", SIGNALS)
def test_signal_in_read_loop_leaves_the_table_usable(
    name: str, children: Children, sig: signal.Signals
) -> None:
    """Every published row is consumed (a held one redelivered), or aborted by the interrupt."""
    seen = SPAWN.RawArray(ctypes.c_int64, MAX_ROWS)
    with SlotTable.create(name, SMALL, slots=4) as t:
        proc = children.start(_read_forever, name, seen)
        reader = _index_of(t, "reader")
        after = random.randint(200, 600)
        published = 0
        deadline = time.monotonic() + 90
        while proc.is_alive():
            assert time.monotonic() < deadline and published < MAX_ROWS, "reader never ended"
            try:
                ws = t.claim(tag=published, timeout=0.05)
            except SlotsExhausted:
                continue
            with ws:
                ws.write(**small_row(published))
                ws.publish()
            published += 1
            if published == after:
                os.kill(proc.pid or 0, sig)
        proc.join(30)
        assert published >= after, f"reader ended early, exit code {proc.exitcode}"
        assert proc.exitcode in _expected_exit(sig)
        aborts_before = t.stats().counters["aborts"]
        drained = _assert_usable_after(t, reader)
        handled = [seen[i] + drained.count(i) for i in range(published)]
        missing = handled.count(0)
        twice = handled.count(2)
        assert max(handled) <= 2 and twice <= 1, "a row was delivered more than once"
        if sig == signal.SIGTERM:
            assert missing == 0, "a row was lost with its consumer"
        else:
            # The one lease the interrupt hits is either aborted on the way out of its
            # with-block (counted; missing if it was not yet read), or, when the
            # interrupt lands inside __exit__ before the release, still HELD when the
            # table closes, and so redelivered like a dead consumer's (read twice).
            assert missing + twice <= 1 and aborts_before >= missing


_RELEASE = int(Event.RELEASE)


class _Interrupt(BaseException):
    """Stands in for KeyboardInterrupt without risking pytest's own handling of it."""


@pytest.mark.parametrize("step", ["publish", "release"])
def test_interrupt_just_after_a_transition_is_not_masked(name: str, step: str) -> None:
    """An interrupt that lands after the transition but before the handle noted it.

    The transition is made through the protocol directly (the handle is not
    told), then the `with` block unwinds with the interrupt: the interrupt,
    not an OwnershipError, must come out, and the table stays consistent.
    """
    with SlotTable.create(name, SMALL, slots=1) as t:
        if step == "release":
            t.claim().write(**small_row(1)).publish()
        with pytest.raises(_Interrupt):
            if step == "publish":
                with t.claim() as ws:
                    ws.write(**small_row(1))
                    assert t._own.hot.publish(ws.slot, ws.generation) == 0
                    raise _Interrupt
            else:
                lease = t.take()
                assert lease is not None
                with lease:
                    hot = t._own.hot
                    assert hot.free(lease.slot, lease.generation, int(State.HELD), _RELEASE) == 0
                    raise _Interrupt
        assert t.check_consistency() == []
        expected = State.READY if step == "publish" else State.FREE
        assert t.slot_info(0)[0] is expected


@pytest.mark.timeout(60)
def test_a_fifo_or_symlink_under_a_tables_name_is_no_table_and_nothing_waits(name: str) -> None:
    """Anyone may put a FIFO or a symlink under a name in /dev/shm (mode 1777); opening a
    FIFO waits for a writer, forever.  Each is refused at once as no table: by attach, by
    create(replace_orphaned=True) as a name taken (not advising `unlink --force`), and by
    `shmslots unlink` even --force."""
    import subprocess

    made = [f"{name}-fifo", f"{name}-link"]
    os.mkfifo(f"/dev/shm/{made[0]}")
    os.symlink("/tmp", f"/dev/shm/{made[1]}")
    try:
        for squat in made:
            with pytest.raises(IncompatibleTable, match="not a"):
                SlotTable.attach(squat, "reader")
            with pytest.raises(TableExists) as taken:
                SlotTable.create(squat, SMALL, slots=2, replace_orphaned=True)
            assert "--force" not in str(taken.value)  # which refuses it (below)
            for force in ([], ["--force"]):
                done = subprocess.run(
                    [sys.executable, "-m", "shmslots", "unlink", *force, squat],
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                assert done.returncode == 2 and "not a shmslots table" in done.stderr
            assert os.path.lexists(f"/dev/shm/{squat}")
    finally:
        for squat in made:
            os.unlink(f"/dev/shm/{squat}")


@pytest.mark.timeout(60)
def test_a_garbage_ready_ring_is_a_corrupt_table_not_a_hang(name: str) -> None:
    """One bad word in the ring must not spin a reader forever with the GIL held."""
    with SlotTable.create(name, SMALL, slots=2) as t:
        t.claim(tag=1).write(**small_row(1)).publish()
        _poke(name, t.layout.ring, struct.pack("<Q", 0xDEAD))
        started = time.monotonic()
        with SlotTable.attach(name, "reader") as reader, pytest.raises(CorruptTable, match="ring"):
            reader.take(timeout=0.1)
        assert time.monotonic() - started < 30
