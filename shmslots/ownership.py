"""The slot protocol's Python side: builds the compiled steps (csrc/hotpath.c) from states.py
and layout.py, checks their numbering, and reads what they leave for observation.

Every transition is one call into csrc/hotpath.c, which runs no Python code, so an exception or
a signal's handler can land only before or after it.  The rules those calls keep (the
bitmap, reservations, ready first, the ring, deliveries, reaping) are in docs/protocol.md.
"""

from __future__ import annotations

import mmap
from collections import Counter
from collections.abc import Iterable

from . import _core
from . import layout as L
from ._core import AtomicView, HotPath
from .errors import CorruptTable, OwnershipError
from .states import (
    OWNER_CHECKED,
    TRANSITIONS,
    Event,
    State,
    generation_of,
    known,
    owner_of,
    pack,
    state_name,
    state_of,
)

_M64 = (1 << 64) - 1
# READY slots no ring entry names are queued again once this old (a publisher in the
# middle of queueing one is not raced), from idle readers at most this often.
STRANDED_AGE_NS = 200_000_000
STRANDED_CHECK_S = 0.5
# What reclaim_owner and reap_entry return, in order.
RECLAIMED = (
    "reclaimed_writing",
    "reclaimed_reserved",
    "reclaimed_held_dropped",
    "redelivered",
    "quarantines_ended",
)

if {s.name: int(s) for s in State} != _core.STATES or {
    e.name: int(e) for e in Event
} != _core.EVENTS:
    raise ImportError("shmslots._core was built for another states.py: reinstall shmslots")


def _transition_table() -> bytes:
    table = bytearray(b"\xff" * 256)
    for (state, event), target in TRANSITIONS.items():
        table[16 * state + event] = target
    return bytes(table)


_TRANSITIONS = _transition_table()


def _bits(members: Iterable[int]) -> int:
    mask = 0
    for member in members:
        mask |= 1 << member
    return mask


def hot_path(buffer: mmap.mmap, lay: L.Layout, me: int) -> HotPath:
    """The compiled transitions, bound to this layout and the transition table."""
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
        deadline_off=L.SLOT_DEADLINE,
        ring=lay.ring,
        ring_cap=lay.ring_capacity,
        head=sync + L.RING_HEAD,
        tail=sync + L.RING_TAIL,
        publish_seq=sync + L.PUBLISH_SEQ,
        readers_waiting=sync + L.READERS_WAITING,
        readers_until=sync + L.READERS_UNTIL,
        release_seq=sync + L.RELEASE_SEQ,
        claimers_waiting=sync + L.CLAIMERS_WAITING,
        claimers_until=sync + L.CLAIMERS_UNTIL,
        registry=lay.registry,
        reg_entry=L.REGISTRY_ENTRY,
        reg_capacity=lay.registry_capacity,
        reg_state=L.REG_STATE,
        counters=tuple(lay.counters + L.COUNTER_OFFSET[name] for name in _core.COUNTERS),
        hist_held=lay.histograms + L.HISTOGRAM_OFFSET["held"],
        hist_ready=lay.histograms + L.HISTOGRAM_OFFSET["ready_wait"],
        hist_sum=L.HIST_SUM,
        hist_bounds=L.HIST_BOUNDS_NS,
        me=me,
        transitions=_TRANSITIONS,
        owner_checked=_bits(OWNER_CHECKED),
        corrupt=CorruptTable,
    )


class Ownership:
    """Transitions of slots for one participant (`me` is its owner id)."""

    def __init__(self, atomics: AtomicView, buffer: mmap.mmap, lay: L.Layout, me: int) -> None:
        self.a = atomics
        self.layout = lay
        self.me = me
        self.hot = hot_path(buffer, lay, me)
        self._entries = lay.slot_states
        self._bitmap = lay.bitmap
        self._nslots = lay.slots
        self._counters = lay.counters
        sync = lay.sync
        self.publish_seq = sync + L.PUBLISH_SEQ
        self.readers_waiting = sync + L.READERS_WAITING
        self.readers_until = sync + L.READERS_UNTIL
        self.release_seq = sync + L.RELEASE_SEQ
        self.claimers_waiting = sync + L.CLAIMERS_WAITING
        self.claimers_until = sync + L.CLAIMERS_UNTIL

    # -- small helpers ---------------------------------------------------------------
    def entry(self, slot: int) -> int:
        return self._entries + slot * L.SLOT_ENTRY

    def word(self, slot: int) -> int:
        return self.a.load(self._entries + slot * L.SLOT_ENTRY)

    def generation(self, slot: int) -> int:
        """Slot `slot`'s generation now, or -1 for a number that names no slot (an arena
        page's tag read from the segment, say)."""
        if not 0 <= slot < self._nslots:
            return -1
        return generation_of(self.word(slot))

    def count(self, name: str, n: int = 1) -> None:
        self.a.add(self._counters + L.COUNTER_OFFSET[name], n)

    def counter(self, name: str) -> int:
        return self.a.load(self._counters + L.COUNTER_OFFSET[name])

    def bit(self, slot: int) -> bool:
        return bool(self.a.load(self._bitmap + 8 * (slot >> 6)) >> (slot & 63) & 1)

    def queued(self) -> int:
        return self.hot.queued()

    # -- errors -----------------------------------------------------------------------
    def not_mine(self, slot: int, generation: int, state: int) -> OwnershipError:
        return OwnershipError(
            f"slot {slot}: expected {State(state).name} generation {generation} owned by "
            f"participant {self.me - 1}, found {describe_word(self.word(slot))}"
        )

    # -- recovery -------------------------------------------------------------------
    def reclaim_own(self, drop_held: bool) -> Counter[str]:
        """Hand back every slot this participant's id owns, as if it had died."""
        counts = self.hot.reclaim_owner(self.me, drop_held)
        return Counter(dict(zip(RECLAIMED, counts, strict=True)))

    # -- observation ----------------------------------------------------------------
    def occupancy(self) -> dict[str, int]:
        """Slots per state; words of no known state (corruption) count as INVALID."""
        counts = {s.name: 0 for s in State}
        for slot in range(self._nslots):
            word = self.word(slot)
            name = state_of(word).name if known(word) else "INVALID"
            counts[name] = counts.get(name, 0) + 1
        return counts

    def owns(self, slot: int, generation: int, state: int) -> bool:
        """Whether this participant holds the slot in `state` at `generation`."""
        return self.word(slot) == pack(generation, self.me, state)


def describe_word(word: int) -> str:
    """A state word for an error message; words are untrusted, so no ValueError here."""
    owner = owner_of(word)
    who = f" owned by participant {owner - 1}" if owner else ""
    return f"{state_name(word)} generation {generation_of(word)}{who}"
