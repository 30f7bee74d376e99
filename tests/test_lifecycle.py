"""The slot lifecycle (docs/guide.md) on real segments, one transition at a time."""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref

import pytest
import torch
from conftest import SMALL, small_row

from shmslots import (
    Field,
    LeakedViewError,
    LeakedViewWarning,
    Lease,
    OwnershipError,
    SlotsExhausted,
    SlotTable,
    StaleLeaseError,
    State,
    WriteSlot,
)


def test_claim_write_publish_take_release(name: str) -> None:
    with (
        SlotTable.create(name, SMALL, slots=4) as writer,
        SlotTable.attach(name, "decode") as reader,
    ):
        ws = writer.claim(tag=42)
        assert writer.slot_info(ws.slot)[0] is State.WRITING
        ws.write(**small_row(7))
        ws.publish()
        assert writer.slot_info(ws.slot)[0] is State.READY
        lease = reader.take()
        assert lease is not None
        assert (lease.slot, lease.generation, lease.tag) == (ws.slot, ws.generation, 42)
        assert reader.slot_info(lease.slot)[:3] == (State.HELD, 0, reader.participant)
        assert int(lease.view("id")) == 7
        assert torch.equal(lease.view("p"), torch.full((4,), 7.0))
        assert lease.verify()
        lease.release()
        state, generation, owner, _ = writer.slot_info(ws.slot)
        assert (state, generation, owner) == (State.FREE, 1, -1)
        assert reader.take() is None
        counters = writer.stats().counters
        assert (counters["claims"], counters["publishes"], counters["takes"]) == (1, 1, 1)
        assert counters["releases"] == 1
        assert writer.check_consistency() == []


def test_readers_take_in_publish_order(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=8) as t:
        order = [5, 1, 4, 2, 3]
        for tag in order:
            t.claim(tag=tag).write(**small_row(tag)).publish()
        taken = []
        while (lease := t.take()) is not None:
            taken.append(lease.tag)
            lease.release()
        assert taken == order


def test_copy_outlives_the_lease_and_views_do_not(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim().write(**small_row(3)).publish()
        lease = t.take()
        assert lease is not None
        kept = lease.copy("p")
        lease.release()
        with pytest.raises(StaleLeaseError):
            lease.view("p")
        t.claim().write(**small_row(9)).publish()
        assert torch.equal(kept, torch.full((4,), 3.0))


def test_every_abort_path_frees_at_once_and_bumps_generation(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim().abort()
        t.reserve().abort()
        t.claim().write(**small_row(1)).publish()
        lease = t.take()
        assert lease is not None
        lease.abort()
        t.claim(tag=9).write(**small_row(2)).publish()
        assert t.cancel(9) == 1
        assert t.take() is None
        state, generation, _, _ = t.slot_info(0)
        assert (state, generation) == (State.FREE, 4)
        assert t.stats().counters["aborts"] == 4
        assert t.check_consistency() == []


def test_reservation_is_opened_by_generation_and_stale_ones_refused(name: str) -> None:
    with (
        SlotTable.create(name, SMALL, slots=2) as decode,
        SlotTable.attach(name, "transfer") as xfer,
    ):
        res = decode.reserve(tag=77)
        assert decode.slot_info(res.slot)[0] is State.RESERVED
        with pytest.raises(OwnershipError, match="not reserved"):
            xfer.open_reserved(res.slot, res.generation + 1)
        ws = xfer.open_reserved(res.slot, res.generation)
        assert ws.tag == 77
        with pytest.raises(OwnershipError):
            xfer.open_reserved(res.slot, res.generation)  # already opened
        with pytest.raises(OwnershipError):
            res.abort()  # the reserver no longer owns it
        ws.write(**small_row(5)).publish()
        lease = decode.take()
        assert lease is not None and lease.tag == 77
        lease.release()
        with pytest.raises(OwnershipError):
            xfer.open_reserved(res.slot, res.generation)  # generation moved on


def test_backpressure_raises_with_occupancy_after_timeout(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        held = [t.claim(), t.claim()]
        started = time.monotonic()
        with pytest.raises(SlotsExhausted) as info:
            t.claim(timeout=0.2)
        assert 0.15 < time.monotonic() - started < 2.0
        assert info.value.occupancy["WRITING"] == 2
        for ws in held:
            ws.abort()


def test_blocked_claim_wakes_when_a_slot_is_freed(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t, SlotTable.attach(name, "other") as other:
        ws = t.claim()
        timer = threading.Timer(0.1, ws.abort)
        timer.start()
        started = time.monotonic()
        got = other.claim(timeout=5.0)
        assert time.monotonic() - started < 2.0
        got.abort()
        timer.join()


def test_blocking_take_wakes_on_publish(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t, SlotTable.attach(name, "r") as reader:
        timer = threading.Timer(0.1, lambda: t.claim().write(**small_row(1)).publish())
        timer.start()
        lease = reader.take(timeout=5.0)
        assert lease is not None
        lease.release()
        timer.join()
        started = time.monotonic()
        assert reader.take(timeout=0.1) is None
        assert time.monotonic() - started >= 0.09


def test_strict_mode_refuses_release_while_a_view_lives(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        t.claim().write(**small_row(1)).publish()
        lease = t.take()
        assert lease is not None
        derived = lease.view("h")[1, 2:4]  # a derived view counts too
        with pytest.raises(LeakedViewError, match="h"):
            lease.release()
        assert t.slot_info(0)[0] is State.HELD  # nothing changed
        del derived
        lease.release()
        assert t.slot_info(0)[0] is State.FREE


def test_default_mode_warns_and_counts_leaked_views(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim().write(**small_row(1)).publish()
        lease = t.take()
        assert lease is not None
        kept = lease.view("p")
        with pytest.warns(LeakedViewWarning, match="p"):
            lease.release()
        assert t.stats().counters["leaked_views"] == 1
        assert t.slot_info(0)[0] is State.FREE
        del kept


def test_no_warning_when_views_are_dropped_before_release(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        t.claim().write(**small_row(1)).publish()
        lease = t.take()
        assert lease is not None
        total = float(lease.view("p").sum()) + float(lease.view("h")[0].sum())
        assert total == 4.0 + 8.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lease.release()


def test_verify_detects_a_row_changed_after_publish(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim().write(**small_row(1)).publish()
        lease = t.take()
        assert lease is not None and lease.verify()
        view = lease.view("p")
        view[0] = 123.0  # someone scribbles on the row
        del view
        assert not lease.verify()
        lease.release()


def test_strict_take_refuses_a_corrupted_row(name: str) -> None:
    from shmslots import CorruptTable

    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        ws = t.claim()
        ws.write(**small_row(1)).publish()
        t._rows.views(0).tensors["p"][0] = 99.0  # corrupt READY row bytes behind the API
        with pytest.raises(CorruptTable):
            t.take()
        assert t.slot_info(0)[0] is State.FREE  # aborted, not delivered


def test_a_handle_keeps_its_table_alive(name: str) -> None:
    """A handle holds its table: a caller that keeps only the handle (the table made in a
    helper and dropped) still publishes, and still reads its lease, instead of finding the
    table closed under it and its slot handed back."""

    def claimed() -> WriteSlot:
        return SlotTable.attach(name, "writer").claim(tag=1)

    def taken() -> Lease | None:
        return SlotTable.attach(name, "reader").take(timeout=5.0)

    with SlotTable.create(name, SMALL, slots=1) as t, warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the dropped tables, collected
        ws = claimed()
        ws.write(**small_row(1)).publish()
        del ws
        lease = taken()
        assert lease is not None and lease.item("id") == 1 and lease.verify()
        lease.release()
        assert t.stats().counters["releases"] == 1 and t.stats().owned == 0


def test_a_closed_table_lets_go_of_its_parts_without_a_collection(name: str) -> None:
    """Its rows, steps and ref-field store (and the tensors that keeps) go with the table, not
    with the next cyclic collection, which under gc.freeze() may never come."""
    gc.disable()
    try:
        t = SlotTable.create(name, SMALL, slots=1)
        refs = weakref.ref(t._refs)
        t.close()
        t.unlink()
        del t
        assert refs() is None
    finally:
        gc.enable()


def test_handles_are_single_use(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        ws = t.claim()
        ws.write(**small_row(1)).publish()
        with pytest.raises(OwnershipError, match="already handed back"):
            ws.write(id=2)
        with pytest.raises(StaleLeaseError):
            ws.publish()
        with pytest.raises(StaleLeaseError):
            ws.abort()
        lease = t.take()
        assert lease is not None
        lease.release()
        with pytest.raises(StaleLeaseError):
            lease.release()
        with pytest.raises(StaleLeaseError):
            lease.abort()
        with pytest.raises(StaleLeaseError):
            lease.copy("p")


def test_context_managers_abort_unfinished_work(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        with t.claim() as ws:
            ws.write(id=1)
        assert t.slot_info(0)[0] is State.FREE
        t.claim().write(**small_row(1)).publish()
        with pytest.raises(RuntimeError), t.take() as lease:  # type: ignore[union-attr]
            raise RuntimeError("request failed")
        assert t.slot_info(0)[0] is State.FREE
        assert t.stats().counters["aborts"] == 2
        del lease


def test_write_slot_view_fills_the_row_in_place(name: str) -> None:
    schema = (Field("id", "int64"), Field("v", "float32", (8,)))
    with SlotTable.create(name, schema, slots=1) as t:
        ws = t.claim()
        ws.view("v").copy_(torch.arange(8.0))
        ws.write(id=3)
        ws.publish()
        lease = t.take()
        assert lease is not None
        assert torch.equal(lease.copy("v"), torch.arange(8.0))
        lease.release()


def test_close_hands_back_what_this_process_still_owns(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=3) as t:
        other = SlotTable.attach(name, "other")
        other.claim()  # WRITING: back to FREE
        other.reserve()  # RESERVED: back to FREE
        t.claim(tag=5).write(**small_row(5)).publish()
        assert other.take() is not None  # HELD: redelivered
        other.close()
        stats = t.stats()
        assert stats.states["FREE"] == 2 and stats.states["READY"] == 1
        lease = t.take()
        assert lease is not None and lease.tag == 5 and lease.deliveries == 1
        lease.release()
        assert t.check_consistency() == []


def test_handles_of_a_closed_table_cannot_touch_a_newcomers_slot(name: str) -> None:
    """The newcomer reuses the closed table's participant entry (same owner id)."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim(tag=1).write(**small_row(1)).publish()
        old = SlotTable.attach(name, "old")
        stale = old.take()
        assert stale is not None
        index = old.participant
        old.close()  # the lease's slot is redelivered
        with SlotTable.attach(name, "new") as new:
            assert new.participant == index
            lease = new.take()
            assert lease is not None and lease.slot == stale.slot
            with pytest.raises(StaleLeaseError, match="closed"):
                stale.release()
            with pytest.raises(StaleLeaseError, match="closed"):
                stale.view("p")
            assert new.slot_info(lease.slot)[:3] == (State.HELD, 0, index)
            assert lease.verify()
            lease.release()


def test_exception_inside_a_strict_lease_block_is_not_replaced(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, strict=True) as t:
        t.claim().write(**small_row(1)).publish()
        with pytest.raises(KeyError), t.take() as lease:  # type: ignore[union-attr]
            row = lease.view("p")  # still referenced while the block unwinds
            raise KeyError(float(row[0]))
        assert t.slot_info(0)[0] is State.FREE
        assert t.stats().counters["aborts"] == 1
        del row, lease


def test_cancelled_slots_wait_for_the_queue_instead_of_filling_it(name: str) -> None:
    """A READY row nobody takes pins the queue head; cancel/publish cycles must not fill
    the ready ring: a cancelled slot becomes claimable once takes pass its entry."""
    with SlotTable.create(name, SMALL, slots=3) as t:
        t.claim(tag=1).write(**small_row(1)).publish()  # pins the head
        for tag in (2, 3):
            t.claim(tag=tag).write(**small_row(tag)).publish()
            assert t.cancel(tag) == 1
        assert t.stats().states["FREE"] == 2
        with pytest.raises(SlotsExhausted, match="cancelled or reclaimed entry"):
            t.claim(timeout=0.05)
        lease = t.take()
        assert lease is not None and lease.tag == 1
        lease.release()
        assert t.take() is None  # passes the two cancelled entries
        held = [t.claim(timeout=0.0) for _ in range(3)]
        for ws in held:
            ws.abort()
        assert t.check_consistency() == []


def test_reservations_refuse_bad_generations_and_abort_on_exit(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        with t.reserve(tag=4) as res:
            with pytest.raises(OwnershipError, match="32-bit"):
                t.open_reserved(res.slot, res.generation + 2**32)
            assert t.slot_info(0)[0] is State.RESERVED
        assert t.slot_info(0)[0] is State.FREE
        with t.reserve() as res:
            t.open_reserved(res.slot, res.generation).abort()  # handed over, then aborted
        assert t.stats().counters["aborts"] == 2
