"""The quarantine in the segment (#24, defect 4): an aborted transfer's slot is QUARANTINED,
with its deadline, closed to every producer and reader; anyone frees it once the window
has passed, its owner sooner, a reaper at once if the owner dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from conftest import SMALL, Children, kill_point, small_row

from shmslots import (
    InvalidArgument,
    LeakedViewError,
    OwnershipError,
    Quarantine,
    Quarantined,
    SlotsExhausted,
    SlotTable,
    StaleLeaseError,
    State,
    _core,
)
from shmslots import layout as L
from shmslots.snapshot import TableView


def test_a_quarantined_slot_is_closed_to_everyone_and_shows_its_deadline(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        booked = t.reserve(tag=7)
        held = booked.quarantine(60.0)
        assert not booked._open and held.held
        with pytest.raises(StaleLeaseError):
            booked.abort()  # the reservation ended with the step that closed the slot
        with SlotTable.attach(name, "other") as other:
            with pytest.raises(OwnershipError):
                other.open_reserved(booked.slot, booked.generation)
            with pytest.raises(SlotsExhausted):
                other.claim(timeout=0.05)  # its window has not passed: nobody frees it
            assert other.take() is None and other.reap() == {}
        state, generation, owner, tag = t.slot_info(held.slot)
        assert (state, generation, owner, tag) == (State.QUARANTINED, booked.generation, 0, 7)
        with TableView.open(name) as view:
            shown = view.slot(held.slot)
        assert shown.state is State.QUARANTINED and 59 < (shown.frees_in_s or 0) <= 60
        out = subprocess.run(
            [sys.executable, "-m", "shmslots", "inspect", name, "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        (doc,) = json.loads(out.stdout)["slots"]
        assert doc["state"] == "QUARANTINED" and 58 < doc["frees_in_s"] <= 60
        text = subprocess.run(
            [sys.executable, "-m", "shmslots", "inspect", name],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert "QUARANTINED (frees in" in text
        assert held.end() and not held.held and not held.end()  # the owner frees it sooner
        counters = t.stats().counters
        assert counters["quarantined"] == counters["quarantines_ended"] == 1
        assert t.stats().states["FREE"] == 1 and t.check_consistency() == []


def test_anyone_frees_it_once_its_window_has_passed(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t, SlotTable.attach(name, "other") as other:
        started = time.monotonic()  # before the window starts: a stall cannot shorten it
        held = t.reserve(tag=1).quarantine(0.3)
        ws = other.claim(timeout=5.0)  # its claim finds no FREE slot, then the window passes
        assert time.monotonic() - started >= 0.29 and ws.slot == held.slot
        assert not held.held and not held.end()  # freed by the other participant
        ws.write(**small_row(2)).publish()
        lease = t.take()
        assert lease is not None and lease.tag == 0 and lease.item("id") == 2
        lease.release()
        assert t.stats().counters["quarantines_ended"] == 1


def test_a_book_settled_by_its_owner_frees_only_when_the_owner_says(name: str) -> None:
    """Peers on other clocks (SGLang's decode ranks) must free in step: no claim at the
    deadline, no len() and no hold frees what the owner has not said to free."""
    with SlotTable.create(name, SMALL, slots=2) as t:
        book = Quarantine(0.5, settled_by_owner=True)  # longer than any stall between calls
        first, second = t.reserve(tag=1), t.reserve(tag=2)
        assert book.hold(first) and book.due() == 0
        time.sleep(0.6)
        assert book.hold(second) and book.due() == 1  # the first's window has passed
        with SlotTable.attach(name, "other") as other:
            with pytest.raises(SlotsExhausted):
                other.claim(timeout=0.05)  # no deadline in the segment to act on
            assert other.reap() == {}
        assert len(book) == 2 and book.released == 0
        assert book.end_first(1) == 1 and book.released == 1
        assert t.slot_info(first.slot)[0] is State.FREE
        assert t.slot_info(second.slot)[0] is State.QUARANTINED and len(book) == 1
        time.sleep(0.6)
        assert book.sweep() == 1 and len(book) == 0  # sweep: by this process's own clock


def test_reap_frees_quarantined_slots_whose_window_ended(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        t.reserve().quarantine(0.0)
        t.reserve().quarantine(60.0)
        out = subprocess.run(
            [sys.executable, "-m", "shmslots", "reap", name],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "quarantines_ended" in out and t.stats().states["QUARANTINED"] == 1
        assert t.stats().states["FREE"] == 1


def _quarantine_and_die(name: str) -> None:
    t = SlotTable.attach(name, "owner")
    t.reserve(tag=3).quarantine(3600.0)
    ws = t.claim(tag=4).write(**small_row(4))
    ws.quarantine(3600.0)  # a row refused while a write was landing
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dead_owners_quarantined_slots_are_freed_at_once(name: str, children: Children) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        proc = children.start(_quarantine_and_die, name)
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL
        assert t.stats().states["QUARANTINED"] == 2
        done = t.reap()
        assert done["participants_reaped"] == 1 and done["quarantines_ended"] == 2
        assert t.stats().states["FREE"] == 2 and t.check_consistency() == []
        assert t.stats().counters["quarantines_ended"] == 2


def test_closing_the_owner_frees_its_quarantined_slots(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        with SlotTable.attach(name, "owner") as owner:
            held = owner.reserve().quarantine(3600.0)
        assert not held.held and not held.end()
        assert t.stats().states["FREE"] == 1


def test_a_quarantine_keeps_its_table_alive(name: str) -> None:
    """As a handle does: a caller that keeps only the quarantine (the table made in a helper
    and dropped) does not see the slot freed by the table's close, window or no window."""

    def quarantined() -> Quarantined:
        return SlotTable.attach(name, "owner").reserve(tag=1).quarantine(3600.0)

    with SlotTable.create(name, SMALL, slots=1) as t, warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the dropped table, when collected
        held = quarantined()
        assert held.held and t.slot_info(0)[0] is State.QUARANTINED
        assert held.end() and t.slot_info(0)[0] is State.FREE


def test_bad_quarantines_change_nothing(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2, strict=True) as t:
        booked = t.reserve(tag=5)
        for bad in (-1.0, float("inf"), float("nan"), True, "1", 10.0**12):
            with pytest.raises(InvalidArgument, match="late-write window"):
                booked.quarantine(bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="late-write window"):
                Quarantine(bad)  # type: ignore[arg-type]
        assert t.slot_info(booked.slot)[0] is State.RESERVED
        ws = t.claim().write(**small_row(1))
        view = ws.view("p")
        with pytest.raises(LeakedViewError):
            ws.quarantine(1.0)  # strict: a view still referenced is refused, nothing moves
        assert t.slot_info(ws.slot)[0] is State.WRITING
        del view
        held = ws.quarantine(60.0)
        with pytest.raises(StaleLeaseError):
            ws.quarantine(60.0)
        with pytest.raises(StaleLeaseError):
            ws.publish()
        opened = t.open_reserved(booked.slot, booked.generation)  # its producer came first
        with pytest.raises(OwnershipError):
            booked.quarantine(60.0)
        quarantine = Quarantine(60.0)
        quarantine.hold(booked)  # the slot is the producer's: not held
        assert len(quarantine) == 0 and opened.tag == 5
        opened.abort()
        assert held.end()


def test_a_view_kept_past_a_quarantine_is_reported(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as t:
        ws = t.claim().write(**small_row(1))
        view = ws.view("p")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held = ws.quarantine(60.0)
        assert any("still referenced" in str(w.message) for w in caught)
        assert t.stats().counters["leaked_views"] == 1
        assert torch.equal(view, torch.full((4,), 1.0))
        held.end()
        del view


KILL_QUARANTINED, KILL_RECLAIMING = kill_point("QUARANTINED"), kill_point("RECLAIMING")


def _quarantine_killed_at(name: str, point: int) -> None:
    t = SlotTable.attach(name, "owner")
    booked = t.reserve(tag=6)
    if point == KILL_RECLAIMING:  # killed while freeing it: RECLAIMING, never FREE
        held = booked.quarantine(0.0)
        _core._kill_at(point)
        held.end()
    else:  # killed just after closing it, before its deadline is stored
        _core._kill_at(point)
        booked.quarantine(3600.0)
    raise SystemExit("the kill point was not reached")


@pytest.mark.parametrize("point", [KILL_QUARANTINED, KILL_RECLAIMING])
def test_an_owner_killed_inside_a_quarantine_step_leaves_expiry_working(
    name: str, children: Children, point: int
) -> None:
    """A SIGKILL inside the compiled steps: the reaper hands the slot back, and a later
    quarantine still expires at its deadline (a counter left behind once made every later
    quarantined slot wait for good)."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        proc = children.start(_quarantine_killed_at, name, point)
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL
        state = t.slot_info(0)[0]
        assert state is (State.QUARANTINED if point == KILL_QUARANTINED else State.RECLAIMING)
        if point == KILL_QUARANTINED:  # closed, its deadline not stored: none is shown
            with TableView.open(name) as view:
                assert view.slot(0).frees_in_s is None
        t.reap()
        assert t.stats().states["FREE"] == 1 and t.check_consistency() == []
        counters = t.stats().counters
        assert counters["quarantined"] == 1 and counters["quarantines_ended"] <= 1
        held = t.reserve(tag=7).quarantine(0.2)
        with SlotTable.attach(name, "other") as other:
            ws = other.claim(timeout=5.0)  # frees it once its window has passed
            assert ws.slot == held.slot and not held.held
            ws.abort()


def test_a_stale_push_cannot_cut_a_quarantine_short(name: str) -> None:
    """A publisher stopped between READY and its push stores the ring position into the
    slot entry when it resumes, though the slot has moved on since (taken, released,
    quarantined): the deadline kept in that word became a ring position, long passed."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        held = t.reserve(tag=1).quarantine(3600.0)
        own = t._own
        own.a.store(own.entry(held.slot) + L.SLOT_QUEUE_POS, 0)  # the stale push's store
        with SlotTable.attach(name, "other") as other:
            with pytest.raises(SlotsExhausted):
                other.claim(timeout=0.05)
            assert other.reap() == {}
        assert held.held and held.end()


def test_a_quarantined_slot_keeps_its_call_site(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2, trace=True) as t:
        held = t.reserve(tag=1).quarantine(60.0)
        (holding,) = t.holdings()
        assert holding.slots == [held.slot] and holding.states == {"QUARANTINED": 1}
        assert holding.site.function == "test_a_quarantined_slot_keeps_its_call_site"
        held.end()
