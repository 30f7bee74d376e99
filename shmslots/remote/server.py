"""The owner side: grant rows to remote writers, publish them when they commit.

Remote writes never touch table rows.  Each slot has two landing cells in a
private buffer registered once with the engine, picked by generation parity.
A commit copies the cell into the row and publishes it only if the *copy*
carries the reserved generation and its checksum verifies.  So a write that
arrives late — its grant aborted or expired, the slot long reused — lands in
a cell no live grant of that generation reads, and its commit finds no
pending grant: it is discarded and counted, never delivered.  (A direct
write into rows could land in a row that a reader already holds.)
"""

from __future__ import annotations

import mmap
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import InvalidArgument, OwnershipError, RowRejected, SchemaError, TableClosed
from ..leases import Reservation
from ..table import SlotTable
from .engine import Engine, address_of
from .grant import COMMIT, Grant, parse_commit_key


@dataclass
class RemoteStats:
    granted: int = 0
    committed: int = 0  # published into the table
    aborted: int = 0  # by the owner (request cancelled, or the server closed): slot freed
    expired: int = 0  # no commit within commit_timeout_s: slot freed
    late: int = 0  # well-formed commits naming no pending grant: discarded
    rejected: int = 0  # commits whose copied row failed generation or checksum: not delivered
    malformed: int = 0  # commit entries that are not "slot:generation:nonce"


@dataclass
class Settled:
    """Grants that ended since the last poll, by request tag.

    Every grant ends exactly once: published, rejected or expired here, or
    aborted by `abort()`.  A rejected or expired request needs a new grant.
    """

    published: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    expired: list[int] = field(default_factory=list)

    def extend(self, other: Settled) -> None:
        self.published += other.published
        self.rejected += other.rejected
        self.expired += other.expired


@dataclass
class _Pending:
    reservation: Reservation
    deadline: float


class RemoteServer:
    """Serves remote writers of one table's rows through one engine (one server per engine)."""

    def __init__(self, table: SlotTable, engine: Engine, *, commit_timeout_s: float = 10.0) -> None:
        schema = table.schema
        if schema.has_handles:
            raise SchemaError("remote writers can fill inline fields only; this schema has handles")
        if engine.served_by is not None:
            raise InvalidArgument("this engine already serves a table: one RemoteServer per Engine")
        self.table = table
        self.engine = engine
        self._timeout_s = commit_timeout_s
        self.stats = RemoteStats()
        self._row_size = schema.row_size
        self._fingerprint = schema.fingerprint
        self._landing = mmap.mmap(-1, 2 * table.slots * self._row_size)
        self._base = address_of(self._landing)
        try:
            engine.register(self._base, len(self._landing))
        except BaseException:
            self._landing.close()
            raise
        engine.served_by = self
        self._landing_view = memoryview(self._landing)
        self._pending: dict[str, _Pending] = {}  # commit key -> grant, in deadline order
        self._inbox: deque[str] = deque()  # commit keys received, not yet settled
        self._settled = Settled()  # kept here until a poll returns it, even if one raised
        self._closed = False

    @property
    def commit_timeout_s(self) -> float:
        return self._timeout_s

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _cell(self, slot: int, generation: int) -> int:
        return (2 * slot + (generation & 1)) * self._row_size

    def grant(self, tag: int = 0, timeout: float = 1.0) -> Grant:
        """Reserve a slot for a remote writer; send `grant.encode()` to it by any channel."""
        if self._closed:
            raise TableClosed("this RemoteServer is closed")
        reservation = self.table.reserve(tag, timeout)
        grant = Grant(
            self.engine.session,
            self._base + self._cell(reservation.slot, reservation.generation),
            self._row_size,
            reservation.slot,
            reservation.generation,
            tag,
            self._fingerprint,
            secrets.randbits(64),
        )
        self._pending[grant.commit_key] = _Pending(reservation, time.monotonic() + self._timeout_s)
        self.stats.granted += 1
        return grant

    def abort(self, grant: Grant) -> bool:
        """Cancel a granted row (request aborted); False if it already ended."""
        pending = self._pending.pop(grant.commit_key, None)
        if pending is None:
            return False
        pending.reservation.end()
        self.stats.aborted += 1
        return True

    def poll(self) -> Settled:
        """Publish committed rows and expire overdue grants; returns what ended."""
        if self._closed:
            raise TableClosed("this RemoteServer is closed")
        try:
            for message in self.engine.notifies(COMMIT):
                self._inbox.extend(message.split(";"))
            while self._inbox:
                self._settle(self._inbox.popleft())
        finally:
            self._expire(time.monotonic())
        settled, self._settled = self._settled, Settled()
        return settled

    def _settle(self, key: str) -> None:
        pending = self._pending.get(key)
        if pending is None:
            if parse_commit_key(key) is None:
                self.stats.malformed += 1
            else:
                self.stats.late += 1
            return
        reservation = pending.reservation
        published = False
        try:
            published = self._commit(reservation)
        finally:  # whatever happened, this grant is over and its slot is not left owned
            del self._pending[key]
            reservation.end()
            if published:
                self.stats.committed += 1
                self._settled.published.append(reservation.tag)
            else:
                self.stats.rejected += 1
                self._settled.rejected.append(reservation.tag)

    def _commit(self, reservation: Reservation) -> bool:
        slot, generation = reservation.slot, reservation.generation
        off = self._cell(slot, generation)
        try:
            ws = self.table.open_reserved(slot, generation)
        except OwnershipError:  # reclaimed behind our back: only by corruption or a reaper
            return False
        with ws:  # leaving the block unpublished aborts
            try:
                ws.write_packed(self._landing_view[off : off + self._row_size])
            except RowRejected:
                return False
            ws.publish()
        return True

    def _expire(self, now: float) -> None:
        while self._pending:
            key, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                return  # the rest were granted later, with the same timeout
            del self._pending[key]
            pending.reservation.end()
            self.stats.expired += 1
            self._settled.expired.append(pending.reservation.tag)

    def close(self) -> None:
        """Abort every pending grant and stop accepting writes into the landing area."""
        if self._closed:
            return
        self._closed = True
        try:
            while self._pending:
                _, pending = self._pending.popitem()
                self.stats.aborted += 1
                pending.reservation.end()
        finally:
            self.engine.served_by = None
            self.engine.unregister(self._base)
            self._landing_view.release()
            self._landing.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
