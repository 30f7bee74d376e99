"""The ready queue: published slots in publish order, safe against a crash anywhere.

A bounded ring of 64-bit cells, each tagged with the queue position it holds::

    bits 63..21  position (mod 2**43)     bit 20  full     bits 19..0  slot

A cell is `empty(p)` when position p may be written into it, and `full(p, s)`
once slot s was queued at p.  Every step is a single CAS on a cell or on the
head/tail counters, and any process that finds a counter lagging behind a
cell moves it on ("helping").  So a process killed between two steps leaves
nothing that blocks the others: there is no lock to leave held.

The ring only orders; the slot's state word decides delivery (ownership.py):
an entry whose slot is no longer READY at that position is stale and dropped.
"""

from __future__ import annotations

from . import layout as L
from ._atomic import AtomicView

_POS_BITS = 43
_POS_MASK = (1 << _POS_BITS) - 1
_FULL = 1 << 20
_SLOT_MASK = _FULL - 1


def empty_cell(pos: int) -> int:
    return (pos & _POS_MASK) << 21


def full_cell(pos: int, slot: int) -> int:
    return ((pos & _POS_MASK) << 21) | _FULL | slot


class ReadyRing:
    def __init__(self, atomics: AtomicView, lay: L.Layout) -> None:
        self._a = atomics
        self._cells = lay.ring
        self._cap = lay.ring_capacity
        self._head = lay.sync + L.RING_HEAD
        self._tail = lay.sync + L.RING_TAIL

    def initialise(self) -> None:
        for pos in range(self._cap):
            self._a.store(self._cells + 8 * pos, empty_cell(pos))

    def push(self, slot: int, queue_pos_word: int) -> int | None:
        """Queue `slot`; returns its position, or None when the ring is full.

        The position is stored in the slot's `queue_pos_word` *before* the
        cell is filled, so a reader that sees the cell also sees the position.
        """
        a = self._a
        while True:
            tail = a.load(self._tail)
            cell = self._cells + 8 * (tail % self._cap)
            value = a.load(cell)
            if value == empty_cell(tail):
                a.store(queue_pos_word, tail)
                if a.cas(cell, value, full_cell(tail, slot)):
                    a.cas(self._tail, tail, tail + 1)
                    return tail
            elif (value & _FULL and value >> 21 == tail & _POS_MASK) or value == empty_cell(
                tail + self._cap
            ):
                a.cas(self._tail, tail, tail + 1)  # a pusher stopped before moving tail
            elif value & _FULL and value >> 21 == (tail - self._cap) & _POS_MASK:
                return None  # the previous lap's entry is not consumed yet

    def peek(self) -> tuple[int, int] | None:
        """(position, slot) at the head, or None when the ring is empty."""
        a = self._a
        while True:
            head = a.load(self._head)
            value = a.load(self._cells + 8 * (head % self._cap))
            if value & _FULL and value >> 21 == head & _POS_MASK:
                return head, value & _SLOT_MASK
            if value == empty_cell(head):
                return None
            if value == empty_cell(head + self._cap):
                a.cas(self._head, head, head + 1)  # a popper stopped before moving head

    def pop(self, pos: int, slot: int) -> None:
        """Remove the head entry (pos, slot) if it is still there, and move head on."""
        cell = self._cells + 8 * (pos % self._cap)
        self._a.cas(cell, full_cell(pos, slot), empty_cell(pos + self._cap))
        self._a.cas(self._head, pos, pos + 1)

    def length(self) -> int:
        return max(0, self._a.load(self._tail) - self._a.load(self._head))
