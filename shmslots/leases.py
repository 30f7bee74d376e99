"""Type-state handles: what you may do with a slot depends on how you got it.

* `WriteSlot` (from `claim`/`open_reserved`): write, publish or abort.
* `Reservation` (from `reserve`): hand (slot, generation) to a producer, or abort.
* `Lease` (from `take`/`poll`): view, copy, verify, then release or abort.
* `Quarantined` (from a reservation's or write slot's `quarantine`): an aborted transfer's
  slot, closed to everyone until its late-write window ends.

Each handle is single-use: after publish/release/abort every method raises
`StaleLeaseError`, so a view cannot outlive ownership by accident.

The per-request steps (write, publish, abort; view, release) run compiled in
csrc/leases.c for the plain case; anything else, every error included, comes to
the `_..._slow` and `_end` methods here before anything has changed.  Those
end with `_hand_back`, one compiled call that makes the transition and closes
the handle together.  A handle collected while it still owns its slot hands
it back (compiled, with a ResourceWarning, as Python does for a file).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch

from ._core import (
    STEP_QUEUE_FULL,
    STEP_REFUSED,
    HandleBase,
    HandleCore,
    LeaseCore,
    WatchedTensors,
    WriteSlotCore,
)
from .errors import (
    InvalidArgument,
    LeakedViewError,
    LeakedViewWarning,
    RowRejected,
    SchemaError,
    SlotsExhausted,
    StaleLeaseError,
)
from .refs import Pin
from .rows import check_out
from .schema import contiguous_strides
from .states import Event, State

if TYPE_CHECKING:
    from ._core import Arena
    from .ownership import Ownership
    from .parts import TableParts
    from .rows import Rows

_WRITING = int(State.WRITING)
_RESERVED = int(State.RESERVED)
_HELD = int(State.HELD)
_QUARANTINED = int(State.QUARANTINED)
_ABORT = int(Event.ABORT)
_RELEASE = int(Event.RELEASE)
_PUBLISH = int(Event.PUBLISH)
_REDELIVER = int(Event.REDELIVER)


def handle_core(
    own: Ownership,
    rows: Rows,
    ref_place: tuple[int, int, str],
    arena: Arena | None,
    strict: bool,
    redeliver_dropped: bool,
    idle_every_s: float,
) -> HandleCore:
    """The compiled side of one table's handles, bound to its hot path and rows."""
    if rows._codec is None:
        raise ValueError("handles need writable rows")
    return HandleCore(
        own.hot,
        rows._codec,
        rows._views,  # the per-slot cache that rows.views fills
        WriteSlot,
        Lease,
        Reservation,
        nfields=len(rows.schema.slots),
        plain_claim=not rows.schema.has_refs,
        strict=strict,
        redeliver_dropped=redeliver_dropped,
        idle_every_ns=int(idle_every_s * 1e9),
        ref_place=ref_place,
        arena=arena,
        pin=Pin,
    )


def check_by_address(rows: Rows) -> None:
    """Rows a writer fills by address (`buffer_infos()`) hold no ref fields: a ref names
    pages that only a writer through `write` or `alloc` pins."""
    if rows.schema.has_refs:
        raise SchemaError("ref fields cannot be written by address")


def _caller_level() -> int:
    """The stacklevel that makes a warning name the first frame outside this module."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _changed_in_place(watched: WatchedTensors, names: set[str], parts: TableParts) -> list[str]:
    """Names whose view no longer has the shape, strides and plain state it was made with."""
    fields = parts.rows.schema.slots
    changed = []
    for name in names:
        view, shape = watched.tensors[name], fields[name].field.fixed_shape
        if (
            type(view) is not torch.Tensor
            or view.__dict__  # first: methods set on the view are not called
            or view.dtype != fields[name].field.torch_dtype
            or view.shape != shape
            or view.stride() != contiguous_strides(shape)
            or view.storage_offset()
            or view.requires_grad
            or view.grad is not None
            or view.is_neg()
            or view.is_conj()
        ):
            changed.append(name)
    return sorted(changed)


class _Handle(HandleBase):
    """What every handle checks; its table's parts, slot, generation and tag live in
    HandleBase."""

    __slots__ = ()

    def _still_mine(self, state: int) -> bool:
        """False when the transition already happened but an interrupt hit before we noted it."""
        return self._parts.own.owns(self.slot, self.generation, state)

    def _check_open(self, action: str) -> None:
        if self._parts.closed:
            raise StaleLeaseError(
                f"cannot {action}: table {self._parts.name!r} was closed, and with it this "
                f"{type(self).__name__} of slot {self.slot}"
            )
        if not self._open:
            raise StaleLeaseError(
                f"cannot {action}: slot {self.slot} generation {self.generation} "
                f"was already handed back by this {type(self).__name__}"
            )

    def _views(self) -> WatchedTensors:
        """The slot's inline views, as this handle handed them out."""
        raise NotImplementedError

    def _leaked(self) -> list[str]:
        leaked = self._views().leaked(self._viewed) if self._viewed else []
        for opened in (self._opened or {}).values():
            leaked += opened.leaked(opened.tensors)
        return leaked

    def _moved_out(self) -> list[str]:
        """Fields whose handed-out tensors (views, opened refs, loans) no longer show
        the memory they were made over: moved out by share_memory_ or pickling, or
        pointed elsewhere."""
        moved = self._views().moved(self._viewed) if self._viewed else []
        return moved + [n for n, opened in (self._opened or {}).items() if opened.moved([n])]

    def _moved(self, names: list[str], action: str, reported: list[str]) -> None:
        """Report views that no longer show the row (moved out of it, or pointed elsewhere);
        `reported` were just reported as leaks."""
        raise NotImplementedError

    def _check_views(self, action: str) -> None:
        """Refuse (strict) or report (default) views still alive past ownership.

        A view that no longer shows the row is no use to the slot's next owner,
        and neither is one changed in place (checked in strict mode): the slot
        gets fresh views. What is reported is not reported again on a retry.
        """
        parts = self._parts
        watched = self._views()
        leaked = self._leaked()
        moved = self._moved_out()
        if leaked and parts.strict:
            raise LeakedViewError(self._leak_message(action, leaked))
        if moved:  # before any warning, which may be raised as an error and end this call
            parts.rows.forget_views(self.slot)
            self._forget_moved(moved)
        if leaked:
            self._report(leaked, self._leak_message(action, leaked))
        if moved:
            self._moved(moved, action, reported=leaked)
        changed = _changed_in_place(watched, self._viewed, parts) if parts.strict else []
        if changed:
            self._report(
                changed,
                f"{action} of slot {self.slot}: views of {', '.join(changed)} were changed in "
                "place (dtype, shape, strides, grad or attributes); later owners get fresh views",
            )

    def _leak_message(self, action: str, leaked: list[str]) -> str:
        return (
            f"{action} of slot {self.slot} while views of {', '.join(leaked)} are still "
            "referenced; they will see the next occupant's data (use copy() to keep data)"
        )

    def _forget_moved(self, names: list[str]) -> None:
        """These views no longer show the row: nothing of them is left to check."""
        self._unview(names)

    def _report(self, names: list[str], message: str) -> None:
        """Count and warn once; the slot's next owner gets fresh views."""
        if self._opened:  # opened tensors reported once, like views
            self._opened = {n: w for n, w in self._opened.items() if n not in names} or None
        self._parts.own.count("leaked_views", len(names))
        self._parts.rows.forget_views(self.slot)
        self._unview(names)
        warnings.warn(message, LeakedViewWarning, stacklevel=_caller_level())

    def _count_refused_leak(self, exc: Exception) -> None:
        """A with block hands the slot back although strict mode refused to: its views
        outlive ownership after all, so they count as leaked (a warning counts its own)."""
        if isinstance(exc, LeakedViewError):
            self._parts.own.count("leaked_views", len(self._leaked()))

    def _forget_unchecked(self) -> None:
        """Ending without a check (an exception is on its way): no view of ours stays cached."""
        if self._viewed:
            self._parts.rows.forget_views(self.slot)

    def _end_with(self, event: int, state: int) -> None:
        """The handle's last transition, and its end, in one compiled step."""
        if self._hand_back(event) == STEP_REFUSED:
            raise self._parts.own.not_mine(self.slot, self.generation, state)

    def _quarantine_from(self, state: int, window_ns: int) -> Quarantined:
        """QUARANTINE, one compiled step; an interrupt before the handle notes its end
        leaves it open in name only (its slot is not in `state` any more, so every later
        step of it is refused) and the slot closed all the same."""
        self._check_open("quarantine")
        parts = self._parts
        deadline_ns = time.monotonic_ns() + window_ns
        if parts.own.hot.quarantine(self.slot, self.generation, state, deadline_ns):
            raise parts.own.not_mine(self.slot, self.generation, state)
        self._open = False
        if parts.sites is not None:  # diagnostic only: whatever happens here, it stays closed
            parts.sites.record([(self.slot, self.generation)], _QUARANTINED)
        return Quarantined(parts, self._owner, self.slot, self.generation, self.tag, deadline_ns)

    def __repr__(self) -> str:
        status = "open" if self._open else "closed"
        kind = type(self).__name__
        return f"<{kind} slot={self.slot} gen={self.generation} tag={self.tag} {status}>"


class WriteSlot(_Handle, WriteSlotCore):
    """A slot this process is filling; every field must be written before publish.

    `write(**fields)` copies values into the row; all are checked before any
    byte changes.  A ref field's tensor is pinned (arena copy, or the CUDA
    tensor kept referenced) until this slot's generation moves on.
    `alloc(name, shape)` is a tensor of the table's arena for ref field `name`,
    to fill in place: the loan pattern for big CPU tensors, with no copy at all.
    The row refers to it at once (it counts as written), and a reader opens the
    same pages zero-copy.  Fill it before publish; a loan kept past publish or
    abort is reported as a leaked view (it would see the next occupant's data),
    and one moved out of the arena is refused.
    `publish(timeout=1.0)` seals the row (generation, checksum), queues it and
    makes it READY.  `abort()` hands the slot back unpublished.
    """

    __slots__ = ()

    def _write_slow(
        self, fields: dict[str, Any], plan: list[tuple[str, Any]] | None = None
    ) -> WriteSlot:
        """write() for values that are not the plain case, and every error of it; `plan`:
        rows.prepare(fields) made already (table.send checks a row before it claims)."""
        self._check_open("write")
        rows = self._parts.rows
        if plan is None:
            plan = rows.prepare(fields)
        if rows.schema.has_refs:
            refs = [i for i, (n, _) in enumerate(plan) if rows.schema.slots[n].field.is_ref]
            plan = self._pin_refs(plan, refs)
        rows.write(self.slot, plan)
        self._written.update(fields)
        return self

    def _pin_refs(self, plan: list[tuple[str, Any]], refs: list[int]) -> list[tuple[str, Any]]:
        store = self._parts.refs
        schema = self._parts.rows.schema
        encoded: dict[int, tuple[bytes, Pin]] = {}
        try:
            for i in refs:
                name, tensor = plan[i]
                encoded[i] = store.pin(self.slot, self.generation, schema.slots[name].field, tensor)
        except BaseException:
            for _, pin in encoded.values():
                store.unpin(pin)
            raise
        plan = list(plan)
        for i, (blob, pin) in encoded.items():
            name = plan[i][0]
            if self._pins is None:
                self._pins = {}
            elif name in self._pins:
                store.unpin(self._pins[name])  # overwritten before anyone could see it
            self._pins[name] = pin
            plan[i] = (name, blob)
        return plan

    def view(self, name: str) -> torch.Tensor:
        """The field's row memory, to fill in place (zero copy); counts as written."""
        self._check_open("view")
        if self._watched is None:  # publish checks these views, even if the slot's cache moves on
            self._watched = self._parts.rows.views(self.slot)
        tensor = self._watched.tensors.get(name)
        if tensor is None:
            raise SchemaError(f"no inline field {name!r}")
        self._written.add(name)
        self._note_viewed((name,))
        return tensor

    def _views(self) -> WatchedTensors:
        return self._watched if self._watched is not None else self._parts.rows.views(self.slot)

    def _alloc_slow(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """alloc() past its compiled plain case (csrc/leases.c), and every error of it."""
        self._check_open("alloc")
        parts = self._parts
        fs = parts.rows.schema.slots.get(name) if isinstance(name, str) else None
        if fs is None or not fs.field.is_ref:
            raise SchemaError(f"alloc loans ref fields; {name!r} is not one")
        f = fs.field
        got = tuple(shape) if isinstance(shape, (tuple, list)) else None
        if (
            got is None
            or not all(type(d) is int and d >= 0 for d in got)
            or not f.accepts_shape(got)
        ):
            raise SchemaError(f"field {name!r} has shape {f.shape}, got {shape!r}")
        old = (self._opened or {}).get(name)
        if old is not None and old.leaked([name]):  # its pages go with the new loan
            message = (
                f"alloc of {name!r} in slot {self.slot} while the previous loan is still "
                "referenced; its pages are freed and will hold other data"
            )
            if parts.strict:
                raise LeakedViewError(message)
            self._report([name], message)
        store = parts.refs
        blob, pin = store.loan(self.slot, self.generation, f, got)
        try:
            parts.rows.write(self.slot, [(name, blob)])
        except BaseException:
            store.unpin(pin)
            raise
        if self._pins is None:
            self._pins = {}
        elif name in self._pins:
            store.unpin(self._pins[name])  # replaced before anyone could see it
        self._pins[name] = pin
        if self._opened is None:
            self._opened = {}
        # the tensor made inside the dict: its counts at rest are what the watch holds
        watched = self._opened[name] = WatchedTensors({name: store.loaned(pin, f, got)})
        self._written.add(name)
        loaned: torch.Tensor = watched.tensors[name]
        return loaned

    def written_in_place(self, checksum: int | None = None) -> WriteSlot:
        """Take the row as written by a writer that knows only its addresses (a transfer
        engine or a memmove through `table.buffer_infos()`): every field counts as written.

        With `checksum` — what `shmslots.row_hash` gave the writer for the items it sent —
        the row must hash to it, or RowRejected is raised and nothing is published: a torn,
        partial or foreign transfer is refused, not delivered.  Without one, whatever the
        writer left unwritten keeps the bytes it had (the previous occupant's, unless the
        owner cleared them).
        """
        self._check_open("write")
        if checksum is not None and not (type(checksum) is int and 0 <= checksum < 1 << 32):
            raise InvalidArgument(f"checksum must be a 32-bit unsigned int, got {checksum!r}")
        rows = self._parts.rows
        check_by_address(rows)
        if checksum is not None and rows.checksum(self.slot) != checksum:
            raise RowRejected(
                f"slot {self.slot} (generation {self.generation}): the row written in place "
                f"does not match the writer's checksum {checksum:#010x}"
            )
        self._written.update(rows.schema.slots)
        return self

    def keep(self) -> Lease:
        """Seal the row and hold it oneself: WRITING -> HELD, never queued for other readers.

        For a row landed for this process's own later use — a transfer committed where it
        will be consumed (SGLang's decode side) — so it stays owned, and its views valid,
        until the lease is released.  Needs every field written, as publish() does, and
        refuses views moved out of the row as publish() does; the views this write slot
        handed out stay valid, and the lease checks them when it ends.  A process that dies
        holding it is treated as a consumer that died holding a taken row: the table's
        `on_consumer_death` says whether the row is redelivered to any reader or dropped.
        """
        self._check_open("keep")
        moved = self._moved_out()
        if moved:
            self._parts.rows.forget_views(self.slot)
            self._forget_moved(moved)
            self._moved(moved, "keep", reported=[])
        self._check_written()
        parts = self._parts
        got = self._keep()
        if got is None:
            self._check_open("keep")  # a collection on the way may have closed the table
            raise parts.own.not_mine(self.slot, self.generation, _WRITING)
        lease = cast(Lease, got)
        if viewed := self._viewed:  # the lease's own, checked at its end
            lease._watched = self._views()
            lease._note_viewed(viewed)
        lease._opened, self._opened = self._opened, None  # loans, likewise
        if parts.sites is not None:
            trace(parts, [lease], _HELD)
        return lease

    def _publish_slow(self, timeout: float) -> None:
        """publish() with fields unwritten, views alive, or a full ready ring; every error."""
        self._check_open("publish")
        self._check_written()
        if self._viewed or self._opened:
            self._check_views("publish")
        parts = self._parts
        if not self._seal_mine():  # the one sealing order: proven ours, sealed, then the step
            raise parts.own.not_mine(self.slot, self.generation, _WRITING)
        self._opened = None  # loans: the reader's from now on
        deadline = time.monotonic() + timeout
        while (result := self._hand_back(_PUBLISH)) == STEP_QUEUE_FULL:
            if time.monotonic() >= deadline:
                raise SlotsExhausted("ready queue full", parts.own.occupancy())
            time.sleep(0.0005)
        if result == STEP_REFUSED:
            raise parts.own.not_mine(self.slot, self.generation, _WRITING)

    def _check_written(self) -> None:
        """Refuse to publish a row with fields never written."""
        fields = self._parts.rows.schema.slots
        if len(self._written) != len(fields):  # written names were all checked to be fields
            missing = fields.keys() - self._written
            raise SchemaError(
                f"slot {self.slot}: fields {sorted(missing)} were never written; "
                "publishing would hand out the previous occupant's bytes"
            )

    def _abort_slow(self, check_views: bool = True) -> None:
        """abort() with views handed out, and every error of it."""
        self._check_open("abort")
        if check_views and (self._viewed or self._opened):
            self._check_views("abort")
        elif not check_views:
            self._forget_unchecked()
        self._opened = None
        self._end_with(_ABORT, _WRITING)

    def _forget_moved(self, names: list[str]) -> None:
        """Writes through these views went elsewhere, not into the row: they must be redone."""
        self._written.difference_update(names)
        if self._opened:  # a moved loan: its pages stay pinned until a write replaces them
            self._opened = {n: w for n, w in self._opened.items() if n not in names} or None
        self._watched = None  # views from now on are the slot's fresh ones

    def _moved(self, names: list[str], action: str, reported: list[str]) -> None:
        if action in ("publish", "keep"):  # an abort delivers nothing: nothing to redo
            raise SchemaError(
                f"slot {self.slot}: views of {', '.join(names)} no longer show the "
                "row (moved out by share_memory_ or pickling, or pointed elsewhere), so what was "
                "written through them is not in the row; write those fields again"
            )

    def quarantine(self, window_s: float) -> Quarantined:
        """Close this slot to every writer and reader for `window_s` seconds, unpublished
        (a row refused while a write by address may still be landing): see `Quarantined`."""
        window_ns = _window_ns(window_s)
        self._check_open("quarantine")
        if self._viewed or self._opened:
            self._check_views("quarantine")
        self._opened = None
        return self._quarantine_from(_WRITING, window_ns)

    def end(self) -> None:
        """Abort unless it was published or already ended; safe to call again."""
        self.__exit__(None, None, None)

    def __enter__(self) -> WriteSlot:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the block without publishing aborts: nothing half-written is delivered.

        Ownership ends with the block: a view check that fails still hands the slot
        back (no later call could), and its error is raised after.
        """
        if self._open and not self._parts.closed and self._still_mine(_WRITING):
            if et is None:
                try:
                    self.abort()
                except Exception as exc:  # LeakedViewError, or a warning raised as an error
                    if self._open and self._still_mine(_WRITING):
                        self._count_refused_leak(exc)
                        self._abort_slow(check_views=False)
                    raise
            else:  # the block's locals may still hold views: hand the slot back regardless
                self._abort_slow(check_views=False)
        self._open = False


class Reservation(_Handle):
    """A FREE slot booked by a consumer for a producer to open by (slot, generation)."""

    __slots__ = ()

    def abort(self) -> None:
        self._check_open("abort")
        self._end_with(_ABORT, _RESERVED)

    def quarantine(self, window_s: float) -> Quarantined:
        """Abort this reservation but keep its slot closed to every writer and reader for
        `window_s` seconds (its transfer may still land): see `Quarantined`."""
        return self._quarantine_from(_RESERVED, _window_ns(window_s))

    def end(self) -> None:
        """Abort unless a producer opened it or it already ended; safe to call again."""
        if self._open and not self._parts.closed and self._still_mine(_RESERVED):
            self.abort()
        self._open = False

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the block aborts the reservation unless a producer opened it."""
        self.end()


class Lease(_Handle, LeaseCore):
    """A READY slot taken by this process; views are valid until release or abort.

    `view(name)` is a zero-copy tensor over an inline field, valid only while
    the lease is held; `item(name)` reads a field of one element (shape (),
    (1,), ...) as a Python number (no tensor, nothing to outlive the lease);
    `copy(name, out=)` copies a field out, into the caller's buffer if given.
    `release()` ends the lease after consumption and `abort()` without it
    (request aborted); either way the slot is FREE at once.
    """

    __slots__ = ()

    def _view_slow(self, name: str) -> torch.Tensor:
        self._check_open("view")
        tensor = self._views().tensors.get(name)
        if tensor is None:
            raise SchemaError(f"no inline field {name!r} (ref fields: tensor())")
        self._note_viewed((name,))
        return tensor

    def _item_slow(self, name: str) -> int | float:
        self._check_open("read")
        fs = self._parts.rows.schema.slots.get(name) if isinstance(name, str) else None
        if fs is None:
            raise SchemaError(f"no field {name!r}")
        f = fs.field
        if f.is_ref or math.prod(f.fixed_shape) != 1:
            raise SchemaError(
                f"item() reads inline fields of one element; {name!r} is {f.kind} of shape "
                f"{f.shape}"
            )
        value: int | float = self._views().tensors[name].item()  # the compiled read did not
        return value

    def _tensor_slow(self, name: str) -> torch.Tensor:
        """tensor() but for what LeaseCore.tensor opens itself: a CUDA ref, a refusal to
        word, or a closed lease."""
        fs = self._parts.rows.schema.slots.get(name)
        if fs is None or not fs.field.is_ref:
            return self.view(name)
        self._check_open("open a ref of")
        if self._opened is None:
            self._opened = {}
        if name not in self._opened:  # watched on its own, so its counts are taken at rest
            self._opened[name] = WatchedTensors({name: self._open_ref(name)})
        return self._opened[name].tensors[name]

    def _open_ref(self, name: str) -> torch.Tensor:
        parts = self._parts
        return parts.refs.open(parts.rows, self.slot, self.generation, name)

    def _copy_slow(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """copy() but for an inline field without `out`, which LeaseCore.copy makes in one
        compiled call: a ref field, a caller's `out`, or a refusal to word."""
        self._check_open("copy")
        codec = self._parts.rows._codec
        assert codec is not None  # a table's rows are writable
        fs = self._parts.rows.schema.slots.get(name)
        if fs is None:
            raise SchemaError(f"no field {name!r}")
        f = fs.field
        if f.is_ref:
            tensor = self._open_ref(name)
            if out is None:
                return tensor.clone()
            if not isinstance(out, torch.Tensor) or (out.dtype, out.shape) != (
                tensor.dtype,
                tensor.shape,
            ):
                raise SchemaError(
                    f"copy: out must be a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
                )
            return out.copy_(tensor)  # any device: torch moves it
        if out is None:  # more dimensions than the compiled copy makes
            out = torch.empty(f.fixed_shape, dtype=f.torch_dtype, device="cpu")
        if not codec.gather(self.slot, name, out):
            check_out("copy", f, out, f.fixed_shape)
            out.copy_(self._views().tensors[name])  # a subclass, or a strided `out`
        self._check_open("copy")  # torch ran since the first check, and may have run Python
        return out

    def verify(self) -> bool:
        """True if the row is still exactly what was published under this generation."""
        self._check_open("verify")
        return self._parts.row_intact(self.slot, self.generation)

    def _views(self) -> WatchedTensors:
        """The slot's views, made on first use (the compiled take never runs Python)."""
        if self._watched is None:
            self._watched = self._parts.rows.views(self.slot)
        return self._watched

    def _moved(self, names: list[str], action: str, reported: list[str]) -> None:
        """The reader's own views of it: report once; what it read is not lost."""
        names = [n for n in names if n not in reported]
        if not names:
            return
        self._report(
            names,
            f"{action} of slot {self.slot}: views of {', '.join(names)} no longer show the row "
            "(moved out by share_memory_ or pickling, or pointed elsewhere); later leases get "
            "fresh views",
        )

    def _end(self, event: int, action: str, check_views: bool = True) -> None:
        """release() or abort() with views or opened refs to check, and every error of them."""
        if self._parts.closed or not self._open:
            self._check_open(action)
        if not check_views:
            self._forget_unchecked()
        elif self._viewed or self._opened is not None:
            self._check_views(action)
        self._end_with(event, _HELD)
        self._opened = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Ownership ends with the block, as for a WriteSlot: a failed view check still
        hands the slot back, then raises."""
        if self._open and not self._parts.closed and self._still_mine(_HELD):
            if et is None:
                try:
                    self.release()
                except Exception as exc:  # LeakedViewError, or a warning raised as an error
                    if self._open and self._still_mine(_HELD):
                        self._count_refused_leak(exc)
                        self._end(_RELEASE, "release", check_views=False)
                    raise
            else:  # the block's locals may still hold views: hand the slot back regardless
                self._end(_ABORT, "abort", check_views=False)
        self._open = False


class Quarantined:
    """The slot of a transfer aborted while a write by address may still land in it,
    QUARANTINED in the segment until `deadline_ns` (CLOCK_MONOTONIC, `time.monotonic_ns`):
    no producer opens it, no reader takes it, `shmslots inspect` shows it with its
    deadline.  Once the deadline has passed anyone's claim that finds no FREE slot frees it
    (as does `reap`); `end()` frees it sooner, when no write can land any more (its engine
    closed); a reaper frees it at once if this process dies.  Why: docs/protocol.md
    (Quarantine)."""

    __slots__ = ("_owner", "_parts", "deadline_ns", "generation", "slot", "tag")

    def __init__(
        self,
        parts: TableParts,
        owner: object,
        slot: int,
        generation: int,
        tag: int,
        deadline_ns: int,
    ) -> None:
        self._parts = parts
        self._owner = owner  # the table, kept alive as the handle did: its close would free us
        self.slot = slot
        self.generation = generation
        self.tag = tag
        self.deadline_ns = deadline_ns

    @property
    def held(self) -> bool:
        """Whether the slot is still closed under this quarantine (not freed by anyone)."""
        parts = self._parts
        return not parts.closed and parts.own.owns(self.slot, self.generation, _QUARANTINED)

    def end(self) -> bool:
        """Free the slot now if it is still held; whether it was.  Safe to call again."""
        parts = self._parts
        if parts.closed:  # its close freed it
            return False
        return parts.own.hot.free(self.slot, self.generation, _QUARANTINED, _ABORT) == 0

    def __repr__(self) -> str:
        left = (self.deadline_ns - time.monotonic_ns()) / 1e9
        return (
            f"<Quarantined slot={self.slot} gen={self.generation} tag={self.tag} {left:.3f}s left>"
        )


MAX_WINDOW_S = 365 * 24 * 3600.0  # a deadline in u64 nanoseconds, with room to spare


def _window_ns(window_s: float) -> int:
    if not (
        isinstance(window_s, (int, float))
        and not isinstance(window_s, bool)
        and 0 <= window_s <= MAX_WINDOW_S
    ):
        raise InvalidArgument(
            f"late-write window must be a number of seconds from 0 to {MAX_WINDOW_S:.0f}, "
            f"got {window_s!r}"
        )
    return int(window_s * 1e9)


def trace(parts: TableParts, handles: Sequence[_Handle], state: int) -> None:
    """Record the caller as these new owners' call site.  Diagnostic data only: if an
    interrupt lands here, the handles are handed back (leases queued again) before it goes
    on, so it never leaves a slot owned without a handle."""
    assert parts.sites is not None
    try:
        parts.sites.record([(h.slot, h.generation) for h in handles], state)
    except BaseException:
        for h in handles:
            if isinstance(h, Lease):
                h._hand_back(_REDELIVER)
            else:
                cast(WriteSlot | Reservation, h).abort()
        raise
