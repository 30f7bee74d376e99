"""One exception hierarchy, so callers can catch everything shmslots raises."""

from __future__ import annotations


class ShmSlotsError(Exception):
    """Base of every error shmslots raises."""


class TableNotFound(ShmSlotsError, FileNotFoundError):
    """No shared-memory object of that name exists."""


class TableExists(ShmSlotsError, FileExistsError):
    """create() found an object of that name already there."""


class InvalidArgument(ShmSlotsError, ValueError):
    """An argument outside what the call accepts: a table name, a tag, a slot count, a size."""


class TableClosed(ShmSlotsError, ValueError):
    """The table (or remote server) was closed, or inherited through fork(): attach again."""


class IncompatibleTable(ShmSlotsError):
    """The segment is not a table this version can use (magic, version, uid, size)."""


class TableNotReady(IncompatibleTable):
    """The object exists but its creator has not sized or initialised it yet (or died doing
    so): `attach(timeout=...)` waits through this."""


class CorruptTable(IncompatibleTable):
    """The segment claims to be a table but its contents are inconsistent."""


class TablePermissionError(IncompatibleTable, PermissionError):
    """The segment belongs to another user or cannot be opened."""


class SlotsExhausted(ShmSlotsError):
    """No slot (or queue place) became free before the timeout."""

    def __init__(self, message: str, occupancy: dict[str, int]) -> None:
        super().__init__(f"{message}; occupancy {occupancy}")
        self.occupancy = occupancy


class InvalidSlot(ShmSlotsError, IndexError):
    """A slot id outside the table."""


class RegistryFull(ShmSlotsError):
    """Every participant entry of the table is taken by a live process."""


class OwnershipError(ShmSlotsError):
    """A transition was attempted by a process that does not own the slot in that state."""


class StaleLeaseError(OwnershipError):
    """The lease or write slot was already released, aborted or published."""


class LeakedViewError(ShmSlotsError):
    """A field view is still referenced while its slot is being released (strict mode)."""


class RowsLeftWarning(UserWarning):
    """The creator unlinked a table while rows were still queued or held: attaches after it
    cannot reach them."""


class LeakedViewWarning(UserWarning):
    """A field view is still referenced while its slot is released (default mode)."""


class SchemaError(ShmSlotsError, ValueError):
    """A field, dtype, shape or value does not match the table's schema."""


class RowRejected(ShmSlotsError):
    """A row written elsewhere (by address, by a remote writer) fails the writer's checksum."""
