"""The owner side: grant rows to remote writers, publish them in place when they commit.

The table's columns are registered with the engine once, and a grant names the reserved
slot's items in them: the writer writes each field straight into the row, as a transfer
engine fills SGLang's metadata buffers, and the commit (which carries the checksum of what
the writer sent) publishes the row where it lies.  No second area sized to the table, no
copy per row: the bytes a reader takes are the bytes the engine wrote.  The row is checked
before it is opened: one that does not hash to the writer's checksum is rejected, never
delivered.

A write by address cannot be recalled, so a grant that ends unpublished — aborted by the
owner, expired without a commit, or rejected (torn, or not all of it landed yet) — may still
receive bytes.  Freed at once, its slot could be granted again, and those bytes would land
in the next request's row, perhaps while a reader holds it: nothing could tell them apart
(the engine writes bytes, not generations).  So the slot stays QUARANTINED (`Quarantine`)
for `late_write_window_s` before it is freed, and a commit naming no pending grant is
discarded.  The window is the promise the guarantee rests on: no write for a grant arrives
more than `late_write_window_s` after the grant ended.  A writer's engine gives up on a
stalled write after its transfer timeout, but the bytes may still land after that, so the
window must exceed it (NIXL's `transfer_timeout_s`, 5 s by default; Mooncake's, about a
minute, is not settable here).  (The landing cells this replaces caught late writes by
generation, at the price of a copy per row and a second area.)
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import InvalidArgument, OwnershipError, RowRejected, TableClosed
from ..leases import Reservation, WriteSlot
from ..quarantine import Quarantine
from ..table import SlotTable
from .engine import Engine
from .grant import COMMIT, Grant, parse_commit, require_inline, row_format


@dataclass
class RemoteStats:
    granted: int = 0
    committed: int = 0  # published into the table
    aborted: int = 0  # by the owner (request cancelled, or the server closed)
    expired: int = 0  # no commit within commit_timeout_s
    late: int = 0  # well-formed commits naming no pending grant: discarded
    rejected: int = 0  # commits whose row did not hash to the writer's checksum: not delivered
    malformed: int = 0  # commit entries that are not "slot:generation:nonce:checksum"
    foreign: int = 0  # notifies under another name than the commits': dropped
    quarantined: int = 0  # slots of aborted, expired or rejected grants held back for late writes


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
    """Serves remote writers of one table's rows through one engine (one server per engine).

    Close it before its table (a `with` nesting does): the engine writes into the table's
    mapping for as long as the server has it registered, so the mapping is kept until then.
    """

    def __init__(
        self,
        table: SlotTable,
        engine: Engine,
        *,
        commit_timeout_s: float = 10.0,
        late_write_window_s: float = 10.0,
    ) -> None:
        schema = table.schema
        require_inline(schema)
        if engine.served_by is not None:
            raise InvalidArgument("this engine already serves a table: one RemoteServer per Engine")
        self._quarantine = Quarantine(late_write_window_s)  # checks the window first
        ptrs, data_lens, item_lens = table.buffer_infos()
        self.table = table
        self.engine = engine
        self._timeout_s = commit_timeout_s
        self.stats = RemoteStats()
        self._fingerprint = row_format(schema)
        self._ptrs, self._item_lens = tuple(ptrs), tuple(item_lens)
        self._lengths = tuple(fs.field.nbytes for fs in schema.slots.values())
        # the columns lie back to back: one registration covers every row
        self._base = ptrs[0]
        engine.register(self._base, ptrs[-1] + data_lens[-1] - self._base)
        engine.served_by = self
        engine.listen(COMMIT)
        self._dropped_before = engine.dropped
        # An export of the table's mapping while the engine may write into it: a table
        # closed first keeps its mapping until this is released (segment.close() says so).
        self._mapping = memoryview(table._segment.mm)
        self._pending: dict[str, _Pending] = {}  # commit key -> grant, in deadline order
        self._inbox: deque[str] = deque()  # commit entries received, not yet settled
        self._settled = Settled()  # kept here until a poll returns it, even if one raised
        self._closed = False

    def contact(self) -> bytes:
        """What a writer must `connect()` before it writes this server's grants (its engine's
        contact, taken now that the table's columns are registered)."""
        if self._closed:
            raise TableClosed("this RemoteServer is closed")
        return self.engine.contact()

    @property
    def commit_timeout_s(self) -> float:
        return self._timeout_s

    @property
    def late_write_window_s(self) -> float:
        return self._quarantine.window_s

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def held(self) -> int:
        """Slots of ended grants held back now, until no late write can land in them."""
        return len(self._quarantine)

    def grant(self, tag: int = 0, timeout: float = 1.0) -> Grant:
        """Reserve a slot for a remote writer; send `grant.encode()` to it by any channel."""
        if self._closed:
            raise TableClosed("this RemoteServer is closed")
        self._quarantine.sweep()
        reservation = self.table.reserve(tag, timeout)
        grant = Grant(
            self.engine.session,
            self._ptrs,
            self._item_lens,
            self._lengths,
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
        """Cancel a granted row (request aborted); False if it already ended.  Its slot is
        held back: the writer may still be writing it."""
        pending = self._pending.pop(grant.commit_key, None)
        if pending is None:
            return False
        self._hold(pending.reservation)
        self.stats.aborted += 1
        return True

    def poll(self) -> Settled:
        """Publish committed rows, expire overdue grants, free slots whose window has
        passed; returns what ended."""
        if self._closed:
            raise TableClosed("this RemoteServer is closed")
        if self.table.closed:
            raise TableClosed(f"table {self.table.name!r} was closed under this RemoteServer")
        try:
            for message in self.engine.notifies(COMMIT):
                self._inbox.extend(message.split(";"))
            self.stats.foreign = self.engine.dropped - self._dropped_before
            while self._inbox:
                self._settle(self._inbox.popleft())
        finally:
            self._expire(time.monotonic())
            self._quarantine.sweep()
        settled, self._settled = self._settled, Settled()
        return settled

    def _settle(self, entry: str) -> None:
        parsed = parse_commit(entry)
        if parsed is None:
            self.stats.malformed += 1
            return
        key, checksum = parsed
        pending = self._pending.get(key)
        if pending is None:
            self.stats.late += 1
            return
        reservation = pending.reservation
        matched = published = False
        try:  # checked before the row is opened, so that a refused one can stay reserved
            matched = self.table._rows.checksum(reservation.slot) == checksum
            if matched:
                published = self._publish(reservation, checksum)
        finally:  # whatever happened, this grant is over: published, held back or freed
            del self._pending[key]
            if published:
                self.stats.committed += 1
                self._settled.published.append(reservation.tag)
            else:
                self.stats.rejected += 1
                self._settled.rejected.append(reservation.tag)
                if matched:  # ours matched: refused by the table's check only if still landing
                    reservation.end()
                else:  # torn, or its commit outran its bytes: the rest may still land
                    self._hold(reservation)

    def _publish(self, reservation: Reservation, checksum: int) -> bool:
        try:
            ws = self.table.open_reserved(reservation.slot, reservation.generation)
        except OwnershipError:  # reclaimed behind our back: only by corruption or a reaper
            return False
        held = False
        try:
            try:  # the table's own check; the row changed since ours only if a write is landing
                ws.written_in_place(checksum)
            except RowRejected:  # so the rest of it may still land: held back, not freed
                self._hold(ws)
                held = True
                return False
            ws.publish()
            return True
        finally:
            if not held:
                ws.end()  # unpublished: aborted; published: nothing left to do

    def _hold(self, handle: Reservation | WriteSlot) -> None:
        if self._quarantine.hold(handle):
            self.stats.quarantined += 1

    def _expire(self, now: float) -> None:
        while self._pending:
            key, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                return  # the rest were granted later, with the same timeout
            del self._pending[key]
            self._hold(pending.reservation)
            self.stats.expired += 1
            self._settled.expired.append(pending.reservation.tag)

    def close(self) -> None:
        """Stop the engine writing into the table, then free every slot still owned: pending
        grants are aborted, held-back slots freed (no write can land in them any more).

        An engine that does not refuse writes outside its registrations (NIXL over UCX's
        TCP) is closed here too: only that ends its peers' writes.
        """
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.engine.unregister(self._base)
            finally:
                if not self.engine.refuses_unregistered:
                    self.engine.close()
        finally:
            self.engine.served_by = None
            try:
                while self._pending:
                    _, pending = self._pending.popitem()
                    self.stats.aborted += 1
                    pending.reservation.end()
                self._quarantine.close()
            finally:
                self._mapping.release()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
