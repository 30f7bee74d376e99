"""Aborted reservations, held back until a late write by address can no longer land.

A slot whose addresses were handed to a writer that writes by address (a transfer engine
through `table.buffer_infos()`) may be aborted while that write is still in flight: the
request was cancelled, or its transfer timed out.  Freed at once, the slot could be reserved
again and the late write would land in the next request's row, where nothing can tell it
apart (the engine writes bytes, not generations).  So the owner opens it itself (RESERVED ->
WRITING, `Reservation.close_to_writers`) and keeps it so — owned, visible in `shmslots
inspect`, opened by no producer, taken by no reader — until `window_s` has passed, as
SGLang's own deferred release waits for the prefill side before freeing an index.

The window is the promise that bounds it: no write for a reservation arrives more than
`window_s` after the reservation is aborted.  An owner that dies takes its engine's
registration with it (a remote engine can no longer write there), and the reaper frees its
reservations at once; a writer on the same machine that maps the table itself is not
stopped by that, and must honour the window on its own.
"""

from __future__ import annotations

import time
from collections import deque

from .errors import InvalidArgument, OwnershipError
from .leases import Reservation, WriteSlot


class Quarantine:
    """Slots of transfers aborted by their owner, each freed once `window_s` has passed."""

    def __init__(self, window_s: float) -> None:
        if not (
            isinstance(window_s, (int, float))
            and not isinstance(window_s, bool)
            and 0 <= window_s < float("inf")
        ):
            raise InvalidArgument(
                f"late-write window must be a finite number >= 0 s, got {window_s!r}"
            )
        self.window_s = float(window_s)
        self._held: deque[tuple[float, WriteSlot]] = deque()  # in deadline order
        self._holding: set[tuple[int, int, int]] = set()  # (table, slot, generation) held
        self.released = 0  # slots freed after their window

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, handle: Reservation | WriteSlot) -> None:
        """Keep a slot whose transfer was aborted owned and closed to writers until its window
        has passed (then `sweep` frees it): a reservation is opened here first, a write slot
        (a row refused while a write was landing) is kept as it is.  One that already ended,
        or that its producer opened, is not held; one held already is refused."""
        if not isinstance(handle, (Reservation, WriteSlot)):
            raise InvalidArgument(f"a quarantine holds Reservations, not {handle!r}")
        key = _key(handle)
        if key in self._holding:
            raise InvalidArgument(f"slot {key[1]} (generation {key[2]}) is held already")
        if not handle._open:
            return
        if isinstance(handle, Reservation):
            try:
                handle = handle.close_to_writers()
            except OwnershipError:  # its producer opened it: the slot is the producer's
                return
        self._held.append((time.monotonic() + self.window_s, handle))
        self._holding.add(key)
        self.sweep()

    def sweep(self) -> int:
        """Free every held reservation whose window has passed; returns how many.  Each is
        ended before it is forgotten (`end` may be called again), so an interrupt between
        the two leaves it held, never owned and forgotten."""
        now, freed = time.monotonic(), 0
        while self._held and self._held[0][0] <= now:
            freed += self._end_first()
        self.released += freed
        return freed

    def close(self) -> None:
        """Free everything held now (the owner is closing: its engine stops writing)."""
        while self._held:
            self._end_first()

    def _end_first(self) -> bool:
        """End the slot with the nearest deadline, then forget it; whether it was still open
        (one whose table closed meanwhile ended with it)."""
        ws = self._held[0][1]
        was_open = ws._open
        ws.end()
        self._held.popleft()
        self._holding.discard(_key(ws))
        return was_open


def _key(handle: Reservation | WriteSlot) -> tuple[int, int, int]:
    """What a held slot is known by: one quarantine may serve several tables, and a table
    made anew under a name keeps none of the old one's slots (the held handle keeps its
    table object, so its id is not reused meanwhile)."""
    return id(handle._table), handle.slot, handle.generation
