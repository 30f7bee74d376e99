"""shmslots: per-request records handed between processes through POSIX shared memory.

A request owns its slot from claim until its row is consumed or aborted;
then the slot is free at once.  See README.md and docs/ for the contract.

The names that need torch (`SlotTable` and its handles) are imported on first
use (PEP 562 module `__getattr__`), the rest at once.  Importing any submodule
runs this file first, and the `shmslots` command (`shmslots.cli`) must start
without loading torch (about 1.5 s); `from shmslots import SlotTable` and
`shmslots.SlotTable` work as ever, and load torch when they are first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._core import row_hash
from .errors import (
    CorruptTable,
    IncompatibleTable,
    InvalidArgument,
    InvalidSlot,
    LeakedViewError,
    LeakedViewWarning,
    OwnershipError,
    RegistryFull,
    RowRejected,
    RowsLeftWarning,
    SchemaError,
    ShmSlotsError,
    SlotsExhausted,
    StaleLeaseError,
    TableClosed,
    TableExists,
    TableNotFound,
    TableNotReady,
    TablePermissionError,
)
from .participants import Participant
from .schema import Field
from .segment import OutOfSharedMemory
from .states import State

if TYPE_CHECKING:
    from .leases import Lease, Quarantined, Reservation, WriteSlot
    from .quarantine import Quarantine
    from .table import SlotAge, SlotTable, Stats

# name -> the submodule that defines it; these import torch.
_LAZY = {
    "Lease": "leases",
    "Reservation": "leases",
    "WriteSlot": "leases",
    "Quarantine": "quarantine",
    "Quarantined": "leases",
    "SlotAge": "table",
    "SlotTable": "table",
    "Stats": "table",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CorruptTable",
    "Field",
    "IncompatibleTable",
    "InvalidArgument",
    "InvalidSlot",
    "LeakedViewError",
    "LeakedViewWarning",
    "Lease",
    "OutOfSharedMemory",
    "OwnershipError",
    "Participant",
    "Quarantine",
    "Quarantined",
    "RegistryFull",
    "Reservation",
    "RowRejected",
    "RowsLeftWarning",
    "SchemaError",
    "ShmSlotsError",
    "SlotAge",
    "SlotTable",
    "SlotsExhausted",
    "StaleLeaseError",
    "State",
    "Stats",
    "TableClosed",
    "TableExists",
    "TableNotFound",
    "TableNotReady",
    "TablePermissionError",
    "WriteSlot",
    "row_hash",
]
