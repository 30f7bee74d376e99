"""The owner side: grant rows to remote writers, publish them when they commit.

Remote writes never touch table rows.  Each slot has two landing cells in a
private buffer registered once with the engine, picked by generation parity.
A commit copies the cell into the row and publishes it only if the *copy*
carries the reserved generation and its checksum verifies.  So a write that
arrives late — its reservation aborted or expired, the slot long reused —
lands in a cell no live reservation of that generation reads, and its commit
finds no pending grant: it is discarded and counted, never delivered.  (A
direct write into rows could land in a row that a reader already holds.)
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field

from ..errors import OwnershipError, RowRejected, SchemaError
from ..leases import Reservation
from ..table import SlotTable
from .engine import Engine, address_of
from .grant import Grant


@dataclass
class RemoteStats:
    granted: int = 0
    committed: int = 0  # published into the table
    aborted: int = 0  # by the owner (request cancelled): slot freed at once
    expired: int = 0  # no commit within commit_timeout_s: slot freed
    late: int = 0  # commits for grants already aborted, expired or committed: discarded
    rejected: int = 0  # committed rows whose copy failed generation or checksum: not delivered
    malformed: int = 0  # commit entries that could not be parsed


@dataclass
class Settled:
    """What one poll decided, by request tag: the owner learns every grant's fate."""

    published: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)  # the writer must send it again
    expired: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.published) + len(self.rejected) + len(self.expired)

    def extend(self, other: Settled) -> None:
        self.published += other.published
        self.rejected += other.rejected
        self.expired += other.expired


@dataclass
class _Pending:
    reservation: Reservation
    deadline: float


class RemoteServer:
    """Serves remote writers of one table's rows through one engine."""

    def __init__(self, table: SlotTable, engine: Engine, *, commit_timeout_s: float = 10.0) -> None:
        schema = table.schema
        if schema.has_handles:
            raise SchemaError("remote writers can fill inline fields only; this schema has handles")
        self.table = table
        self.engine = engine
        self.commit_timeout_s = commit_timeout_s
        self.stats = RemoteStats()
        self._row_size = schema.row_size
        self._fingerprint = schema.fingerprint
        self._landing = mmap.mmap(-1, 2 * table.slots * self._row_size)
        self._landing_view = memoryview(self._landing)
        self._base = address_of(self._landing)
        engine.register(self._base, len(self._landing))
        self._pending: dict[str, _Pending] = {}  # commit key -> grant, in deadline order

    def _cell(self, slot: int, generation: int) -> int:
        return (2 * slot + (generation & 1)) * self._row_size

    def grant(self, tag: int = 0, timeout: float = 1.0) -> Grant:
        """Reserve a slot for a remote writer; send the grant to it by any channel."""
        reservation = self.table.reserve(tag, timeout)
        grant = Grant(
            self.engine.session,
            self._base + self._cell(reservation.slot, reservation.generation),
            self._row_size,
            reservation.slot,
            reservation.generation,
            tag,
            self._fingerprint,
        )
        self._pending[grant.commit_key] = _Pending(
            reservation, time.monotonic() + self.commit_timeout_s
        )
        self.stats.granted += 1
        return grant

    def abort(self, grant: Grant) -> bool:
        """Cancel a granted row (request aborted); False if it already ended."""
        pending = self._pending.pop(grant.commit_key, None)
        if pending is None:
            return False
        pending.reservation.abort()
        self.stats.aborted += 1
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)

    def poll(self) -> Settled:
        """Publish committed rows and expire overdue grants."""
        settled = Settled()
        for message in self.engine.commits():
            for key in message.split(";"):
                pending = self._pending.pop(key, None)
                if pending is not None:
                    tag = pending.reservation.tag
                    fate = (
                        settled.published if self._commit(pending.reservation) else settled.rejected
                    )
                    fate.append(tag)
                elif _is_key(key):
                    self.stats.late += 1
                else:
                    self.stats.malformed += 1
        self._expire(time.monotonic(), settled.expired)
        return settled

    def _commit(self, reservation: Reservation) -> bool:
        slot, generation = reservation.slot, reservation.generation
        try:
            ws = self.table.open_reserved(slot, generation)
        except OwnershipError:  # reclaimed behind our back (only by corruption or a reaper)
            self.stats.rejected += 1
            return False
        off = self._cell(slot, generation)
        try:
            ws.write_packed(self._landing_view[off : off + self._row_size])
        except RowRejected:
            ws.abort()
            self.stats.rejected += 1
            return False
        ws.publish()
        self.stats.committed += 1
        return True

    def _expire(self, now: float, expired: list[int]) -> None:
        for key, pending in list(self._pending.items()):
            if pending.deadline > now:
                break  # the rest were granted later
            del self._pending[key]
            pending.reservation.abort()
            self.stats.expired += 1
            expired.append(pending.reservation.tag)

    def close(self) -> None:
        """Abort every pending grant and stop accepting writes into the landing area."""
        for pending in self._pending.values():
            if not self.table.closed:
                pending.reservation.abort()
            self.stats.aborted += 1
        self._pending.clear()
        self.engine.unregister(self._base)
        self._landing_view.release()
        self._landing.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_key(key: str) -> bool:
    slot, _, generation = key.partition(":")
    return slot.isdigit() and generation.isdigit()
