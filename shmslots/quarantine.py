"""Aborted transfers' slots, held back until a late write by address can no longer land.

A slot whose addresses were handed to a writer that writes by address (a transfer engine
through `table.buffer_infos()`) may be aborted while that write is still in flight: the
request was cancelled, or its transfer timed out.  Freed at once, the slot could be reserved
again and the late write would land in the next request's row, where nothing can tell it
apart (the engine writes bytes, not generations).  So the owner quarantines it: QUARANTINED
in the segment, with its deadline, opened by no producer, taken by no reader, until
`window_s` has passed (as SGLang's own deferred release waits for the prefill side before
freeing an index).  This book frees its own slots at their deadlines; the segment's state
is what keeps them closed (leases.Quarantined, docs/protocol.md: Quarantine).

The window is the promise that bounds it: no write for a reservation arrives more than
`window_s` after the reservation is aborted.  An owner that dies takes its engine's
registration with it (a remote engine can no longer write there), and the reaper frees its
quarantined slots at once; a writer on the same machine that maps the table itself is not
stopped by that, and must honour the window on its own.
"""

from __future__ import annotations

import time
from collections import deque

from .errors import InvalidArgument, OwnershipError
from .leases import Quarantined, Reservation, WriteSlot, _window_ns

# settled by the owner: how long after the window the segment frees a slot on its own
BACKSTOP_S = 60.0


class Quarantine:
    """Slots of transfers aborted by their owner, each freed once `window_s` has passed.

    With `settled_by_owner`, this book frees them when its owner says (`end_first`, or
    `sweep`), which an owner that must free them in step with peers on other clocks needs
    (SGLang's decode ranks, which must admit alike).  The segment's deadline is then only a
    backstop, `BACKSTOP_S` after the window, for a slot the book lost track of (an
    interrupt between the step that closes it and the book's entry)."""

    def __init__(self, window_s: float, *, settled_by_owner: bool = False) -> None:
        _window_ns(window_s)  # refused here, not at the first hold
        self.window_s = float(window_s)
        self.settled_by_owner = settled_by_owner
        _window_ns(self._segment_window_s())
        # (when this book's window ends, in CLOCK_MONOTONIC ns; the slot), in hold order
        self._held: deque[tuple[int, Quarantined]] = deque()
        self.released = 0  # slots whose window ended while in this book

    def __len__(self) -> int:
        """Slots held now: unless settled by the owner, those whose window has passed are
        freed first; those freed otherwise (their table closed, a claim freed them at their
        deadline, a reaper) are forgotten."""
        if not self.settled_by_owner:
            self.sweep()
        if not all(q.held for _, q in self._held):
            self._held = deque((due, q) for due, q in self._held if q.held)
        return len(self._held)

    def __bool__(self) -> bool:
        """Whether the book holds any slot, due or not: cheaper than len(), which sweeps."""
        return bool(self._held)

    def hold(self, handle: Reservation | WriteSlot) -> bool:
        """Quarantine a reservation whose transfer was aborted, or a write slot whose row
        was refused while a write may still be landing; whether it is held now.  One that
        already ended, or that its producer opened, is not held (the slot is the
        producer's); one held already has ended, and is refused."""
        if not isinstance(handle, (Reservation, WriteSlot)):
            raise InvalidArgument(f"a quarantine holds Reservations, not {handle!r}")
        if not handle._open:
            if any(
                q.slot == handle.slot
                and q.generation == handle.generation
                and q._parts is handle._parts
                for _, q in self._held
            ):
                raise InvalidArgument(
                    f"slot {handle.slot} (generation {handle.generation}) is held already"
                )
            return False
        try:
            q = handle.quarantine(self._segment_window_s())
        except OwnershipError:  # its producer opened it first: the slot is the producer's
            return False
        if self.settled_by_owner:  # the book's own window, counted once the slot is closed
            self._held.append((time.monotonic_ns() + _window_ns(self.window_s), q))
        else:
            self._held.append((q.deadline_ns, q))
        if not self.settled_by_owner:
            self.sweep()
        return True

    def _segment_window_s(self) -> float:
        """How long the segment keeps a slot closed on its own."""
        return self.window_s + (BACKSTOP_S if self.settled_by_owner else 0.0)

    def due(self) -> int:
        """How many held slots, first in hold order, have passed their window on this
        process's clock (they are due in hold order: one window for all)."""
        now_ns = time.monotonic_ns()
        due = 0
        for due_ns, _ in self._held:
            if due_ns > now_ns:
                break
            due += 1
        return due

    def sweep(self) -> int:
        """Free every held slot whose window has passed; returns how many."""
        return self.end_first(self.due())

    def end_first(self, n: int) -> int:
        """Free the first `n` held slots (at most all), in hold order; returns how many.
        Each is freed before it is forgotten (`end` may be called again), so an interrupt
        between the two leaves it in the book, never closed and forgotten."""
        ended = 0
        while self._held and ended < n:
            self._held[0][1].end()
            self._held.popleft()
            ended += 1
        self.released += ended
        return ended

    def close(self) -> None:
        """Free everything held now (the owner is closing: its engine stops writing)."""
        while self._held:
            self._held[0][1].end()
            self._held.popleft()
