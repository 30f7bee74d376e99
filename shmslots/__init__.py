"""shmslots: per-request records handed between processes through POSIX shared memory.

A request owns its slot from claim until its row is consumed or aborted;
then the slot is free at once.  See README.md for the contract.
"""

from .errors import (
    CorruptTable,
    IncompatibleTable,
    InvalidSlot,
    LeakedViewError,
    LeakedViewWarning,
    OwnershipError,
    RegistryFull,
    RowRejected,
    SchemaError,
    ShmSlotsError,
    SlotsExhausted,
    StaleLeaseError,
    TableExists,
    TableNotFound,
    TablePermissionError,
)
from .leases import Lease, Reservation, WriteSlot
from .participants import Participant
from .schema import Field
from .segment import OutOfSharedMemory
from .states import State
from .table import SlotAge, SlotTable, Stats

__all__ = [
    "CorruptTable",
    "Field",
    "IncompatibleTable",
    "InvalidSlot",
    "LeakedViewError",
    "LeakedViewWarning",
    "Lease",
    "OutOfSharedMemory",
    "OwnershipError",
    "Participant",
    "RegistryFull",
    "Reservation",
    "RowRejected",
    "SchemaError",
    "ShmSlotsError",
    "SlotAge",
    "SlotTable",
    "SlotsExhausted",
    "StaleLeaseError",
    "State",
    "Stats",
    "TableExists",
    "TableNotFound",
    "TablePermissionError",
    "WriteSlot",
]
