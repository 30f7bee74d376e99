"""Reaping: hand back what dead participants owned, without losing anything committed.

A participant is dead when its registry entry is ACTIVE but nobody holds the
entry's byte lock (participants.py).  Reaping one is a single compiled step
(`HotPath.reap_entry`): take that lock, so only one process reaps a given
entry and no newcomer can reuse it meanwhile; reclaim the entry's slots; mark
it free; drop the lock.  No interrupt can leave the lock held by a live
reaper (which would make the dead participant look alive), and a reaper that
is killed drops it with its death, for the next one to redo the idempotent
work.  Afterwards any READY slot that no queue entry names (its publisher,
or a reaper, died between turning it READY and queueing it) is queued.
"""

from __future__ import annotations

from collections import Counter

from .ownership import RECLAIMED, Ownership
from .participants import Registry


def reap(own: Ownership, registry: Registry, own_index: int, drop_held: bool) -> Counter[str]:
    """Reclaim the slots of every dead participant and free its registry entry."""
    done: Counter[str] = Counter()
    for index in registry.dead_entries(own_index):
        counts = own.hot.reap_entry(registry.fd, index, drop_held)
        if counts is not None:  # None: alive after all, or another reaper is on it
            done.update(dict(zip(RECLAIMED, counts, strict=True)))
            done["participants_reaped"] += 1
    if done:
        requeued = own.hot.requeue_stranded(0)
        if requeued:
            done["requeued"] = requeued
    return +done
