"""Aborted reservations, held back until a late write by address can no longer land.

A slot whose addresses were handed to a writer that writes by address (a transfer engine
through `table.buffer_infos()`) may be aborted while that write is still in flight: the
request was cancelled, or its transfer timed out.  Freed at once, the slot could be reserved
again and the late write would land in the next request's row, where nothing can tell it
apart (the engine writes bytes, not generations).  So the owner keeps it RESERVED — owned,
visible in `shmslots inspect`, taken by no one — until `window_s` has passed, as SGLang's
own deferred release waits for the prefill side before freeing an index.

The window is the promise that bounds it: no write for a reservation arrives more than
`window_s` after the reservation is aborted.  An owner that dies takes its engine's
registration with it (a remote engine can no longer write there), and the reaper frees its
reservations at once; a writer on the same machine that maps the table itself is not
stopped by that, and must honour the window on its own.
"""

from __future__ import annotations

import time
from collections import deque

from .errors import InvalidArgument
from .leases import Reservation


class Quarantine:
    """Reservations aborted by their owner, each freed once `window_s` has passed."""

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
        self._held: deque[tuple[float, Reservation]] = deque()  # in deadline order
        self._holding: set[tuple[int, int]] = set()  # (slot, generation) of each held
        self.released = 0  # reservations freed after their window

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, reservation: Reservation) -> None:
        """Keep an aborted reservation owned until its window has passed (then `sweep` frees
        it).  A reservation that already ended is not held; one held already is refused."""
        if not isinstance(reservation, Reservation):
            raise InvalidArgument(f"a quarantine holds Reservations, not {reservation!r}")
        if not reservation._open:
            return
        key = (reservation.slot, reservation.generation)
        if key in self._holding:
            raise InvalidArgument(f"slot {key[0]} (generation {key[1]}) is held already")
        self._held.append((time.monotonic() + self.window_s, reservation))
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
        """End the reservation with the nearest deadline, then forget it; whether it was
        still open (one whose table closed meanwhile ended with it)."""
        reservation = self._held[0][1]
        was_open = reservation._open
        reservation.end()
        self._held.popleft()
        self._holding.discard((reservation.slot, reservation.generation))
        return was_open
