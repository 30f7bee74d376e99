"""Type-state handles: what you may do with a slot depends on how you got it.

* `WriteSlot` (from `claim`/`open_reserved`): write, publish or abort.
* `Reservation` (from `reserve`): hand (slot, generation) to a producer, or abort.
* `Lease` (from `take`/`poll`): view, copy, verify, then release or abort.

Each handle is single-use: after publish/release/abort every method raises
`StaleLeaseError`, so a view cannot outlive ownership by accident.
"""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from .errors import LeakedViewError, LeakedViewWarning, SchemaError, StaleLeaseError
from .states import Event, State

if TYPE_CHECKING:
    from .table import SlotTable

_WRITING = int(State.WRITING)
_RESERVED = int(State.RESERVED)
_HELD = int(State.HELD)
_ABORT = int(Event.ABORT)
_RELEASE = int(Event.RELEASE)


class _Handle:
    __slots__ = ("_open", "_table", "_viewed", "generation", "slot", "tag")

    def __init__(self, table: SlotTable, slot: int, generation: int, tag: int) -> None:
        self._table = table
        self.slot = slot
        self.generation = generation
        self.tag = tag
        self._open = True
        self._viewed: set[str] = set()

    def _check_open(self, action: str) -> None:
        if not self._open:
            raise StaleLeaseError(
                f"cannot {action}: slot {self.slot} generation {self.generation} "
                f"was already handed back by this {type(self).__name__}"
            )

    def _check_views(self, action: str) -> None:
        """Refuse (strict) or report (default) views still alive past ownership."""
        if not self._viewed:
            return
        leaked = self._table._rows.views(self.slot).leaked(self._viewed)
        if not leaked:
            return
        message = (
            f"{action} of slot {self.slot} while views of {', '.join(leaked)} are still "
            "referenced; they will see the next occupant's data (use copy() to keep data)"
        )
        if self._table.strict:
            raise LeakedViewError(message)
        self._table._own.count("leaked_views", len(leaked))
        warnings.warn(message, LeakedViewWarning, stacklevel=3)

    def __repr__(self) -> str:
        status = "open" if self._open else "closed"
        kind = type(self).__name__
        return f"<{kind} slot={self.slot} gen={self.generation} tag={self.tag} {status}>"


class WriteSlot(_Handle):
    """A slot this process is filling; every field must be written before publish."""

    __slots__ = ("_written",)

    def __init__(self, table: SlotTable, slot: int, generation: int, tag: int) -> None:
        super().__init__(table, slot, generation, tag)
        self._written: set[str] = set()

    def write(self, **fields: Any) -> WriteSlot:
        """Copy values into the row; all are checked before any byte changes."""
        self._check_open("write")
        rows = self._table._rows
        rows.write(self.slot, rows.prepare(fields))
        self._written.update(fields)
        return self

    def view(self, name: str) -> torch.Tensor:
        """The field's row memory, to fill in place (zero copy); counts as written."""
        self._check_open("view")
        try:
            tensor = self._table._rows.views(self.slot).tensors[name]
        except KeyError:
            raise SchemaError(f"no field {name!r}") from None
        self._written.add(name)
        self._viewed.add(name)
        return tensor

    def publish(self, timeout: float = 1.0) -> None:
        """Seal the row (generation, checksum), queue it and make it READY."""
        self._check_open("publish")
        missing = self._table._rows.schema.slots.keys() - self._written
        if missing:
            raise SchemaError(
                f"slot {self.slot}: fields {sorted(missing)} were never written; "
                "publishing would hand out the previous occupant's bytes"
            )
        self._check_views("publish")
        table = self._table
        table._rows.seal(self.slot, self.generation)
        table._own.publish(self.slot, self.generation, timeout)
        self._open = False

    def abort(self) -> None:
        self._check_open("abort")
        self._table._own.free(self.slot, self.generation, _WRITING, _ABORT)
        self._table._own.count("aborts")
        self._open = False

    def __enter__(self) -> WriteSlot:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the block without publishing aborts: nothing half-written is delivered."""
        if self._open:
            self.abort()


class Reservation(_Handle):
    """A FREE slot booked by a consumer for a producer to open by (slot, generation)."""

    __slots__ = ()

    def abort(self) -> None:
        self._check_open("abort")
        self._table._own.free(self.slot, self.generation, _RESERVED, _ABORT)
        self._table._own.count("aborts")
        self._open = False


class Lease(_Handle):
    """A READY slot taken by this process; views are valid until release or abort."""

    __slots__ = ("deliveries",)

    def __init__(
        self, table: SlotTable, slot: int, generation: int, tag: int, deliveries: int
    ) -> None:
        super().__init__(table, slot, generation, tag)
        self.deliveries = deliveries

    def view(self, name: str) -> torch.Tensor:
        """Zero-copy tensor over the field; valid only while the lease is held."""
        self._check_open("view")
        try:
            tensor = self._table._rows.views(self.slot).tensors[name]
        except KeyError:
            raise SchemaError(f"no field {name!r}") from None
        self._viewed.add(name)
        return tensor

    def copy(self, name: str) -> torch.Tensor:
        """An owned copy of the field that outlives the lease."""
        self._check_open("copy")
        try:
            return self._table._rows.views(self.slot).tensors[name].clone()
        except KeyError:
            raise SchemaError(f"no field {name!r}") from None

    def verify(self) -> bool:
        """True if the row is still exactly what was published under this generation."""
        self._check_open("verify")
        return self._table._row_intact(self.slot, self.generation)

    def release(self) -> None:
        """End the lease after consumption; the slot is FREE at once."""
        self._end(_RELEASE, "releases", "release")

    def abort(self) -> None:
        """End the lease without consuming (request aborted); the slot is FREE at once."""
        self._end(_ABORT, "aborts", "abort")

    def _end(self, event: int, counter: str, action: str) -> None:
        self._check_open(action)
        self._check_views(action)
        own = self._table._own
        own.free(self.slot, self.generation, _HELD, event)
        own.count(counter)
        self._open = False

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._open:
            if et is None:
                self.release()
            else:
                self.abort()
