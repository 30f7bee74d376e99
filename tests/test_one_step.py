"""Issue #14's defects, one test each: transitions no interrupt, death or stop can split.

The sweep over every line event is tests/test_crash_points.py; these pin the
particular windows that were found, each with real processes and signals.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import warnings
from multiprocessing.synchronize import Event

import pytest
import torch
from conftest import SMALL, SPAWN, Children, small_row

from shmslots import CorruptTable, SchemaError, SlotTable, State
from shmslots import layout as L
from shmslots.states import Event as Transition
from shmslots.states import generation_of, next_word, state_of


def _reserve_forever(name: str, ready: Event, stop: Event) -> None:
    with SlotTable.attach(name, "reserver") as t:
        ready.set()
        while not stop.is_set():
            try:
                t.reserve(tag=1, timeout=0.01).end()
            except Exception:
                continue


def _open_forever(name: str, ready: Event, stop: Event) -> None:
    """Open the one slot the moment its word reads RESERVED, then abort it."""
    with SlotTable.attach(name, "opener") as t:
        ready.set()
        while not stop.is_set():
            word = t._own.word(0)
            if state_of(word) == State.RESERVED:
                try:
                    t.open_reserved(0, generation_of(word)).abort()
                except Exception:
                    continue


@pytest.mark.timeout(60)
def test_a_reservation_cannot_be_opened_before_it_is_set_up(name: str, children: Children) -> None:
    """Defect 4: an opener that aborts inside reserve() left FREE-with-bit-set (lost)."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        stop, reserving, opening = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
        children.start(_reserve_forever, name, reserving, stop)
        children.start(_open_forever, name, opening, stop)
        assert reserving.wait(60) and opening.wait(60)
        deadline = time.monotonic() + 3.0
        lost = 0
        while time.monotonic() < deadline:
            word = t._own.word(0)
            lost += state_of(word) == State.FREE and t._own.bit(0) and t._own.word(0) == word
            time.sleep(0.001)
        stop.set()
        children.join_all(timeout=30)
        assert t.stats().counters["reserves"] > 100  # the race was really run
        assert t.check_consistency() == []
        t.claim(timeout=1.0).abort()  # the slot is claimable again
        assert lost == 0


def test_a_dropped_write_slot_is_aborted(name: str) -> None:
    """Defect 5: a WriteSlot nobody published or aborted kept its slot for good."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        with pytest.warns(ResourceWarning, match="WriteSlot of slot 0"):
            t.claim(tag=3)
            gc.collect()
        assert t.slot_info(0)[0] is State.FREE
        assert t.stats().counters["aborts"] == 1


@pytest.mark.parametrize("policy", ["redeliver", "drop"])
def test_a_dropped_lease_goes_as_its_table_says(name: str, policy: str) -> None:
    with SlotTable.create(name, SMALL, slots=1, on_consumer_death=policy) as t:  # type: ignore[arg-type]
        t.claim(tag=4).write(**small_row(4)).publish()
        with pytest.warns(ResourceWarning, match="Lease of slot 0"):
            t.take()
        if policy == "redeliver":
            lease = t.take()
            assert lease is not None and lease.tag == 4 and lease.deliveries == 1
            lease.release()
        else:
            assert t.take() is None
        assert t.slot_info(0)[0] is State.FREE and t.check_consistency() == []


def test_a_write_that_raises_in_a_chain_leaks_no_slot(name: str) -> None:
    """`claim().write(bad).publish()`: the slot comes back once the error is dropped."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with contextlib.suppress(SchemaError):  # the error, and its traceback, are dropped
                t.claim(tag=5).write(id=torch.zeros(3)).publish()
            gc.collect()
        assert any(issubclass(w.category, ResourceWarning) for w in seen)
        assert t.slot_info(0)[0] is State.FREE


def test_a_strict_poll_that_fails_leaves_nothing_owned(name: str) -> None:
    """Defect 5: rows already taken by a poll that then raised stayed HELD with no handle."""
    with SlotTable.create(name, SMALL, slots=3, strict=True) as t:
        for tag in (1, 2, 3):
            t.claim(tag=tag).write(**small_row(tag)).publish()
        bad = next(s for s in range(3) if t.slot_info(s)[3] == 2)
        t._segment.mm[t._rows.item(bad, next(iter(t.schema.slots)))] ^= 0xFF  # corrupt its row
        with pytest.raises(CorruptTable, match=f"slot {bad}"):
            t.poll(3)
        states = {t.slot_info(s)[3]: t.slot_info(s)[0] for s in range(3)}
        assert states == {1: State.READY, 2: State.FREE, 3: State.READY}
        leases = t.poll(3)
        assert sorted(lease.tag for lease in leases) == [1, 3]
        # handed back unread: their first real delivery says so (#24, defect 7)
        assert [lease.deliveries for lease in leases] == [0, 0]
        for lease in leases:
            lease.release()


def _hold_then_drop_table(name: str, ready: Event) -> None:
    """Take a row, then drop the table and the lease without closing; stay alive."""
    t = SlotTable.attach(name, "dropper")
    lease = t.take(timeout=5.0)
    assert lease is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del lease, t
        gc.collect()
    ready.set()
    time.sleep(60)


def test_a_dropped_table_closes_and_its_process_no_longer_owns_anything(
    name: str, children: Children
) -> None:
    """Defect 5: a dropped table kept its lock descriptor, so its process looked alive."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim(tag=6).write(**small_row(6)).publish()
        ready = SPAWN.Event()
        children.start(_hold_then_drop_table, name, ready)
        assert ready.wait(60)  # the child lives on
        assert [p.role for p in t.participants()] == ["owner"]
        lease = t.take(timeout=1.0)
        assert lease is not None and lease.tag == 6
        lease.release()


def _sleep_in_take(name: str, ready: Event) -> None:
    t = SlotTable.attach(name, "sleeper")
    ready.set()
    t.take(timeout=30.0)


def test_a_waiter_killed_in_its_sleep_stops_costing_wakers_within_a_nap(
    name: str, children: Children
) -> None:
    """Defect 7: the waiter count stayed 1 for good, so every publish made a futex syscall."""
    with SlotTable.create(name, SMALL, slots=1) as t:
        ready = SPAWN.Event()
        proc = children.start(_sleep_in_take, name, ready)
        assert ready.wait(60)
        sync, a = t.layout.sync, t._atomics
        deadline = time.monotonic() + 10
        while a.load(sync + L.READERS_WAITING) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.load(sync + L.READERS_WAITING) == 1  # it sleeps, counted
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
        time.sleep(1.5)  # a nap (0.25 s) and the deadline's slack (1 s)
        still_counted = a.load(sync + L.READERS_WAITING) == 1
        assert still_counted and a.load(sync + L.READERS_UNTIL) < time.monotonic_ns()


def _strand_then_stop(name: str, ready: Event) -> None:
    """Leave a row READY but not queued, as a publisher stopped between the two does."""
    t = SlotTable.attach(name, "stopped")
    ws = t.claim(tag=7).write(**small_row(7))
    t._rows.seal(ws.slot, ws.generation)
    own = t._own
    word = own.word(ws.slot)
    assert own.a.cas(own.entry(ws.slot), word, next_word(word, int(Transition.PUBLISH), own.me))
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)


@pytest.mark.timeout(60)
def test_a_stopped_publisher_blocks_no_reader(name: str, children: Children) -> None:
    """Defect 9: a publisher stopped mid-publish stalled every reader while it lived."""
    with SlotTable.create(name, SMALL, slots=2) as t, SlotTable.attach(name, "reader") as r:
        ready = SPAWN.Event()
        proc = children.start(_strand_then_stop, name, ready)
        assert ready.wait(60)
        t.claim(tag=8).write(**small_row(8)).publish()
        started = time.monotonic()
        first = r.take(timeout=2.0)
        assert first is not None and first.tag == 8  # nothing waits on the stopped process
        first.release()
        second = r.take(timeout=2.0)  # its row reaches readers while it is still stopped
        assert second is not None and second.tag == 7 and second.verify()
        second.release()
        assert time.monotonic() - started < 2.0
        os.kill(proc.pid or 0, signal.SIGKILL)
        os.kill(proc.pid or 0, signal.SIGCONT)


def test_a_close_retried_after_an_interrupt_leaves_a_newcomer_alone(name: str) -> None:
    """An interrupt between close()'s detach and its bookkeeping, then close() again: the
    entry may have been taken by a new participant meanwhile, whose slots must stay its own."""
    with SlotTable.create(name, SMALL, slots=2) as owner:
        first = SlotTable.attach(name, "first")
        first._member.leave()  # what close() did before the interrupt
        with pytest.raises(ValueError, match="left the table"):
            first._own.hot.acquire(0, 1)  # nothing is taken in the old owner id's name
        newcomer = SlotTable.attach(name, "newcomer")  # takes the freed entry, same owner id
        assert newcomer.participant == first.participant
        ws = newcomer.claim(tag=9).write(**small_row(9))
        first.close()  # the retry
        ws.publish()  # still the newcomer's
        assert [p.role for p in owner.participants()] == ["owner", "newcomer"]
        newcomer.close()
        lease = owner.take(timeout=1.0)
        assert lease is not None and lease.tag == 9
        lease.release()


def test_a_table_collected_unclosed_closes_even_if_its_warning_raises(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=1) as owner:
        dropped = SlotTable.attach(name, "dropped")
        raised: list[object] = []
        hook, sys.unraisablehook = sys.unraisablehook, raised.append  # __del__ cannot raise
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", ResourceWarning)
                del dropped
                gc.collect()
        finally:
            sys.unraisablehook = hook
        assert len(raised) == 1  # the warning, raised as an error, was reported...
        assert [p.role for p in owner.participants()] == ["owner"]  # ...after it closed


class _InterruptAt:
    """A tracer that raises KeyboardInterrupt once, at one bytecode offset of one code
    object: where CPython runs a pending SIGINT handler."""

    def __init__(self, code: object, offset: int) -> None:
        self.code, self.offset, self.fired = code, offset, False

    def __call__(self, frame: object, event: str, arg: object) -> object:
        if getattr(frame, "f_code", None) is not self.code:
            return None
        frame.f_trace_opcodes = True  # type: ignore[attr-defined]
        return self.local

    def local(self, frame: object, event: str, arg: object) -> object:
        if event == "opcode" and getattr(frame, "f_lasti", -1) == self.offset and not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return self.local


@pytest.mark.timeout(300)
@pytest.mark.parametrize("joiner", ["SlotTable", "Membership", "Reaper"])
def test_an_interrupt_anywhere_in_joining_leaves_no_live_looking_participant(
    name: str, joiner: str
) -> None:
    """KeyboardInterrupt at every bytecode of joining (SlotTable.__init__, Membership's,
    Reaper's): afterwards no entry looks alive but the creator's, and no descriptor is
    left open (a Membership dropped before its caller held it closes its own lock)."""
    import dis

    from shmslots.membership import Membership
    from shmslots.reaper import Reaper

    code = {
        "SlotTable": SlotTable.__init__.__code__,
        "Membership": Membership.__init__.__code__,
        "Reaper": Reaper.__init__.__code__,
    }[joiner]
    found = []
    with SlotTable.create(name, SMALL, slots=2) as creator:
        for instruction in dis.get_instructions(code):
            before = len(os.listdir("/proc/self/fd"))
            tracer = _InterruptAt(code, instruction.offset)
            joined: SlotTable | Reaper | None = None
            sys.settrace(tracer)  # type: ignore[arg-type]
            try:
                joined = Reaper.open(name) if joiner == "Reaper" else SlotTable.attach(name, "j")
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            if joined is not None:
                joined.close()
            gc.collect()
            alive = [p.index for p in creator.participants() if p.alive]
            left = len(os.listdir("/proc/self/fd")) - before
            if alive != [creator.participant] or left:
                found.append((instruction.offset, instruction.positions, alive, left))
            creator.reap()  # whatever an interrupted join left, before the next one
    assert found == []
