"""Reaping: hand back what dead participants owned, without losing anything committed.

A participant is dead when its registry entry is ACTIVE but nobody holds the
entry's byte lock (participants.py).  The reaper takes that lock itself, so
only one process reaps a given entry and no newcomer can reuse it meanwhile;
if the reaper dies too, the lock falls free again and the next reaper redoes
the (idempotent) work.
"""

from __future__ import annotations

from collections import Counter

from .errors import CorruptTable
from .ownership import Ownership
from .participants import Registry
from .states import KNOWN_STATES, OWNED, owner_of, state_of


def reclaim_owner(own: Ownership, owner: int, drop_held: bool) -> Counter[str]:
    """Reclaim every slot whose state word names `owner`; counts by reason."""
    done: Counter[str] = Counter()
    for slot in range(own.layout.slots):
        word = own.word(slot)
        if owner_of(word) != owner:
            continue
        if word & 0xFFFF not in KNOWN_STATES:
            raise CorruptTable(f"slot {slot} has state word {word:#x}: no state this version knows")
        if state_of(word) in OWNED:
            reason = own.reclaim(slot, word, drop_held)
            if reason is not None:
                done[reason] += 1
    return done


def reap(own: Ownership, registry: Registry, own_index: int, drop_held: bool) -> Counter[str]:
    """Reclaim the slots of every dead participant and free its registry entry."""
    done: Counter[str] = Counter()
    for index in registry.dead_entries(own_index):
        if not registry.try_lock(index):
            continue  # another reaper is on it, or a newcomer took the entry
        try:
            if registry.is_active(index):
                done += reclaim_owner(own, index + 1, drop_held)
                registry.mark_free(index)
                own.count("participants_reaped")
                done["participants_reaped"] += 1
        finally:
            registry.unlock(index)
    return done
