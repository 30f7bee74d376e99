"""Reaping from outside: attach to a table only to reclaim what dead participants owned.

`shmslots reap` uses this rather than SlotTable, which loads torch for its
handles; a command that only repairs should start at once.  The steps are the
ones SlotTable runs when it attaches, reaps and closes (table.py), on the same
registry, ownership and recovery code.
"""

from __future__ import annotations

import os
from collections import Counter

from . import layout as L
from ._atomic import AtomicView
from .arena import Arena
from .ownership import Ownership
from .participants import Registry
from .recovery import reap
from .segment import Segment
from .validate import read_schema, read_valid_header


class Reaper:
    """A participant that owns nothing and only reaps; it detaches on close."""

    def __init__(self, segment: Segment, role: str) -> None:
        header = read_valid_header(segment)
        read_schema(segment, header)  # refuse what SlotTable.attach would refuse
        self._segment = segment
        self._layout = lay = header.layout
        self._drop_held = bool(header.flags & L.FLAG_DROP_ON_CONSUMER_DEATH)
        self._atomics = AtomicView(segment.mm)
        self._mv = memoryview(segment.mm)
        self._lock_fd = os.open(f"/proc/self/fd/{segment.fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            self._registry = Registry(self._atomics, self._mv, lay, self._lock_fd)
            self.participant, died_here = self._registry.register(role, f"{role}-{os.getpid()}")
            self._own = Ownership(self._atomics, segment.mm, lay, self.participant + 1)
            self._arena = Arena(self._atomics, lay) if lay.arena_pages else None
            if died_here:  # the entry we took was a dead participant's: settle its slots first
                self._own.reclaim_own(self._drop_held)
                self._own.count("participants_reaped")
        except BaseException:
            os.close(self._lock_fd)  # drops our lock: a half-made entry reads as dead
            raise

    @classmethod
    def open(cls, name: str, role: str = "cli-reap") -> Reaper:
        segment = Segment.open(name)
        try:
            return cls(segment, role)
        except BaseException:
            segment.close()
            raise

    def reap(self) -> Counter[str]:
        """Reclaim the slots of every dead participant now; what was done, by reason."""
        self._registry.touch(self.participant)
        done = reap(self._own, self._registry, self.participant, self._drop_held)
        if done and self._arena is not None:
            done["arena_pages_freed"] = self._arena.collect(self._own.generation)
        return done

    def counters(self) -> dict[str, int]:
        return {name: self._own.counter(name) for name in L.COUNTERS}

    def close(self) -> None:
        """Detach once (a second call does nothing), as SlotTable.close does."""
        if self._own.hot.leave(self._lock_fd, self._drop_held) is None:
            return
        os.close(self._lock_fd)
        self._mv.release()
        self._atomics.release()
        self._own.hot.release()
        self._segment.close()

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
