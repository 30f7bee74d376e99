"""The column layout: rows written by address, as transfer engines write SGLang's buffers.

A writer that knows only `buffer_infos()` and a slot index fills a reservation with plain
memmoves (as an RDMA engine or a TCP receiver would), in a process of its own; its owner
commits the row in place, with no copy, and a reader elsewhere takes it zero-copy.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
import warnings
from multiprocessing.queues import Queue
from typing import Any

import pytest
import torch
from conftest import SPAWN, Children

from shmslots import (
    Field,
    InvalidArgument,
    LeakedViewWarning,
    OwnershipError,
    Quarantine,
    RowRejected,
    SchemaError,
    SlotsExhausted,
    SlotTable,
    StaleLeaseError,
    State,
    TableClosed,
    row_hash,
)
from shmslots.snapshot import TableView

FIELDS = (
    Field("output_id", "int32", (16,)),
    Field("topk_p", "float32", (16,)),
    Field("topk_index", "int64", (16,)),
    Field("hidden", "bfloat16", (256,)),
    Field("room", "uint64", (8,)),
    Field("flag", "bool"),
    Field("small", "int8", (3,)),
    Field("mid", "int16", (5,)),
)


def request(i: int) -> dict[str, torch.Tensor]:
    """Field values for request i, every byte a function of i."""
    return {
        "output_id": torch.full((16,), i, dtype=torch.int32),
        "topk_p": torch.arange(16, dtype=torch.float32) / (i + 1),
        "topk_index": torch.arange(16, dtype=torch.int64) + 1000 * i,
        "hidden": torch.full((256,), float(i % 200), dtype=torch.bfloat16),
        "room": torch.full((8,), 2**63 + i, dtype=torch.uint64),
        "flag": torch.tensor(i % 2 == 1),
        "small": torch.tensor([-i % 100, 1, 2], dtype=torch.int8),
        "mid": torch.full((5,), -i, dtype=torch.int16),
    }


def write_by_address(infos: tuple[list[int], list[int], list[int]], slot: int, i: int) -> int:
    """Fill `slot` knowing only the table's addresses, as an engine does; returns the
    checksum of what was sent (shmslots.row_hash over the fields' bytes, in field order)."""
    ptrs, _, item_lens = infos
    sent = []
    for k, value in enumerate(request(i).values()):
        src = value.contiguous()
        ctypes.memmove(ptrs[k] + item_lens[k] * slot, src.data_ptr(), src.nbytes)
        sent.append(src.reshape(-1).view(torch.uint8).numpy().tobytes())
    return row_hash(sent)


def remote_writer(name: str, jobs: Queue[Any], done: Queue[Any]) -> None:
    """A writer process: attaches, reads the addresses from its own mapping, fills slots."""
    with SlotTable.attach(name, "engine") as table:
        infos = table.buffer_infos()
        while (job := jobs.get(timeout=30)) is not None:
            slot, i = job
            done.put((slot, write_by_address(infos, slot, i)))


def reader(name: str, n: int, out: Queue[Any]) -> None:
    """A reader process: takes n rows, checks each zero-copy view against its request."""
    with SlotTable.attach(name, "decode") as table:
        ptrs, _, item_lens = table.buffer_infos()
        for _ in range(n):
            lease = table.take(timeout=10)
            assert lease is not None
            i = lease.tag
            lease.verify()
            for k, (field, want) in enumerate(request(i).items()):
                view = lease.view(field)
                assert view.data_ptr() == ptrs[k] + item_lens[k] * lease.slot  # zero copy
                assert torch.equal(view, want), (field, i)
                del view
            lease.release()
            out.put(i)


def test_buffer_infos_follow_sglangs_addressing_rule(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=5) as t:
        ptrs, data_lens, item_lens = t.buffer_infos()
        assert len(ptrs) == len(FIELDS)
        for k, f in enumerate(FIELDS):
            assert item_lens[k] % 64 == 0 and item_lens[k] >= max(f.nbytes, 64)
            assert data_lens[k] == item_lens[k] * 5
            if k:  # columns lie back to back, in field order
                assert ptrs[k] == ptrs[k - 1] + data_lens[k - 1]
        ws = t.claim()
        ws.write(**request(3))
        for k, f in enumerate(FIELDS):
            view = ws.view(f.name)
            assert view.data_ptr() == ptrs[k] + item_lens[k] * ws.slot
            del view
        ws.abort()


@pytest.mark.timeout(120)
def test_rows_written_by_address_reach_another_process_zero_copy(
    name: str, children: Children
) -> None:
    jobs, done, seen = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    n = 40
    with SlotTable.create(name, FIELDS, slots=4) as t:
        children.start(remote_writer, name, jobs, done)
        children.start(reader, name, n, seen)
        for i in range(n):
            reservation = t.reserve(tag=i, timeout=10)
            jobs.put((reservation.slot, i))
            slot, checksum = done.get(timeout=30)
            assert slot == reservation.slot
            ws = t.open_reserved(slot, reservation.generation)
            ws.written_in_place(checksum).publish()
        jobs.put(None)
        assert sorted(seen.get(timeout=30) for _ in range(n)) == list(range(n))
        children.join_all(timeout=30)
        assert t.check_consistency() == []
        assert t.stats().owned == 0


def test_a_row_that_does_not_match_the_writers_checksum_is_not_published(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=2) as t:
        reservation = t.reserve(tag=7)
        checksum = write_by_address(t.buffer_infos(), reservation.slot, 7)
        ptrs, _, item_lens = t.buffer_infos()
        ctypes.memset(ptrs[3] + item_lens[3] * reservation.slot, 0x55, 2)  # torn hidden state
        ws = t.open_reserved(reservation.slot, reservation.generation)
        with pytest.raises(RowRejected, match="checksum"):
            ws.written_in_place(checksum)
        with pytest.raises(SchemaError, match="never written"):
            ws.publish()  # the refusal marked nothing as written
        ws.abort()
        assert t.stats().counters["publishes"] == 0 and t.take() is None


def test_keep_holds_a_row_for_its_writer_without_queueing_it(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=2) as t:
        reservation = t.reserve(tag=5)
        write_by_address(t.buffer_infos(), reservation.slot, 5)
        ws = t.open_reserved(reservation.slot, reservation.generation)
        lease = ws.written_in_place().keep()
        assert (lease.slot, lease.generation, lease.tag, lease.deliveries) == (
            reservation.slot, reservation.generation, 5, 0,
        )  # fmt: skip
        assert t.slot_info(lease.slot)[0] is State.HELD
        assert t.take() is None  # nobody else can take it
        lease.verify()
        assert torch.equal(lease.view("topk_index"), request(5)["topk_index"])
        with pytest.raises(StaleLeaseError):
            ws.publish()  # the write slot handed its ownership to the lease
        lease.release()
        assert t.slot_info(lease.slot)[0] is State.FREE
        counters = t.stats().counters
        assert counters["publishes"] == counters["takes"] == counters["releases"] == 1
        with pytest.raises(SchemaError, match="never written"):
            t.claim().keep()  # the same rule as publish
        assert t.check_consistency() == []


def test_keep_reserved_commits_a_landed_transfer_in_one_call(name: str) -> None:
    """The decode side's commit: the reservation's row, written by address, is sealed and
    held by its owner in one compiled call; the reservation ends with it."""
    with (
        SlotTable.create(name, FIELDS, slots=2) as t,
        SlotTable.create(name + "-b", FIELDS, slots=1) as u,
    ):
        reservation = t.reserve(tag=7)
        write_by_address(t.buffer_infos(), reservation.slot, 7)
        lease = t.keep_reserved(reservation)
        assert (lease.slot, lease.generation, lease.tag, lease.deliveries) == (
            reservation.slot, reservation.generation, 7, 0,
        )  # fmt: skip
        assert t.slot_info(lease.slot)[0] is State.HELD and t.take() is None
        assert lease.verify()  # sealed under its generation, as keep() seals
        topk, gap, room = lease.views(("topk_index", None, "room"))
        assert gap is None and topk is not None and room is not None
        assert torch.equal(topk, request(7)["topk_index"])
        assert torch.equal(room, request(7)["room"])
        for stale in (reservation, lease):  # the reservation is over; a lease is no reservation
            with pytest.raises((OwnershipError, StaleLeaseError)):
                t.keep_reserved(stale)  # type: ignore[arg-type]
        with pytest.raises(OwnershipError, match="not a reservation of"):
            t.keep_reserved(u.reserve())  # another table's
        with pytest.raises(SchemaError, match="no inline field"):
            lease.views(("nope",))
        with pytest.warns(LeakedViewWarning, match="room, topk_index"):
            lease.release()  # views() counts each view as view() does
        del topk, room
        with pytest.raises(StaleLeaseError):
            lease.views(("room",))
        counters = t.stats().counters  # counted as keep() counts
        assert counters["publishes"] == counters["takes"] == counters["releases"] == 1
        assert t.check_consistency() == []


def test_reserve_zeroes_the_fields_named_in_the_same_step(name: str) -> None:
    """A gate field (SGLang's room) reads "not yet written" from the moment a reservation
    exists: its whole item is zeroed in the step that reserves the slot, the other fields
    keep their bytes.  Names that are not inline fields are refused before any slot is
    taken."""
    refs = (Field("id", "int64"), Field("blob", "float32", (None,), kind="ref"))
    with (
        SlotTable.create(name, FIELDS, slots=1) as t,
        SlotTable.create(name + "-r", refs, slots=1) as u,
    ):
        infos = t.buffer_infos()
        reservation = t.reserve(tag=3)
        write_by_address(infos, reservation.slot, 3)
        with t.keep_reserved(reservation) as lease:
            lease.release()
        ptrs, _, item_lens = infos
        room_at = ptrs[4] + item_lens[4] * 0  # slot 0's room item, padding included
        ctypes.memset(room_at + FIELDS[4].nbytes, 0x5A, item_lens[4] - FIELDS[4].nbytes)
        for bad, error in (
            (("nope",), SchemaError),
            (("room", 3), SchemaError),
            (([1],), SchemaError),
            (["room"], InvalidArgument),
            (("room", _Unhashable()), SchemaError),
        ):
            with pytest.raises(error):
                t.reserve(zeroed=bad)  # type: ignore[arg-type]
            assert t.slot_info(0)[0] is State.FREE
        with pytest.raises(SchemaError, match="'blob' is not an inline field"):
            u.reserve(zeroed=("blob",))
        for _ in range(2):  # the second time from the mask kept for this tuple
            again = t.reserve(zeroed=("room", "flag"))
            assert ctypes.string_at(room_at, item_lens[4]) == bytes(item_lens[4])
            assert ctypes.string_at(ptrs[5], item_lens[5]) == bytes(item_lens[5])
            assert ctypes.string_at(ptrs[2], 16 * 8) == request(3)["topk_index"].numpy().tobytes()
            write_by_address(infos, again.slot, 3)
            again.abort()
        assert t.check_consistency() == [] and u.check_consistency() == []
        t.close()
        with pytest.raises(TableClosed):
            t.reserve(zeroed=("nope",))  # closed comes first, as for every call


class _Unhashable:
    def __hash__(self) -> int:
        raise ValueError("no hash")


def test_a_reserve_that_waits_for_a_slot_zeroes_it_too(name: str) -> None:
    """On a full table, reserve() waits; the slot it gets once freed is zeroed in the same
    step as one free at once."""
    with SlotTable.create(name, FIELDS, slots=1) as t:
        infos = t.buffer_infos()
        held = t.reserve(tag=1)
        write_by_address(infos, held.slot, 9)
        timer = threading.Timer(0.2, held.abort)
        timer.start()
        try:
            again = t.reserve(tag=2, timeout=10.0, zeroed=("room",))
        finally:
            timer.join()
        ptrs, _, item_lens = infos
        assert ctypes.string_at(ptrs[4], item_lens[4]) == bytes(item_lens[4])
        assert ctypes.string_at(ptrs[0], 64) == request(9)["output_id"].numpy().tobytes()
        again.abort()


def test_keep_reserved_refuses_a_table_with_refs_and_changes_nothing(name: str) -> None:
    fields = (Field("id", "int64"), Field("blob", "float32", (None,), kind="ref"))
    with SlotTable.create(name, fields, slots=1) as t:
        reservation = t.reserve()
        with pytest.raises(SchemaError, match="by address"):
            t.keep_reserved(reservation)
        assert t.slot_info(reservation.slot)[0] is State.RESERVED
        reservation.abort()


def test_keep_reserved_on_a_closed_table_says_so(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as t:
        reservation = t.reserve()
        t.close()
        with pytest.raises(TableClosed):
            t.keep_reserved(reservation)


# A collection started by the lease's own allocation closes the table (a gc callback): the
# step must not make a handle of a closed table (it crashed reading the table's parts).
CLOSED_BY_GC = """
import gc, sys
from shmslots import Field, SlotTable, StaleLeaseError, TableClosed
t = SlotTable.create(sys.argv[1], [Field("a", "int64", (8,))], slots=2)
t.unlink()
r = t.reserve()
armed = []
gc.callbacks.append(lambda phase, info: armed and phase == "start" and armed.pop() and t.close())
if sys.argv[2] == "keep":
    ws = t.open_reserved(r.slot, r.generation).written_in_place()
gc.collect()
armed.append(True)
gc.set_threshold(1)
try:
    t.keep_reserved(r) if sys.argv[2] == "keep_reserved" else ws.keep()
except (TableClosed, StaleLeaseError):  # the table's error, or its handle's
    print("refused")
"""


@pytest.mark.parametrize("step", ["keep_reserved", "keep"])
def test_a_table_closed_by_a_collection_inside_a_keep_is_refused(name: str, step: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CLOSED_BY_GC, name, step],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (out.returncode, out.stdout.strip()) == (0, "refused"), out.stderr[-2000:]


def test_new_dtypes_round_trip_through_numbers_tensors_and_the_cli(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as t:
        values: dict[str, Any] = dict(request(9))
        values["flag"] = True  # a Python bool for a bool scalar
        t.claim(tag=1).write(**values).publish()
        lease = t.take()
        assert lease is not None
        assert lease.item("flag") is True
        assert torch.equal(lease.view("room"), request(9)["room"])
        assert lease.copy("small").tolist() == [91, 1, 2]
        with TableView.open(name) as view:
            row = view.row(lease.slot)
            assert row.checksum_ok
            assert row.values["room"] == [2**63 + 9] * 8
            assert row.values["mid"] == [-9] * 5 and row.values["flag"] == [True]
        lease.release()
        with t.claim() as ws:
            for bad in ({"flag": 2}, {"small": torch.zeros(3)}, {"room": torch.zeros(8)}):
                with pytest.raises(SchemaError, match=next(iter(bad))):
                    ws.write(**bad)
            ws.abort()


@pytest.mark.parametrize("window_s", [0.0, 0.4])
def test_a_late_write_into_an_aborted_reservation_never_reaches_a_later_owner(
    name: str, window_s: float
) -> None:
    """A slow engine writes into a reservation after its request was aborted.  With the
    quarantine's window the slot is owned by no one else meanwhile, and the next owner's
    row is its own; with no window (the bug) the late bytes land in the next owner's row."""
    with SlotTable.create(name, FIELDS, slots=1) as t:
        infos = t.buffer_infos()
        quarantine = Quarantine(window_s)
        first = t.reserve(tag=1)
        quarantine.hold(first)  # request 1 aborted; its transfer is still in flight
        if window_s:
            with pytest.raises(SlotsExhausted):
                t.reserve(tag=2, timeout=0.05)  # the slot is held back, not reused
        deadline = time.monotonic() + window_s
        while quarantine.sweep() == 0 and time.monotonic() < deadline + 1:
            time.sleep(0.01)
        second = t.reserve(tag=2) if not len(quarantine) else None
        assert second is not None and second.slot == first.slot
        checksum = write_by_address(infos, second.slot, 2)  # request 2's own transfer
        if not window_s:
            write_by_address(infos, first.slot, 1)  # request 1's late write lands now
        ws = t.open_reserved(second.slot, second.generation)
        if not window_s:
            with pytest.raises(RowRejected):  # the writer's checksum catches it here...
                ws.written_in_place(checksum)
            lease = ws.written_in_place().keep()  # ...and without one, it is delivered
            assert lease.view("topk_index")[0].item() == 1000  # request 1's bytes
            lease.release()
            return
        lease = ws.written_in_place(checksum).keep()
        assert torch.equal(lease.view("topk_index"), request(2)["topk_index"])
        lease.release()
        assert quarantine.released == 1 and len(quarantine) == 0


def test_keep_refuses_moved_views_and_hands_live_ones_to_the_lease(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as t:
        ws = t.claim()
        ws.write(**request(1))
        view = ws.view("topk_p")
        view.share_memory_()  # type: ignore[no-untyped-call]  # moved out: writes miss the row
        view.fill_(99.0)
        with pytest.raises(SchemaError, match="no longer show the row"):
            ws.keep()
        ws.write(topk_p=request(1)["topk_p"])  # written again, into the row
        mine = ws.view("topk_index")  # the writer's own view, still valid after keep
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lease = ws.keep()  # no leak: the row stays this process's
        assert t.stats().counters["leaked_views"] == 0
        assert torch.equal(lease.view("topk_p"), request(1)["topk_p"]) and lease.verify()
        with pytest.warns(LeakedViewWarning, match="topk_index"):
            lease.release()  # the lease checks the view it took over
        del mine, view


def test_written_in_place_takes_only_a_32_bit_checksum(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=1) as t, t.claim() as ws:
        for bad in ("abc", 1.5, b"x", -1, 2**32, True):
            with pytest.raises(InvalidArgument):
                ws.written_in_place(bad)  # type: ignore[arg-type]
        ws.abort()


def test_a_quarantine_holds_only_reservations(name: str) -> None:
    for bad in (True, -1.0, float("inf"), "1"):
        with pytest.raises(InvalidArgument):
            Quarantine(bad)  # type: ignore[arg-type]
    for bad_handle in (42, None, "slot 0"):
        with pytest.raises(InvalidArgument):
            Quarantine(1.0).hold(bad_handle)  # type: ignore[arg-type]
    with SlotTable.create(name, FIELDS, slots=1) as t:
        quarantine, reservation = Quarantine(60.0), t.reserve()
        quarantine.hold(reservation)
        with pytest.raises(InvalidArgument, match="held already"):
            quarantine.hold(reservation)  # once is the rule (#24, defect 8)
        assert len(quarantine) == 1
        with SlotTable.create(f"{name}-2", FIELDS, slots=1) as other:
            quarantine.hold(other.reserve())  # the same (slot, generation), another table
            assert len(quarantine) == 2
            quarantine.close()
        assert len(quarantine) == 0 and t.stats().states["FREE"] == 1


def test_a_quarantined_reservation_is_closed_to_its_producer(name: str) -> None:
    """Quarantine.hold() changed nothing in shared memory: the producer that still held
    (slot, generation) could open, write and publish the cancelled request's row (#24, 4)."""
    with SlotTable.create(name, FIELDS, slots=1) as t:
        reservation, quarantine = t.reserve(tag=9), Quarantine(60.0)
        quarantine.hold(reservation)
        with SlotTable.attach(name, "producer") as producer:
            with pytest.raises(OwnershipError):
                producer.open_reserved(reservation.slot, reservation.generation)
            assert producer.take() is None
        assert t.stats().states["QUARANTINED"] == 1 and len(quarantine) == 1
        quarantine.close()
        assert t.stats().states["FREE"] == 1
