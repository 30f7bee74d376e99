"""The slot protocol: which words change, in which order, for every transition.

Rules that make every step safe against a crash at any instruction:

* Ownership is decided by one CAS on the slot's state word (states.py).
* The bitmap bit of a slot is set by its owner right *after* taking it from
  FREE and cleared by its owner right *before* handing it back to FREE.  The
  bit therefore only changes under ownership, two processes never race on
  it, and a FREE slot never has its bit set.  A claimer that sees a clear
  bit still has to win the CAS, so a slot caught between the two steps is
  skipped, never shared.
* A published slot is queued *before* it turns READY (the ready ring, see
  _hotpath.c); a reader that meets a queued slot still WRITING waits for it,
  and one that meets a slot no longer READY at that queue position drops
  the entry.
* A reaper takes a dead owner's slot over with a CAS to RECLAIMING or
  REDELIVERING under its own id, so a reaper killed halfway leaves a slot
  that the next reaper finishes, and two reapers never both act.

The per-request steps (acquire, publish, take, free) run compiled in
_hotpath.c with the transition table of states.py; the rare ones run here.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterable

from . import layout as L
from ._atomic import AtomicView
from ._hotpath import HotPath
from .errors import CorruptTable, OwnershipError, SlotsExhausted
from .states import (
    GEN_MASK,
    KNOWN_STATES,
    OWNER_CHECKED,
    TRANSITIONS,
    Event,
    State,
    generation_of,
    next_word,
    owner_of,
)
from .waiting import wake_all

_M64 = (1 << 64) - 1
_WRITING = int(State.WRITING)
_READY = int(State.READY)
_HELD = int(State.HELD)
_REDELIVERING = int(State.REDELIVERING)
_RECLAIMING = int(State.RECLAIMING)
_RESERVED = int(State.RESERVED)
_CANCEL = int(Event.CANCEL)
_TAKE = int(Event.TAKE)
_RELEASE = int(Event.RELEASE)
_ABORT = int(Event.ABORT)
_OPEN_RESERVED = int(Event.OPEN_RESERVED)
_RECLAIM = int(Event.RECLAIM)
_REDELIVER = int(Event.REDELIVER)
_FINISH = int(Event.FINISH)
_NO_COUNTER = -1

REQUEUE_TIMEOUT_S = 5.0
RECLAIM_REASONS = {
    int(State.WRITING): "reclaimed_writing",
    int(State.RESERVED): "reclaimed_reserved",
    _HELD: "reclaimed_held_dropped",
}


def _transition_table() -> bytes:
    table = bytearray(b"\xff" * 256)
    for (state, event), target in TRANSITIONS.items():
        table[16 * state + event] = target
    return bytes(table)


def _bits(members: Iterable[int]) -> int:
    mask = 0
    for member in members:
        mask |= 1 << member
    return mask


def hot_path(buffer: mmap.mmap, lay: L.Layout, me: int) -> HotPath:
    """The compiled per-request steps, bound to this layout and transition table."""
    sync = lay.sync
    return HotPath(
        buffer,
        bitmap=lay.bitmap,
        nwords=lay.bitmap_words,
        tail_mask=_M64 & ~((1 << (lay.slots % 64)) - 1) if lay.slots % 64 else 0,
        entries=lay.slot_states,
        entry_size=L.SLOT_ENTRY,
        nslots=lay.slots,
        tag_off=L.SLOT_TAG,
        stamp_off=L.SLOT_STAMP,
        qpos_off=L.SLOT_QUEUE_POS,
        deliveries_off=L.SLOT_DELIVERIES,
        ring=lay.ring,
        ring_cap=lay.ring_capacity,
        head=sync + L.RING_HEAD,
        tail=sync + L.RING_TAIL,
        publish_seq=sync + L.PUBLISH_SEQ,
        readers_waiting=sync + L.READERS_WAITING,
        release_seq=sync + L.RELEASE_SEQ,
        claimers_waiting=sync + L.CLAIMERS_WAITING,
        publishes_counter=lay.counters + L.COUNTER_OFFSET["publishes"],
        takes_counter=lay.counters + L.COUNTER_OFFSET["takes"],
        me=me,
        transitions=_transition_table(),
        owner_checked=_bits(OWNER_CHECKED),
        events=(int(Event.CLAIM), int(Event.PUBLISH), int(Event.TAKE)),
        states=(int(State.FREE), _WRITING, _READY, _HELD),
        pending_states=_bits((State.WRITING, State.REDELIVERING)),
        corrupt=CorruptTable,
    )


class Ownership:
    """Transitions of slots for one participant (`me` is its owner id)."""

    def __init__(self, atomics: AtomicView, buffer: mmap.mmap, lay: L.Layout, me: int) -> None:
        self.a = atomics
        self.layout = lay
        self.me = me
        self.hot = hot_path(buffer, lay, me)
        # READY -> HELD of the oldest queued slot, one C call: (slot, generation, tag,
        # deliveries), None when the queue is empty, or the owner id (an int) of an
        # unfinished publication at the head.
        self.take = self.hot.take
        self._bitmap = lay.bitmap
        self._entries = lay.slot_states
        self._nslots = lay.slots
        self._counters = lay.counters
        sync = lay.sync
        self.publish_seq = sync + L.PUBLISH_SEQ
        self.readers_waiting = sync + L.READERS_WAITING
        self.release_seq = sync + L.RELEASE_SEQ
        self.claimers_waiting = sync + L.CLAIMERS_WAITING
        self._acquire_counter = {
            int(Event.CLAIM): self.counter_offset("claims"),
            int(Event.RESERVE): self.counter_offset("reserves"),
        }
        self._free_counter = {
            _RELEASE: self.counter_offset("releases"),
            _ABORT: self.counter_offset("aborts"),
            _FINISH: _NO_COUNTER,
        }

    # -- small helpers ---------------------------------------------------------------
    def entry(self, slot: int) -> int:
        return self._entries + slot * L.SLOT_ENTRY

    def word(self, slot: int) -> int:
        return self.a.load(self._entries + slot * L.SLOT_ENTRY)

    def counter_offset(self, name: str) -> int:
        return self._counters + L.COUNTER_OFFSET[name]

    def count(self, name: str, n: int = 1) -> None:
        self.a.add(self._counters + L.COUNTER_OFFSET[name], n)

    def counter(self, name: str) -> int:
        return self.a.load(self._counters + L.COUNTER_OFFSET[name])

    def bit(self, slot: int) -> bool:
        return bool(self.a.load(self._bitmap + 8 * (slot >> 6)) >> (slot & 63) & 1)

    def queued(self) -> int:
        return self.hot.queued()

    # -- FREE -> owned ---------------------------------------------------------------
    def acquire_free(self, event: int, tag: int) -> tuple[int, int] | None:
        """Take any FREE slot (CLAIM or RESERVE); (slot, generation) or None if none."""
        return self.hot.acquire(event, tag, self._acquire_counter[event])

    # -- owned -> owned ----------------------------------------------------------------
    def open_reserved(self, slot: int, generation: int) -> None:
        self.layout.check_slot(slot)
        if not isinstance(generation, int) or not 0 <= generation <= GEN_MASK:
            raise OwnershipError(f"generation {generation!r} is not a 32-bit generation")
        entry = self.entry(slot)
        word = self.a.load(entry)
        if word & 0xFFFF != _RESERVED or generation_of(word) != generation:
            raise OwnershipError(
                f"slot {slot} generation {generation} is not reserved (it is {describe_word(word)})"
            )
        if not self.a.cas(entry, word, next_word(word, _OPEN_RESERVED, self.me)):
            raise OwnershipError(f"slot {slot} changed while being opened; reservation is stale")
        self.a.store(entry + L.SLOT_STAMP, time.monotonic_ns())

    def publish(self, slot: int, generation: int, timeout: float) -> None:
        """Queue the slot, then turn it READY; waits for queue room up to `timeout`."""
        result = self.hot.publish(slot, generation)
        if result == -2:
            deadline = time.monotonic() + timeout
            while (result := self.hot.publish(slot, generation)) == -2:
                self._make_room(deadline)
        if result == -1:
            raise self._not_mine(slot, generation, _WRITING)

    def _make_room(self, deadline: float) -> None:
        """The ring was full: drop a stale head entry, or wait a little (until `deadline`)."""
        if not self.hot.drop_stale_head():
            if time.monotonic() >= deadline:
                raise SlotsExhausted("ready queue full", self.occupancy())
            time.sleep(0.0005)

    def _not_mine(self, slot: int, generation: int, state: int) -> OwnershipError:
        return OwnershipError(
            f"slot {slot}: expected {State(state).name} generation {generation} owned by "
            f"participant {self.me - 1}, found {describe_word(self.word(slot))}"
        )

    # -- READY -> HELD ------------------------------------------------------------------
    # -- owned -> FREE --------------------------------------------------------------
    def free(self, slot: int, generation: int, state: int, event: int) -> None:
        """Hand an owned slot back: clear its bit, then CAS to FREE (generation + 1)."""
        if self.hot.free(slot, generation, state, event, self._free_counter[event]):
            raise self._not_mine(slot, generation, state)

    def cancel(self, tag: int) -> int:
        """Abort every READY slot carrying `tag` (a request cancelled before pickup).

        One CAS takes the slot from READY to RECLAIMING under our id, so a
        canceller killed before the slot is FREE leaves it to a reaper to free,
        never to redeliver.  Its queue entry goes stale; the slot is claimable
        again once the queue's head has passed it (see _hotpath.c, acquire).
        """
        cancelled = 0
        for slot in range(self._nslots):
            entry = self.entry(slot)
            word = self.a.load(entry)
            if word & 0xFFFF != _READY or self.a.load(entry + L.SLOT_TAG) != tag:
                continue
            if self.a.cas(entry, word, next_word(word, _CANCEL, self.me)):
                self.free(slot, generation_of(word), _RECLAIMING, _FINISH)
                cancelled += 1
        if cancelled:
            self.count("cancels", cancelled)
            self.count("aborts", cancelled)
        return cancelled

    # -- recovery -------------------------------------------------------------------
    def reclaim(self, slot: int, word: int, drop_held: bool) -> str | None:
        """Move a dead owner's slot on; returns the counter it was counted under.

        WRITING/RESERVED go back to FREE; HELD is queued again (or freed when
        `drop_held`); RECLAIMING/REDELIVERING left by a dead reaper are finished.
        """
        a = self.a
        entry = self.entry(slot)
        state = word & 0xFFFF
        generation = generation_of(word)
        reason: str | None = None
        if state == _REDELIVERING or (state == _HELD and not drop_held):
            mine = next_word(word, _REDELIVER, self.me)
            if not a.cas(entry, word, mine):
                return None
            # A consumer killed inside release() may have cleared the bit already.
            a.fetch_or(self._bitmap + 8 * (slot >> 6), 1 << (slot & 63))
            if state == _HELD:
                reason = "redelivered"
                self.count(reason)
                a.add(entry + L.SLOT_DELIVERIES, 1)
            a.store(entry + L.SLOT_QUEUE_POS, L.NO_QUEUE_POS)
            deadline = time.monotonic() + REQUEUE_TIMEOUT_S
            while self.hot.push(slot) < 0:
                self._make_room(deadline)
            a.cas(entry, mine, next_word(mine, _FINISH, self.me))
            a.store(entry + L.SLOT_STAMP, time.monotonic_ns())
            wake_all(a, self.publish_seq, self.readers_waiting)
            return reason
        if not a.cas(entry, word, next_word(word, _RECLAIM, self.me)):
            return None
        reason = RECLAIM_REASONS.get(state)
        if reason is not None:
            self.count(reason)
        self.hot.forget_position(slot)  # a publisher may have died mid-queueing
        self.free(slot, generation, _RECLAIMING, _FINISH)
        return reason

    # -- observation ----------------------------------------------------------------
    def occupancy(self) -> dict[str, int]:
        """Slots per state; words of no known state (corruption) count as INVALID."""
        counts = {s.name: 0 for s in State}
        for slot in range(self._nslots):
            state = self.word(slot) & 0xFFFF
            name = State(state).name if state in KNOWN_STATES else "INVALID"
            counts[name] = counts.get(name, 0) + 1
        return counts

    def owns(self, slot: int, generation: int, state: int) -> bool:
        """Whether this participant holds the slot in `state` at `generation`."""
        return self.word(slot) == (generation & GEN_MASK) << 32 | self.me << 16 | state


def describe_word(word: int) -> str:
    """A state word for an error message; words are untrusted, so no ValueError here."""
    owner = owner_of(word)
    who = f" owned by participant {owner - 1}" if owner else ""
    state = word & 0xFFFF
    name = State(state).name if state in KNOWN_STATES else f"INVALID({state:#x})"
    return f"{name} generation {generation_of(word)}{who}"
