"""Bad input gets the documented error and changes nothing."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import posix_ipc
import pytest
import torch
from conftest import SMALL, row_bytes, small_row

from shmslots import (
    CorruptTable,
    Field,
    IncompatibleTable,
    InvalidArgument,
    InvalidSlot,
    OwnershipError,
    SchemaError,
    ShmSlotsError,
    SlotTable,
    State,
    TableClosed,
    TableExists,
    TableNotFound,
)
from shmslots import layout as L
from shmslots.states import Event, next_word, pack


def _row_bytes(t: SlotTable, slot: int) -> bytes:
    return row_bytes(t, slot) + bytes(t._segment.mm[t.layout.seal(slot) : t.layout.seal(slot) + 16])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"p": torch.zeros(4, dtype=torch.float64)}, "float32"),
        ({"p": torch.zeros(5)}, "shape"),
        ({"h": torch.zeros(16, dtype=torch.bfloat16)}, "shape"),
        ({"nope": 1}, "no field"),
        ({"id": 1.5}, "int64"),
        ({"id": True}, "int64"),
        ({"id": 2**63}, "does not fit"),
        ({"p": [1.0, 2.0, 3.0, 4.0]}, "tensor"),
    ],
)
def test_bad_writes_are_refused_before_any_byte_changes(
    name: str, values: dict[str, object], message: str
) -> None:
    with SlotTable.create(name, SMALL, slots=3) as t:
        neighbours = [t.claim(), t.claim(), t.claim()]
        for ws in neighbours:
            ws.write(**small_row(ws.slot + 10))
        before = [_row_bytes(t, s) for s in range(3)]
        with pytest.raises(SchemaError, match=message):
            # A valid value for another field must not land either.
            valid = {"p": torch.full((4,), 99.0)} if "p" not in values else {"id": 99}
            neighbours[1].write(**valid, **values)
        assert [_row_bytes(t, s) for s in range(3)] == before
        for ws in neighbours:
            ws.abort()


def test_publish_refuses_unwritten_fields(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim()
        ws.write(id=1)
        with pytest.raises(SchemaError, match=r"\['h', 'p'\]"):
            ws.publish()
        assert t.slot_info(0)[0] is State.WRITING
        ws.abort()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ([], "at least one"),
        ([Field("a", "int64"), Field("a", "int32")], "duplicate"),
        ([Field("a", "int64", (1 << 12, (1 << 11) + 8))], "exceeds"),
    ],
)
def test_bad_schemas_are_refused_and_create_nothing(
    name: str, fields: list[Field], message: str
) -> None:
    with pytest.raises(SchemaError, match=message):
        SlotTable.create(name, fields, slots=2)
    with pytest.raises(TableNotFound):
        SlotTable.attach(name)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("x", "complex64"), "dtype"),
        (("x", "int64", (0,)), "shape"),
        (("x", "int64", (1, 2, 3, 4, 5)), "shape"),
        (("not an identifier", "int64"), "identifier"),
    ],
)
def test_bad_fields(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Field(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", ".hidden", "x" * 201, "sp ace"])
def test_bad_table_names(bad: str) -> None:
    with pytest.raises(ValueError, match="table name"):
        SlotTable.create(bad, SMALL, slots=1)


def test_create_is_exclusive_and_attach_needs_a_table(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1), pytest.raises(TableExists):
        SlotTable.create(name, SMALL, slots=1)
    with pytest.raises(TableNotFound):
        SlotTable.attach(name)


def test_segment_is_created_owner_only(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1):
        assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600


def _raw_segment(name: str, payload: bytes, size: int) -> None:
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
    with mmap.mmap(shm.fd, size) as mm:
        mm[: len(payload)] = payload
    os.close(shm.fd)


@pytest.mark.parametrize(
    ("payload", "size", "error", "message"),
    [
        (b"hello world", 4096, IncompatibleTable, "not a shmslots table"),
        (b"", 8, IncompatibleTable, "too small"),
    ],
)
def test_foreign_segments_are_refused(
    name: str, payload: bytes, size: int, error: type[Exception], message: str
) -> None:
    _raw_segment(name, payload, size)
    try:
        with pytest.raises(error, match=message):
            SlotTable.attach(name)
    finally:
        posix_ipc.unlink_shared_memory("/" + name)


def _header_field_offset(field: str) -> int:
    offset = 0
    for fname, code in L._HEADER_FIELDS:
        if fname == field:
            return offset
        offset += struct.calcsize("<" + code)
    raise KeyError(field)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("version", 99, IncompatibleTable, "version 99"),
        ("total_size", 12345, CorruptTable, "truncated"),
        ("slots", 0, CorruptTable, "impossible"),
        ("bitmap", 1 << 40, CorruptTable, "bitmap offset"),
        ("schema_len", 1000, CorruptTable, "registry offset"),
    ],
)
def test_corrupt_headers_are_refused(
    name: str, field: str, value: int, error: type[Exception], message: str
) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        code = dict(L._HEADER_FIELDS)[field]
        struct.pack_into("<" + code, t._segment.mm, _header_field_offset(field), value)
        with pytest.raises(error, match=message):
            SlotTable.attach(name)


def test_corrupt_schema_blob_is_refused(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        start = t.layout.schema
        t._segment.mm[start : start + 4] = b"\xc1\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
        with pytest.raises(CorruptTable, match="msgpack"):
            SlotTable.attach(name)


def test_slot_ids_out_of_range(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        for bad in (-1, 2, 10**9):
            with pytest.raises(InvalidSlot):
                t.open_reserved(bad, 0)
            with pytest.raises(InvalidSlot):
                t.slot_info(bad)


def test_tags_must_be_u64(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        for bad in (-1, 2**64, "room", 1.0):
            with pytest.raises(ValueError, match="tag"):
                t.claim(tag=bad)  # type: ignore[arg-type]
        assert t.stats().owned == 0


def test_non_owner_cannot_move_a_slot(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t, SlotTable.attach(name, "intruder") as other:
        ws = t.claim()
        before = t._own.word(0)
        assert (
            other._own.hot.free(ws.slot, ws.generation, int(State.WRITING), int(Event.ABORT)) == -1
        )
        with pytest.raises(OwnershipError, match="owned by participant"):
            next_word(before, int(Event.PUBLISH), other._own.me)
        assert t._own.word(0) == before and t._own.bit(0)
        ws.abort()


def test_state_machine_refuses_illegal_transitions() -> None:
    free = pack(3, 0, State.FREE)
    with pytest.raises(OwnershipError, match="cannot publish a slot that is FREE"):
        next_word(free, int(Event.PUBLISH), 1)
    with pytest.raises(OwnershipError, match="cannot release a slot that is READY"):
        next_word(pack(3, 0, State.READY), int(Event.RELEASE), 1)
    closing = next_word(pack(3, 1, State.HELD), int(Event.RELEASE), 1)
    assert closing == pack(3, 1, State.RECLAIMING)  # shut to everyone else while the bit clears
    assert next_word(closing, int(Event.FINISH), 1) == pack(4, 0, State.FREE)
    with pytest.raises(OwnershipError, match="owned by participant 0"):
        next_word(closing, int(Event.FINISH), 2)


def test_no_resource_tracker_warnings_in_spawned_users(name: str, tmp_path: Path) -> None:
    """Creating, attaching from a spawned child and unlinking prints nothing."""
    code = f"""
import multiprocessing as mp
from shmslots import SlotTable, Field

def child(name):
    with SlotTable.attach(name, "child") as t:
        t.claim().abort()

if __name__ == "__main__":
    with SlotTable.create({name!r}, [Field("x", "int64")], slots=2):
        p = mp.get_context("spawn").Process(target=child, args=({name!r},))
        p.start(); p.join(30)
        assert p.exitcode == 0
"""
    script = tmp_path / "user.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "resource_tracker" not in result.stderr
    assert result.stderr.strip() == ""


# -- every error is a ShmSlotsError, and says what limit was hit ------------------------------
def test_a_closed_table_refuses_every_call_with_table_closed(name: str) -> None:
    t = SlotTable.create(name, SMALL, slots=2)
    t.close()
    t.unlink()
    calls: list[Callable[[], object]] = [
        t.claim, t.stats, t.take, t.reserve, lambda: t.poll(1), lambda: t.slot_info(0),
        lambda: t.gather([], "id"), lambda: t.claim_n(1),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(TableClosed, match="is closed") as info:
            call()
        assert isinstance(info.value, ShmSlotsError) and isinstance(info.value, ValueError)


@pytest.mark.timeout(30)
def test_a_close_by_another_thread_ends_a_waiting_take_with_table_closed(name: str) -> None:
    t = SlotTable.create(name, SMALL, slots=2)
    got: list[BaseException] = []

    def take() -> None:
        try:
            t.take(timeout=5)
        except BaseException as exc:
            got.append(exc)

    other = SlotTable.attach(name, "watcher")  # reads the shared sleeper count after
    taker = threading.Thread(target=take)
    taker.start()
    deadline = time.monotonic() + 10  # past the spin: asleep on the futex
    while other._atomics.load32(other._own.readers_waiting) != 1:
        assert time.monotonic() < deadline, "the taker never slept"
        time.sleep(0.01)
    t.close()
    t.unlink()
    taker.join(10)
    assert len(got) == 1 and isinstance(got[0], TableClosed), got
    assert other._atomics.load32(other._own.readers_waiting) == 0  # its count went with it
    other.close()


def test_a_timeout_that_never_ends_is_refused(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim()  # full, and nothing to take: every call below would wait
        for call in (t.take, t.claim, t.reserve):
            with pytest.raises(InvalidArgument, match="timeout"):
                call(timeout=float("nan"))  # NaN never times out: it waited forever
        ws.abort()


def test_batch_calls_share_one_count_rule(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        ws = t.claim()
        ws.write(**small_row(1))
        ws.publish()
        for bad in (-5, True, 1.0, "1", None):
            for call in (t.poll, t.claim_n):
                with pytest.raises(InvalidArgument, match="must be an int >= 0"):
                    call(bad)  # type: ignore[arg-type]
        assert t.stats().states["READY"] == 1 and t.stats().states["FREE"] == 1


def test_a_table_inherited_through_fork_is_table_closed(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            try:
                t.claim()
            except TableClosed as exc:
                os._exit(0 if "fork" in str(exc) else 2)
            except BaseException:
                os._exit(3)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda n: SlotTable.create(n, SMALL, slots=0), r"slots must be in 1\.\.1048576, got 0"),
        (lambda n: SlotTable.create(n, SMALL, slots="4"), "slots must be an int"),  # type: ignore[arg-type]
        (lambda n: SlotTable.create(n, SMALL, slots=1, max_hold_s=0), "max_hold_s"),
        (lambda n: SlotTable.create(n, SMALL, slots=1, on_consumer_death="x"), "redeliver"),  # type: ignore[arg-type]
        (lambda n: SlotTable.create(n, SMALL, slots=1, arena_bytes=-1), "non-negative"),
        (lambda n: SlotTable.create(n, SMALL, slots=1, arena_bytes=1, arena_page=5), "multiple"),
        (
            lambda n: SlotTable.create(n, SMALL, slots=1, arena_bytes=10 << 40),
            r"arena_bytes of 10\.0 TiB is more than an arena of 16\.0 KiB pages holds: "
            r"at most 256\.0 GiB",
        ),
        (lambda n: SlotTable.attach("../" + n), "table name"),
    ],
)
def test_bad_arguments_are_invalid_argument(
    name: str, call: Callable[[str], object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message) as info:
        call(name)
    assert isinstance(info.value, ShmSlotsError) and isinstance(info.value, ValueError)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_bad_tag_is_invalid_argument(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        with pytest.raises(InvalidArgument, match="tag must be an int"):
            t.claim(tag="room-1")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="tag must be an int"):
            t.reserve(tag=-1)


def test_a_too_large_field_names_the_element_limit() -> None:
    with pytest.raises(
        SchemaError, match=r"1,073,741,824 elements; a field has at most 67,108,864"
    ):
        Field("x", "int64", (1024, 1024, 1024))


def test_fields_take_torch_dtypes() -> None:
    assert Field("x", torch.float32, (4,)) == Field("x", "float32", (4,))
    assert Field("x", torch.bfloat16).torch_dtype is torch.bfloat16
    with pytest.raises(SchemaError, match="'float64' not one of"):
        Field("x", torch.float64)


def test_an_int_field_refusal_says_an(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t, t.claim() as ws:
        with pytest.raises(SchemaError, match="takes an int64 tensor"):
            ws.write(id="seven")
        with pytest.raises(SchemaError, match="takes a float32 tensor"):
            ws.write(p="four")
