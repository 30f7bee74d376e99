"""The slot protocol: which words change, in which order, for every transition.

Rules that make every step safe against a crash at any instruction:

* Ownership is decided by one CAS on the slot's state word (states.py).
* The bitmap bit of a slot is set by its owner right *after* taking it from
  FREE and cleared by its owner right *before* handing it back to FREE.  The
  bit therefore only changes under ownership, two processes never race on
  it, and a FREE slot never has its bit set.  A claimer that sees a clear
  bit still has to win the CAS, so a slot caught between the two steps is
  skipped, never shared.
* A published slot is queued *before* it turns READY (ready_ring.py); a
  reader that meets a queued slot still WRITING waits for it, and one that
  meets a slot no longer READY at that queue position drops the entry.
* A reaper takes a dead owner's slot over with a CAS to RECLAIMING or
  REDELIVERING under its own id, so a reaper killed halfway leaves a slot
  that the next reaper finishes, and two reapers never both act.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import layout as L
from ._atomic import AtomicView
from .errors import InvalidSlot, OwnershipError, SlotsExhausted
from .ready_ring import ReadyRing
from .states import (
    GEN_MASK,
    Event,
    State,
    generation_of,
    next_word,
    owner_of,
    pack,
    state_of,
)

_M64 = (1 << 64) - 1
_FREE = int(State.FREE)
_RESERVED = int(State.RESERVED)
_WRITING = int(State.WRITING)
_READY = int(State.READY)
_HELD = int(State.HELD)
_RECLAIMING = int(State.RECLAIMING)
_REDELIVERING = int(State.REDELIVERING)
_PENDING = (_WRITING, _REDELIVERING)
_CLAIM = int(Event.CLAIM)
_RESERVE = int(Event.RESERVE)
_OPEN_RESERVED = int(Event.OPEN_RESERVED)
_PUBLISH = int(Event.PUBLISH)
_TAKE = int(Event.TAKE)
_RELEASE = int(Event.RELEASE)
_ABORT = int(Event.ABORT)
_RECLAIM = int(Event.RECLAIM)
_REDELIVER = int(Event.REDELIVER)
_FINISH = int(Event.FINISH)

REQUEUE_TIMEOUT_S = 5.0
RECLAIM_REASONS = {
    _WRITING: "reclaimed_writing",
    _RESERVED: "reclaimed_reserved",
    _HELD: "reclaimed_held_dropped",
}


@dataclass(frozen=True)
class Blocked:
    """The queue head is a publication its owner has not finished."""

    owner: int


@dataclass(frozen=True)
class Taken:
    slot: int
    generation: int
    tag: int
    deliveries: int


class Ownership:
    """Transitions of slots for one participant (`me` is its owner id)."""

    def __init__(self, atomics: AtomicView, lay: L.Layout, me: int) -> None:
        self.a = atomics
        self.layout = lay
        self.me = me
        self.ring = ReadyRing(atomics, lay)
        self._bitmap = lay.bitmap
        self._words = lay.bitmap_words
        self._entries = lay.slot_states
        self._nslots = lay.slots
        self._counters = lay.counters
        sync = lay.sync
        self.publish_seq = sync + L.PUBLISH_SEQ
        self.readers_waiting = sync + L.READERS_WAITING
        self.release_seq = sync + L.RELEASE_SEQ
        self.claimers_waiting = sync + L.CLAIMERS_WAITING
        self._hint = 0
        # Bits past the last slot count as owned, so scans never pick them.
        self._tail_mask = _M64 & ~((1 << (lay.slots % 64)) - 1) if lay.slots % 64 else 0

    # -- small helpers ---------------------------------------------------------------
    def entry(self, slot: int) -> int:
        return self._entries + slot * L.SLOT_ENTRY

    def word(self, slot: int) -> int:
        return self.a.load(self._entries + slot * L.SLOT_ENTRY)

    def count(self, name: str, n: int = 1) -> None:
        self.a.add(self._counters + L.COUNTER_OFFSET[name], n)

    def counter(self, name: str) -> int:
        return self.a.load(self._counters + L.COUNTER_OFFSET[name])

    def bit(self, slot: int) -> bool:
        return bool(self.a.load(self._bitmap + 8 * (slot >> 6)) >> (slot & 63) & 1)

    def _stamp(self, entry: int) -> None:
        self.a.store(entry + L.SLOT_STAMP, time.monotonic_ns())

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self._nslots:
            raise InvalidSlot(f"slot {slot!r} out of range 0..{self._nslots - 1}")

    # -- FREE -> owned ---------------------------------------------------------------
    def acquire_free(self, event: int, tag: int) -> tuple[int, int] | None:
        """Take any FREE slot (CLAIM or RESERVE); (slot, generation) or None if none."""
        a = self.a
        nwords = self._words
        last = nwords - 1
        for step in range(nwords):
            wi = (self._hint + step) % nwords
            woff = self._bitmap + 8 * wi
            bits = a.load(woff)
            if wi == last:
                bits |= self._tail_mask
            free = ~bits & _M64
            while free:
                low = free & -free
                slot = wi * 64 + low.bit_length() - 1
                entry = self._entries + slot * L.SLOT_ENTRY
                word = a.load(entry)
                if word & 0xFFFF == _FREE:
                    new = next_word(word, event, self.me)
                    if a.cas(entry, word, new):
                        a.fetch_or(woff, low)
                        a.store(entry + L.SLOT_TAG, tag)
                        a.store(entry + L.SLOT_QUEUE_POS, L.NO_QUEUE_POS)
                        a.store(entry + L.SLOT_DELIVERIES, 0)
                        a.store(entry + L.SLOT_STAMP, time.monotonic_ns())
                        self._hint = wi
                        return slot, new >> 32
                free ^= low
        return None

    # -- owned -> owned ----------------------------------------------------------------
    def open_reserved(self, slot: int, generation: int) -> None:
        self.check_slot(slot)
        entry = self.entry(slot)
        word = self.a.load(entry)
        if state_of(word) != State.RESERVED or generation_of(word) != generation & GEN_MASK:
            raise OwnershipError(
                f"slot {slot} generation {generation} is not reserved "
                f"(it is {state_of(word).name} at generation {generation_of(word)})"
            )
        if not self.a.cas(entry, word, next_word(word, _OPEN_RESERVED, self.me)):
            raise OwnershipError(f"slot {slot} changed while being opened; reservation is stale")
        self._stamp(entry)

    def publish(self, slot: int, generation: int, timeout: float) -> None:
        """Queue the slot, then turn it READY; waits for queue room up to `timeout`."""
        entry = self.entry(slot)
        mine = self.expect(slot, generation, _WRITING)
        self._push(slot, timeout)
        if not self.a.cas(entry, mine, next_word(mine, _PUBLISH, self.me)):
            raise OwnershipError(f"slot {slot} was taken from its writer during publish")
        self.a.store(entry + L.SLOT_STAMP, time.monotonic_ns())
        self.count("publishes")
        a = self.a
        a.add32(self.publish_seq, 1)
        if a.load(self.readers_waiting):
            a.futex_wake(self.publish_seq, -1)

    def _push(self, slot: int, timeout: float) -> None:
        """Queue the slot, dropping stale entries and waiting while the ring is full."""
        deadline = time.monotonic() + timeout
        while self.ring.push(slot, self.entry(slot) + L.SLOT_QUEUE_POS) is None:
            self._drop_stale_head()
            if time.monotonic() >= deadline:
                raise SlotsExhausted("ready queue full", self.occupancy())
            time.sleep(0.0005)

    def expect(self, slot: int, generation: int, state: int) -> int:
        """The word this participant must see to act on the slot, or OwnershipError."""
        want = pack(generation, self.me, State(state))
        word = self.a.load(self.entry(slot))
        if word != want:
            raise OwnershipError(
                f"slot {slot}: expected {State(state).name} generation {generation} owned by "
                f"participant {self.me - 1}, found {describe_word(word)}"
            )
        return want

    # -- READY -> HELD ------------------------------------------------------------------
    def take(self) -> Taken | Blocked | None:
        """Take the oldest READY slot; None if the queue is empty."""
        a = self.a
        ring = self.ring
        while True:
            head = ring.peek()
            if head is None:
                return None
            pos, slot = head
            entry = self._entries + slot * L.SLOT_ENTRY
            word = a.load(entry)
            state = word & 0xFFFF
            if a.load(entry + L.SLOT_QUEUE_POS) == pos:
                if state == _READY:
                    new = next_word(word, _TAKE, self.me)
                    if a.cas(entry, word, new):
                        ring.pop(pos, slot)
                        a.store(entry + L.SLOT_STAMP, time.monotonic_ns())
                        return Taken(
                            slot,
                            word >> 32,
                            a.load(entry + L.SLOT_TAG),
                            a.load(entry + L.SLOT_DELIVERIES),
                        )
                    continue
                if state in _PENDING:
                    return Blocked(owner_of(word))
            ring.pop(pos, slot)  # stale: taken, cancelled or requeued elsewhere

    def _drop_stale_head(self) -> None:
        head = self.ring.peek()
        if head is not None:
            pos, slot = head
            entry = self.entry(slot)
            word = self.a.load(entry)
            if self.a.load(entry + L.SLOT_QUEUE_POS) != pos or state_of(word) not in (
                State.READY,
                State.WRITING,
                State.REDELIVERING,
            ):
                self.ring.pop(pos, slot)

    # -- owned -> FREE --------------------------------------------------------------
    def free(self, slot: int, generation: int, state: int, event: int) -> None:
        """Hand an owned slot back: clear its bit, then CAS to FREE (generation + 1)."""
        mine = self.expect(slot, generation, state)
        self._free_owned(slot, mine, next_word(mine, event, self.me))

    def _free_owned(self, slot: int, mine: int, new: int) -> None:
        a = self.a
        entry = self._entries + slot * L.SLOT_ENTRY
        woff = self._bitmap + 8 * (slot >> 6)
        bit = 1 << (slot & 63)
        a.fetch_and(woff, ~bit & _M64)
        if not a.cas(entry, mine, new):
            a.fetch_or(woff, bit)
            raise OwnershipError(
                f"slot {slot} changed under its owner: {describe_word(self.word(slot))}"
            )
        a.store(entry + L.SLOT_STAMP, time.monotonic_ns())
        a.add32(self.release_seq, 1)
        if a.load(self.claimers_waiting):
            a.futex_wake(self.release_seq, -1)

    def cancel(self, tag: int) -> int:
        """Abort every READY slot carrying `tag` (a request cancelled before pickup)."""
        cancelled = 0
        for slot in range(self._nslots):
            entry = self.entry(slot)
            word = self.a.load(entry)
            if state_of(word) != State.READY or self.a.load(entry + L.SLOT_TAG) != tag:
                continue
            held = next_word(word, _TAKE, self.me)
            if self.a.cas(entry, word, held):
                self._free_owned(slot, held, next_word(held, _ABORT, self.me))
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
            self._push(slot, timeout=REQUEUE_TIMEOUT_S)
            a.cas(entry, mine, next_word(mine, _FINISH, self.me))
            a.store(entry + L.SLOT_STAMP, time.monotonic_ns())
            a.add32(self.publish_seq, 1)
            if a.load(self.readers_waiting):
                a.futex_wake(self.publish_seq, -1)
            return reason
        mine = next_word(word, _RECLAIM, self.me)
        if not a.cas(entry, word, mine):
            return None
        reason = RECLAIM_REASONS.get(state)
        if reason is not None:
            self.count(reason)
        self._free_owned(slot, mine, next_word(mine, _FINISH, self.me))
        return reason

    # -- observation ----------------------------------------------------------------
    def occupancy(self) -> dict[str, int]:
        counts = {s.name: 0 for s in State}
        for slot in range(self._nslots):
            counts[state_of(self.word(slot)).name] += 1
        return counts


def describe_word(word: int) -> str:
    owner = owner_of(word)
    who = f" owned by participant {owner - 1}" if owner else ""
    return f"{state_of(word).name} generation {generation_of(word)}{who}"
