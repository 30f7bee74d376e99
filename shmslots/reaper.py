"""Reaping from outside: attach to a table only to reclaim what dead participants owned.

`shmslots reap` uses this rather than SlotTable, which loads torch for its
handles; a command that only repairs should start at once.  It joins, reaps
and leaves as SlotTable does, through the same `Membership`.
"""

from __future__ import annotations

import os
from collections import Counter

from . import layout as L
from ._core import AtomicView
from .membership import Membership
from .segment import Segment
from .validate import read_schema, read_valid_header


class Reaper:
    """A participant that owns nothing and only reaps; it detaches on close."""

    def __init__(self, segment: Segment, role: str) -> None:
        header = read_valid_header(segment)
        read_schema(segment, header)  # refuse what SlotTable.attach would refuse
        self._segment = segment
        self._atomics = AtomicView(segment.mm)
        self._mv = memoryview(segment.mm)
        drop_held = bool(header.flags & L.FLAG_DROP_ON_CONSUMER_DEATH)
        self._member = Membership(
            segment,
            self._atomics,
            self._mv,
            header.layout,
            role,
            f"{role}-{os.getpid()}",
            drop_held,
        )
        try:
            self.participant = self._member.participant
        except BaseException:  # an interrupt: leave nothing behind that looks alive
            self._member.drop_lock()
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
        return self._member.reap()

    def counters(self) -> dict[str, int]:
        return {name: self._member.own.counter(name) for name in L.COUNTERS}

    def close(self) -> None:
        """Detach once (a second call does nothing), as SlotTable.close does."""
        if not self._member.leave():
            return
        self._member.drop_lock()
        self._mv.release()
        self._atomics.release()
        self._member.own.hot.release()
        self._segment.close()

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
