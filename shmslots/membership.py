"""Joining a table, reaping the dead and leaving: the one way a process takes part in a
table, for SlotTable and for `shmslots reap` alike (no torch here, so a repair from the
command line starts at once).

Liveness, reaping and leaving, step by step: docs/protocol.md (Participants).  Each is one
compiled step (`HotPath.reap_entry`, `HotPath.leave`), so no interrupt leaves a lock held by
a live reaper or frees an entry a newcomer has taken.
"""

from __future__ import annotations

import io
from collections import Counter

from . import layout as L
from ._core import AtomicView
from .arena import open_arena
from .ownership import RECLAIMED, Ownership
from .participants import Registry
from .segment import Segment


class Membership:
    """This process's participant in one table: its liveness lock, its registry entry, the
    slots it owns, and the arena's pages, which follow the slots."""

    def __init__(
        self,
        segment: Segment,
        atomics: AtomicView,
        mv: memoryview,
        layout: L.Layout,
        role: str,
        name: str,
        drop_held: bool,
        stamp: int | None = None,
    ) -> None:
        self.drop_held = drop_held  # a dead consumer's leases: dropped, or redelivered
        # The liveness lock lives on an open file description of its own, not the one the
        # mapping holds: a forked child can then drop its copy (SlotTable._disown).  A file
        # object owns the descriptor from the moment it exists, so it is closed with the
        # object however that goes: a Membership dropped by an interrupt before its caller
        # held it leaves no entry that looks alive, and no descriptor.
        self._lock_file = io.FileIO(f"/proc/self/fd/{segment.fd}", "r+")  # close-on-exec
        self.lock_fd = self._lock_file.fileno()
        try:
            self.registry = Registry(atomics, mv, layout, self.lock_fd)
            self.participant, died_here = self.registry.register(role, name, stamp)
            self.own = Ownership(atomics, segment.mm, layout, self.participant + 1)
            self.arena = open_arena(atomics, layout)
            if died_here:  # the entry we took was a dead participant's: settle its slots first
                self.own.reclaim_own(drop_held)
                self.own.count("participants_reaped")
        except BaseException:
            self.drop_lock()  # a half-made entry reads as dead
            raise

    def reap(self) -> Counter[str]:
        """Reclaim the slots of every dead participant and free its entry, and free every
        quarantined slot whose window has ended; what was done, by reason."""
        self.registry.touch(self.participant)
        done: Counter[str] = Counter()
        for index in self.registry.dead_entries(self.participant):
            counts = self.own.hot.reap_entry(self.registry.fd, index, self.drop_held)
            if counts is not None:  # None: alive after all, or another reaper is on it
                done.update(dict(zip(RECLAIMED, counts, strict=True)))
                done["participants_reaped"] += 1
        if done:
            requeued = self.own.hot.requeue_stranded(0)
            if requeued:
                done["requeued"] = requeued
        done["quarantines_ended"] += self.own.hot.expire()
        done = +done  # drops the reasons of nothing done
        if done and self.arena is not None:
            done["arena_pages_freed"] = self.arena.collect()
        return done

    def leave(self) -> bool:
        """Hand back the slots still owned here, free the entry, drop the lock: one compiled
        step, which a retry (after an interrupt) does not repeat, so it never frees an entry
        a newcomer has taken meanwhile; after it, the compiled steps refuse to act in this
        participant's name.  Whether it left now."""
        return self.own.hot.leave(self.lock_fd, self.drop_held) is not None

    def drop_lock(self) -> None:
        """Close the lock's descriptor (once; again does nothing): after `leave`, or in a
        forked child (whose copy it is), or when joining failed."""
        self._lock_file.close()
