"""SlotTable: create or attach a table, and the calls that move slots.

This is the public face; the protocol is docs/protocol.md (compiled in csrc/hotpath.c, built by
ownership.py), the bytes in layout.py, the legal transitions in states.py, joining and
leaving in membership.py.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, NoReturn, TypeVar

import torch

from . import layout as L
from . import orphans
from ._core import AtomicView, HandleBase
from .errors import (
    CorruptTable,
    InvalidArgument,
    OwnershipError,
    RowsLeftWarning,
    SchemaError,
    ShmSlotsError,
    SlotsExhausted,
    TableClosed,
    TableExists,
    TableNotFound,
    TableNotReady,
)
from .leases import Lease, Reservation, WriteSlot, check_by_address, handle_core, trace
from .membership import Membership
from .ownership import STRANDED_AGE_NS, STRANDED_CHECK_S, describe_word, hot_path
from .participants import Participant, hold_gate, release_gate
from .parts import TableParts
from .refs import RefStore
from .rows import Rows, admit_batch, check_out
from .schema import Field, RowSchema
from .segment import Segment
from .snapshot import SlotSnapshot, owned_slots, read_slot, slot_holdings
from .states import (
    GEN_MASK,
    Event,
    State,
    generation_of,
    in_state,
    known,
    owner_of,
    state_of,
)
from .tracing import Holding, SiteWriter, describe_holders, trace_from_env
from .validate import INIT_WAIT_S, read_schema, read_valid_header
from .waiting import NAP_S, wait_for

_CLAIM = int(Event.CLAIM)
_RESERVE = int(Event.RESERVE)
_WRITING = int(State.WRITING)
_RESERVED = int(State.RESERVED)
_HELD = int(State.HELD)
_REDELIVER = int(Event.REDELIVER)
_M64 = (1 << 64) - 1
_ZERO_MASKS_KEPT = 64  # reserve()'s zeroed tuples remembered, checked once each
_LIVE_TABLES: weakref.WeakSet[SlotTable] = weakref.WeakSet()


T = TypeVar("T")


def _check_count(n: object, what: str) -> None:
    """How many slots a batch call may move: an int >= 0 (not a bool), for every batch call."""
    if type(n) is not int or n < 0:
        raise InvalidArgument(f"{what} must be an int >= 0, got {n!r}")


def _check_tag(tag: object) -> None:
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= _M64:
        raise InvalidArgument(f"tag must be an int in 0..2**64-1, got {tag!r}")


def _create_segment(name: str, size: int, replace_orphaned: bool) -> Segment:
    """Segment.create, saying who uses a table already there, or replacing it if orphaned."""
    try:
        return Segment.create(name, size)
    except TableExists:
        if replace_orphaned and orphans.remove_if_orphaned(name):
            with contextlib.suppress(TableExists):  # else another restart made it first
                return Segment.create(name, size)
    raise TableExists(f"a table named {name!r} already exists: {orphans.describe(name)}")


def _open_segment(name: str, timeout: float) -> Segment:
    """Segment.open, retried through "missing" for `timeout` s and through "being created"
    (not sized yet) for at least INIT_WAIT_S."""
    start = time.monotonic()
    while True:
        try:
            return Segment.open(name)
        except TableNotFound:
            if time.monotonic() - start >= timeout:
                raise
        except TableNotReady:
            if time.monotonic() - start >= max(timeout, INIT_WAIT_S):
                raise
        time.sleep(0.005)


def _open_gated(name: str, timeout: float) -> Segment:
    """_open_segment, holding the table's gate until the caller registers: a table replaced
    (its name unlinked) between the open and the gate is let go, and the name opened again."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        segment = _open_segment(name, max(0.0, deadline - time.monotonic()))
        try:  # a gate held by a stopped process is waited for as long as a half-made table
            hold_gate(segment.fd, name, max(deadline, start + INIT_WAIT_S))
        except BaseException:
            segment.close()
            raise
        if not segment.unlinked:
            return segment
        segment.close()


def _fields_expected(expect: object) -> tuple[Field, ...] | None:
    """attach()'s `expect`: None, or a sequence of Fields (read once: a generator too)."""
    if expect is None:
        return None
    wanted = tuple(expect) if isinstance(expect, Iterable) else None
    if wanted is None or not all(isinstance(f, Field) for f in wanted):
        raise InvalidArgument(f"expect takes a sequence of Fields, got {expect!r}")
    return wanted


def _names_of(fields: tuple[Field, ...]) -> list[str]:
    return [f.name for f in fields]


def _disown_after_fork() -> None:
    for table in list(_LIVE_TABLES):
        table._disown()


os.register_at_fork(after_in_child=_disown_after_fork)


@dataclass(frozen=True)
class SlotAge:
    """A slot that has stayed out of FREE longer than the table's `max_hold_s`."""

    slot: int
    state: State
    owner: int  # participant index, -1 for nobody (READY)
    tag: int
    age_s: float


@dataclass(frozen=True)
class Stats:
    """A snapshot: slots per state, lifetime counters, queued publications."""

    states: dict[str, int]
    counters: dict[str, int]
    queued: int
    participants: int
    overdue: int
    arena_bytes_used: int = 0
    arena_blocks: int = 0
    pinned_here: int = 0  # refs this process keeps alive until their slot moves on

    @property
    def owned(self) -> int:
        return sum(n for s, n in self.states.items() if s != "FREE")


class SlotTable:
    """A fixed table of typed rows in shared memory, with enforced slot ownership."""

    def __init__(
        self, segment: Segment, header: L.Header, schema: RowSchema, role: str, name: str
    ) -> None:
        self._segment = segment
        self._header = header
        self._strict = bool(header.flags & L.FLAG_STRICT)
        self.layout = header.layout
        # read on every take: a plain take returns its lease at once
        self._plain_take = not self._strict and not self.layout.trace_sites
        self._zero_masks: dict[tuple[str, ...], int] = {}  # reserve(zeroed=...) -> its mask
        self.schema = schema
        self._atomics = AtomicView(segment.mm)
        self._mv = memoryview(segment.mm)
        self._forked = False
        self._closed = True  # until it has joined: nothing to close before
        self._waiters = 0  # this object's threads inside _wait (close wakes them first)
        member = None
        try:
            member = self._member = Membership(
                segment,
                self._atomics,
                self._mv,
                self.layout,
                role,
                name,
                self.drop_on_consumer_death,
                header.created_ns if segment.created else None,
            )
            self.participant = index = member.participant
            self._own = member.own
            self._arena = member.arena
            self._sites = (
                SiteWriter(self._atomics, self._mv, self.layout, index)
                if self.layout.trace_sites
                else None
            )
            self._rows = Rows(segment.mm, self.layout, schema, self._atomics)
            self._inline = {  # what gather allocates: (dtype, shape) of each inline field
                n: (fs.field.torch_dtype, fs.field.fixed_shape)
                for n, fs in schema.slots.items()
                if not fs.field.is_ref
            }
            self._refs = RefStore(self._own, member.arena, segment.mm, segment.name)
            # the compiled handle steps
            self._core = handle_core(
                self._own,
                self._rows,
                self._refs.place,
                member.arena,
                self._strict,
                not self.drop_on_consumer_death,
                STRANDED_CHECK_S,
            )
            self._parts = TableParts(
                segment.name,
                self._strict,
                self._rows,
                self._own,
                self._refs,
                self._sites,
                self._core,
                self._idle,
            )
            self._core.parts = self._parts  # what every handle of this table is given
            self._closed = False
            self.reap()
        except BaseException:
            self._closed = True
            if member is not None:
                member.drop_lock()  # a half-made entry reads as dead
            raise
        _LIVE_TABLES.add(self)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def create(
        cls,
        name: str,
        fields: list[Field] | tuple[Field, ...],
        slots: int,
        *,
        strict: bool = False,
        participants: int = 64,
        on_consumer_death: Literal["redeliver", "drop"] = "redeliver",
        max_hold_s: float | None = None,
        arena_bytes: int = 0,
        arena_page: int = 16384,
        role: str = "owner",
        trace: bool | None = None,
        trace_sites: int = L.DEFAULT_TRACE_SITES,
        replace_orphaned: bool = False,
    ) -> SlotTable:
        """Create a new table (exclusive; mode 0600) and attach to it.

        A table of that name already there raises TableExists, saying who uses it; with
        `replace_orphaned`, one whose every participant is dead (its creator was killed) is
        removed and the table made anew, and one with a live participant is still refused.

        `strict` makes leaked views raise and every take verify its row.
        `on_consumer_death` says what happens to slots a dead consumer held.
        `max_hold_s` makes slots out of FREE for longer show up in `overdue()`
        (reported, never reclaimed: a leak on an abort path becomes visible).
        `arena_bytes` reserves an arena (pages of `arena_page` bytes) for the
        CPU tensors of ref fields.
        `trace` makes every new owner record its call site in the table (None: as the
        SHMSLOTS_TRACE environment variable says), for `shmslots inspect --by-site` and
        SlotsExhausted; each participant keeps up to `trace_sites` distinct sites.
        """
        if max_hold_s is not None and not max_hold_s > 0:
            raise InvalidArgument(f"max_hold_s must be positive, got {max_hold_s!r}")
        schema = RowSchema(list(fields))
        if on_consumer_death not in ("redeliver", "drop"):
            raise InvalidArgument("on_consumer_death must be 'redeliver' or 'drop'")
        if not isinstance(slots, int) or isinstance(slots, bool):
            raise InvalidArgument(f"slots must be an int, got {slots!r}")
        blob = schema.encode()
        pages = L.arena_pages(arena_bytes, arena_page)
        traced = trace_from_env() if trace is None else trace
        if traced and not (isinstance(trace_sites, int) and 1 <= trace_sites <= L.MAX_TRACE_SITES):
            raise InvalidArgument(f"trace_sites must be in 1..{L.MAX_TRACE_SITES}")
        lay = L.Layout.compute(
            slots, schema.row_size, participants, len(blob), arena_page, pages,
            trace_sites if traced else 0,
        )  # fmt: skip
        flags = (L.FLAG_STRICT if strict else 0) | (
            L.FLAG_DROP_ON_CONSUMER_DEATH if on_consumer_death == "drop" else 0
        )
        segment = _create_segment(name, lay.total_size, replace_orphaned)
        try:
            # until registered: no replacer takes it for an orphan
            hold_gate(segment.fd, name, time.monotonic() + INIT_WAIT_S)
            mm = segment.mm
            mm[lay.schema : lay.schema + len(blob)] = blob
            ring = hot_path(mm, lay, me=0)
            try:
                ring.init_ring()
            finally:
                ring.release()
            header = lay.pack_header(
                uid=os.getuid(),
                pid=os.getpid(),
                created_ns=time.time_ns(),
                flags=flags,
                max_hold_ns=int((max_hold_s or 0) * 1e9),
                magic=b"\0" * 8,
            )
            mm[: len(header)] = header
            L.publish_magic(mm)  # last, a release store: attachers never see a half-built table
            table = cls(
                segment,
                L.read_header(mm[: L.HEADER_SIZE], lay.total_size),
                schema,
                role,
                f"{role}-{os.getpid()}",
            )
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        release_gate(segment.fd)
        return table

    @classmethod
    def attach(
        cls,
        name: str,
        role: str = "participant",
        *,
        label: str | None = None,
        timeout: float = 0.0,
        expect: Sequence[Field] | None = None,
        mode: int = 0o600,
    ) -> SlotTable:
        """Attach to an existing table by name; refuses anything that is not a valid table.

        `timeout` s are waited through a table that does not exist yet (TableNotFound after
        them); one being created is waited for at least INIT_WAIT_S whatever `timeout` says,
        so a half-made table is never taken for a corrupt one.  `expect`, the fields the
        caller will use, refuses with SchemaError a table whose fields differ.  The table
        must be this user's file with no permission bit beyond `mode` (TablePermissionError);
        a table shared through a wider mode is attached with that mode named here.
        """
        if not isinstance(role, str):
            raise InvalidArgument(
                f"role must be a str, got {role!r}; the fields a table must have go in expect="
            )
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)) or not (
            0 <= timeout < float("inf")
        ):
            raise InvalidArgument(f"timeout must be a finite number >= 0 s, got {timeout!r}")
        wanted = _fields_expected(expect)
        start = time.monotonic()
        segment = _open_gated(name, timeout)
        try:
            left = max(INIT_WAIT_S, timeout - (time.monotonic() - start))
            header = read_valid_header(segment, left, mode)
            schema = read_schema(segment, header)
            if wanted is not None and wanted != schema.fields:
                raise SchemaError(
                    f"table {name!r} has fields {_names_of(schema.fields)}, not the expected "
                    f"{_names_of(wanted)}"
                    if _names_of(schema.fields) != _names_of(wanted)
                    else f"table {name!r}'s fields differ in dtype or shape from the expected: "
                    f"{list(schema.fields)} != {list(wanted)}"
                )
            table = cls(segment, header, schema, role, label or f"{role}-{os.getpid()}")
        except BaseException:
            segment.close()  # its gate goes with its descriptor
            raise
        release_gate(segment.fd)
        return table

    # -- properties -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def slots(self) -> int:
        return self.layout.slots

    @property
    def strict(self) -> bool:
        return self._strict

    @property
    def drop_on_consumer_death(self) -> bool:
        return bool(self._header.flags & L.FLAG_DROP_ON_CONSUMER_DEATH)

    @property
    def created_here(self) -> bool:
        return self._segment.created

    def buffer_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(ptrs, data_lens, item_lens) of the table's columns in this process, in field
        order, as SGLang's `MetadataBuffers.get_buf_infos()` gives them to a transfer engine.

        Field i of slot s is the `item_lens[i]` bytes at `ptrs[i] + item_lens[i] * s` (the
        field's own bytes first, then padding).  A writer that knows only these fills a
        reservation; its owner then takes the row with `open_reserved(...).written_in_place()`.
        The addresses are this process's: each process asks its own table.
        """
        self._check_open()
        return self._rows.buffer_infos()

    # -- writer side ------------------------------------------------------------------
    def claim(self, tag: int = 0, timeout: float = 1.0) -> WriteSlot:
        """A FREE slot to write; waits up to `timeout` s, then raises SlotsExhausted."""
        ws = self._core.claim(self, tag)  # the plain case: a slot free now, a plain tag
        if ws is None:
            if self._closed:
                self._check_open()
            self._refs.collect_own()  # drop tensors whose consumers are done
            got = self._acquire(_CLAIM, tag, timeout, "claim")
            assert isinstance(got, WriteSlot)
            ws = got
        if self._sites is not None:
            trace(self._parts, [ws], _WRITING)
        return ws

    def send(
        self, fields: Mapping[str, Any] | tuple[Any, ...], /, tag: int = 0, timeout: float = 1.0
    ) -> None:
        """Claim, write and publish a row (iceoryx2's send_copy), every value checked against
        the schema before a slot is claimed, so refused input changes nothing (a ref field's
        room in the arena is found after).  `fields` is every field by name (a mapping, or a
        namedtuple), or a plain tuple of their values in schema order (as
        `lease.views(names)` gives a row to pass on).  Plain tensors and numbers on a table
        without ref fields go in one compiled call that no exception can split; anything else
        through claim, write and publish, the slot aborted if one fails.  Waits (no slot
        free, a full ready queue) are claim's and publish's, each up to `timeout` s."""
        if self._sites is None and self._core.send(self, fields, tag):
            return
        self._check_open()
        names = self.schema.slots
        if isinstance(fields, tuple) and hasattr(fields, "_fields"):  # a namedtuple: by name
            fields = dict(zip(fields._fields, fields, strict=True))
        elif isinstance(fields, tuple):
            if len(fields) != len(names):
                raise SchemaError(
                    f"send takes {len(names)} values in schema order, got {len(fields)}"
                )
            fields = dict(zip(names, fields, strict=True))
        elif not isinstance(fields, Mapping):
            raise InvalidArgument(
                f"send takes a mapping or a tuple of field values, got {fields!r}"
            )
        else:
            fields = dict(fields)
        missing = names.keys() - fields.keys()
        if missing:
            raise SchemaError(f"send writes a whole row; fields {sorted(missing)} are missing")
        plan = self._rows.prepare(fields)  # every value checked before a slot is claimed
        with self.claim(tag, timeout) as ws:  # the same steps, each with its waits and errors
            ws._write_slow(fields, plan)
            ws.publish(timeout)

    def reserve(
        self, tag: int = 0, timeout: float = 1.0, *, zeroed: tuple[str, ...] = ()
    ) -> Reservation:
        """Book a FREE slot for a producer that will `open_reserved(slot, generation)`.

        The items of the inline fields named in `zeroed` are zeroed in the same compiled
        step, before the reservation exists: a field a consumer gates on (SGLang's room)
        then reads "not yet written", whatever the slot's last owner left there."""
        if self._closed:
            self._check_open()
        if type(zeroed) is not tuple:
            raise InvalidArgument(f"zeroed takes a tuple of field names, got {zeroed!r}")
        try:
            mask = self._zero_masks.get(zeroed) if zeroed else 0
        except Exception:  # a name that does not hash: not a name, which zero_mask says
            mask = None
        if mask is None:  # named for the first time: checked, then kept
            mask = self._rows.zero_mask(zeroed)
            if len(self._zero_masks) < _ZERO_MASKS_KEPT:
                self._zero_masks[zeroed] = mask
        got = self._acquire(_RESERVE, tag, timeout, "reserve", mask)
        assert isinstance(got, Reservation)
        if self._sites is not None:
            trace(self._parts, [got], _RESERVED)
        return got

    def open_reserved(self, slot: int, generation: int) -> WriteSlot:
        """Take over a reservation to write it; a stale generation is refused."""
        self._check_open()
        self.layout.check_slot(slot)
        if type(generation) is not int or not 0 <= generation <= GEN_MASK:
            raise OwnershipError(f"generation {generation!r} is not a 32-bit generation")
        ws = self._core.open_reserved(self, slot, generation)
        if ws is None:
            raise OwnershipError(
                f"slot {slot} generation {generation} is not reserved "
                f"(it is {describe_word(self._own.word(slot))})"
            )
        if self._sites is not None:
            trace(self._parts, [ws], _WRITING)
        return ws

    def keep_reserved(self, reservation: Reservation) -> Lease:
        """Take a reservation's row as written by address (a transfer engine's write that
        has landed) and hold it oneself: `open_reserved(...).written_in_place().keep()` in
        one compiled call, the decode side's commit of a transfer.  A reservation of
        another table, one already ended, or a slot not reserved at its generation any
        more is refused, with nothing changed."""
        if self._closed:
            self._check_open()
        lease = self._core.keep_reserved(reservation)
        if lease is None:  # not the compiled case: the same steps, each with its errors
            if not isinstance(reservation, Reservation) or reservation._owner is not self:
                raise OwnershipError(f"{reservation!r} is not a reservation of {self.name!r}")
            reservation._check_open("keep")
            check_by_address(self._parts.rows)
            with self.open_reserved(reservation.slot, reservation.generation) as ws:
                reservation._open = False  # its slot is this write slot's now
                lease = ws.written_in_place().keep()
        elif self._sites is not None:
            trace(self._parts, [lease], _HELD)
        return lease

    def _acquire(
        self, event: int, tag: int, timeout: float, what: str, zeroed: int = 0
    ) -> HandleBase:
        """A handle for a FREE slot, made in the same compiled call that takes the slot (and
        zeroes the fields of mask `zeroed`)."""
        if self._closed:
            self._check_open()
        if type(tag) is not int or not 0 <= tag <= _M64:  # the common case in one test
            _check_tag(tag)
        core = self._core
        got = core.acquire(self, event, tag, zeroed)
        if got is not None:
            return got
        self.reap()  # a full table is the moment dead owners matter
        own = self._own
        waited = self._wait(
            lambda: core.acquire(self, event, tag, zeroed),
            (own.release_seq, own.claimers_waiting, own.claimers_until),
            timeout,
            self.reap,  # between naps: an owner may have died since the first reap
        )
        if waited is None:
            occupancy = own.occupancy()
            why = f"no free slot to {what} within {timeout} s"
            if occupancy["FREE"]:
                why += (
                    f" ({occupancy['FREE']} FREE slots still have a cancelled or reclaimed entry "
                    "in the ready queue, behind a head that readers are not taking)"
                )
            if self._sites is not None:
                why += f"; {describe_holders(self.holdings())}"
            raise SlotsExhausted(why, occupancy)
        return waited

    # -- reader side ------------------------------------------------------------------
    def take(self, timeout: float | None = 0.0) -> Lease | None:
        """The oldest READY slot as a Lease, waiting up to `timeout` s (None: forever)."""
        if self._closed:
            self._check_open()
        got = self._core.take(self)
        if got is not None and self._plain_take:  # taken, nothing to verify: most calls
            return got
        lease = self._settle(got)
        if lease is None and timeout != 0.0:
            own = self._own
            lease = self._wait(
                self._take_once,
                (own.publish_seq, own.readers_waiting, own.readers_until),
                timeout,
            )
        if lease is not None and self._sites is not None:
            trace(self._parts, [lease], _HELD)
        return lease

    def poll(self, max_n: int) -> list[Lease]:
        """Up to `max_n` READY slots, without waiting, taken in one compiled call.

        On a strict table each row is verified; if one fails, it is aborted, the others
        are handed back unread (queued again), and CorruptTable is raised.
        """
        self._check_open()
        _check_count(max_n, "max_n")
        leases = self._core.poll(self, max_n)
        if self._strict:
            self._verify_all(leases)
        if leases and self._sites is not None:
            trace(self._parts, leases, _HELD)
        return leases

    def release_all(self, leases: Iterable[Lease]) -> None:
        """Release every lease in one compiled call, each as `lease.release()` would."""
        self._end_all(leases, True, "release")

    def abort_all(self, leases: Iterable[Lease]) -> None:
        """Abort every lease in one compiled call, each as `lease.abort()` would."""
        self._end_all(leases, False, "abort")

    def _end_all(self, leases: Iterable[Lease], release: bool, action: str) -> None:
        """The list is checked whole first: an item that is not an open Lease of this table,
        or one listed twice, is refused with nothing done.  An error part-way (a view check)
        leaves the items before it handed back; see `_batch`."""
        self._check_open()
        items = leases if isinstance(leases, (list, tuple)) else list(leases)
        bad = self._batch(lambda: self._core.end_all(items, release), action)
        if bad is not None:
            self._refuse_item(items, bad, Lease, action)

    def claim_n(self, n: int, tag: int = 0) -> list[WriteSlot]:
        """Up to `n` FREE slots to write, claimed in one compiled call; fewer (even none)
        if fewer are free now: it never waits, as `poll` does not (`claim` waits)."""
        self._check_open()
        _check_count(n, "n")
        _check_tag(tag)
        if self._rows.schema.has_refs:
            self._refs.collect_own()  # as claim: drop tensors whose consumers are done
        claimed = self._core.claim_n(self, n, tag)
        if claimed and self._sites is not None:
            trace(self._parts, claimed, _WRITING)
        return claimed

    def publish_all(self, write_slots: Iterable[WriteSlot], timeout: float = 1.0) -> None:
        """Publish every write slot in one compiled call, each as `publish(timeout)` would.

        Checked whole first: an item that is not an open WriteSlot of this table with
        every field written, or one listed twice, is refused with nothing published.
        """
        self._check_open()
        items = write_slots if isinstance(write_slots, (list, tuple)) else list(write_slots)
        bad = self._batch(lambda: self._core.publish_all(items, timeout), "publish")
        if bad is not None:
            self._refuse_item(items, bad, WriteSlot, "publish")

    @staticmethod
    def _batch(run: Callable[[], int | None], action: str) -> int | None:
        """Run a batch call; an error from item k (its own, as the one-handle call raises
        it) says that items before k are done and k onwards still owned by their handles."""
        try:
            return run()
        except BaseException as exc:
            done = getattr(exc, "batch_done", None)
            if isinstance(done, int):
                exc.add_note(
                    f"{action}_all stopped at item {done}: items 0..{done - 1} were "
                    f"{action}{'d' if action.endswith('e') else 'ed'}, items {done} on are "
                    "still owned by their handles"
                )
            raise

    def _refuse_item(
        self, items: Sequence[object], i: int, kind: type[Lease] | type[WriteSlot], action: str
    ) -> NoReturn:
        """Say why item i of a batch was refused (nothing was done)."""
        item = items[i]
        where = f"{action}{'' if action in ('gather', 'scatter') else '_all'}: item {i}"
        if not isinstance(item, kind) or item._parts is not self._parts:
            raise InvalidArgument(
                f"{where} is {item!r}, not a {kind.__name__} of table {self.name!r}; "
                "nothing was done"
            )
        first = next(j for j, x in enumerate(items) if x is item)
        if first != i:
            raise InvalidArgument(f"{where} is item {first} again; nothing was done")
        try:
            item._check_open(action)
            if isinstance(item, WriteSlot) and action == "publish":
                item._check_written()
        except ShmSlotsError as exc:
            exc.add_note(f"{where} was refused; nothing was done")
            raise
        raise InvalidArgument(f"{where} was refused; nothing was done")  # not reached

    def gather(
        self, leases: Iterable[Lease], field: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One inline field of every lease, row after row, as one tensor (n, *shape).

        One compiled loop of copies, no view and no torch operation per row: the
        way a batch is built.  `out` (a contiguous CPU tensor of that dtype and
        shape) is filled instead of a new tensor.  Every lease must be open and
        of this table; if anything is wrong, nothing is written.
        """
        self._check_open()
        items = leases if isinstance(leases, (list, tuple)) else list(leases)
        if out is None:
            spec = self._inline.get(field)
            if spec is None:
                raise self._not_inline(field)
            out = torch.empty((len(items), *spec[1]), dtype=spec[0], device="cpu")
        got = self._core.gather(items, field, out)
        if got is not True:
            self._gather_refused(items, field, out, got)
        return out

    def scatter(self, write_slots: Sequence[WriteSlot], field: str, values: object) -> None:
        """Write one inline field of every write slot from one batch: `values[k]` into
        `write_slots[k]`, in one compiled loop of copies; the inverse of gather, the way a
        batch producer hands its batch tensors over.

        `values` is a tensor (n, *shape) of the field's dtype (any device or layout: a
        plain contiguous CPU one is checked once for the whole batch, the rules being
        write()'s), or (nested) lists of that shape of the numbers write() takes for one
        element, each checked to fit as write() checks it.  The field counts as written in
        each slot.  Every write slot must be open, of this table and listed once, and
        `values` must fit; if anything is wrong, nothing is written.
        """
        self._check_open()
        items = write_slots if isinstance(write_slots, (list, tuple)) else list(write_slots)
        got = self._core.scatter(items, field, values)
        if got is True:
            return
        if type(got) is int:
            self._refuse_item(items, got, WriteSlot, "scatter")
        name = str.__str__(field) if isinstance(field, str) else None  # an exact str
        fs = self.schema.slots.get(name) if name is not None else None
        if fs is None or fs.field.is_ref:
            raise self._not_inline(field, "scatter writes")
        plain = admit_batch(fs.field, values, (len(items), *fs.field.fixed_shape), "scatter")
        # The copy in one compiled call here too, with no torch-function mode on: row by row
        # under it, an error part-way (a handle handed back meanwhile) would leave some rows
        # written.  The rules ask the plain tensor directly, so no mode sees anything.
        with torch._C.DisableTorchFunction():
            got = self._core.scatter(items, name, plain)
        if type(got) is int:  # Python run since the first call handed one back
            self._refuse_item(items, got, WriteSlot, "scatter")
        if got is not True:
            raise SchemaError(f"scatter: field {name!r}: torch made no plain copy of the batch")

    def _not_inline(self, field: object, action: str = "gather reads") -> SchemaError:
        fs = self.schema.slots.get(field) if isinstance(field, str) else None
        kind = "a ref field: open each with lease.tensor()" if fs else "not a field"
        if fs and action.startswith("scatter"):
            kind = "a ref field: write each with ws.write() or ws.alloc()"
        return SchemaError(f"{action} inline fields; {field!r} is {kind}")

    def _gather_refused(
        self, items: Sequence[Lease], field: str, out: object, got: bool | int
    ) -> None:
        """Why the compiled gather wrote nothing, in words; or, for the cases it leaves to
        Python (a torch-function mode, a tensor subclass), the gather done with torch."""
        self._check_open()
        if type(got) is int:
            self._refuse_item(items, got, Lease, "gather")
        fs = self.schema.slots.get(field) if isinstance(field, str) else None
        if fs is None or fs.field.is_ref:
            raise self._not_inline(field)
        check_out("gather", fs.field, out, (len(items), *fs.field.fixed_shape))
        assert isinstance(out, torch.Tensor)
        for i, lease in enumerate(items):
            out[i].copy_(lease._views().tensors[field])

    def _verify_all(self, leases: list[Lease]) -> None:
        """Verify every lease of a strict poll; on any failure none stays owned here."""
        bad = None
        try:
            bad = next(
                (x for x in leases if not self._parts.row_intact(x.slot, x.generation)), None
            )
            if bad is not None:
                raise CorruptTable(f"slot {bad.slot} row does not match its published checksum")
        except BaseException:
            for lease in leases:
                if lease is bad:
                    lease._end_with(int(Event.ABORT), int(State.HELD))
                else:
                    lease._hand_back(int(Event.REDELIVER))
            raise

    def _take_once(self) -> Lease | None:
        return self._settle(self._core.take(self))

    def _settle(self, got: Lease | None) -> Lease | None:
        """What a take found: a Lease (verified on a strict table), or None."""
        if got is None:
            return None
        if self._strict and not self._parts.row_intact(got.slot, got.generation):
            got.abort()
            raise CorruptTable(f"slot {got.slot} row does not match its published checksum")
        return got

    def _idle(self) -> None:
        """A take found nothing (called by the compiled take, at most every STRANDED_CHECK_S):
        reap dead participants, whose held rows come back, and queue READY rows that a dead
        or stopped process never queued, so no reader, sleeping or polling, waits on another
        process's progress for long."""
        self.reap()
        self._own.hot.requeue_stranded(STRANDED_AGE_NS)

    def cancel(self, tag: int) -> int:
        """Abort READY slots with this tag (request cancelled before pickup); returns count.

        Each slot goes READY -> RECLAIMING -> FREE in one compiled call; its queue entry
        goes stale, and the slot is claimable again once readers have passed it.
        """
        self._check_open()
        _check_tag(tag)
        return self._own.hot.cancel(tag)

    # -- recovery and observation -------------------------------------------------------
    def reap(self) -> dict[str, int]:
        """Reclaim slots of dead participants now; returns what was done, by reason."""
        self._check_open()
        return dict(self._member.reap())

    def collect(self) -> int:
        """Let go of ref tensors and arena pages whose slot has moved on; returns how many."""
        self._check_open()
        return self._refs.collect()

    def peers(self) -> list[Participant]:
        """The other participants attached now and alive (by their kernel-held locks)."""
        self._check_open()
        me = self.participant
        return [p for p in self._member.registry.participants(me) if p.alive and p.index != me]

    def creator_attached(self) -> bool:
        """Whether the process that created the table is still attached and alive: a
        consumer whose producer died (or closed) can drain the table and let go of it, so
        that a restart can replace it."""
        if self.created_here:
            return True
        h = self._header  # the creator's entry by identity: its pid and its stamp, alive
        return any(p.pid == h.creator_pid and p.attach_ns == h.created_ns for p in self.peers())

    @property
    def identity(self) -> tuple[int, int]:
        """(device, inode) of the object mapped: a table made later under the same name (a
        restart's) has another."""
        self._check_open()
        return self._segment.identity

    @property
    def unlinked(self) -> bool:
        """Whether the table's name was removed (a new table may have it now); this mapping
        keeps working until closed."""
        self._check_open()
        return self._segment.unlinked

    def stats(self) -> Stats:
        self._check_open()
        pages, blocks = self._arena.usage() if self._arena is not None else (0, 0)
        return Stats(
            states=self._own.occupancy(),
            counters={name: self._own.counter(name) for name in L.COUNTERS},
            queued=self._own.queued(),
            participants=len(self._member.registry.participants(self.participant)),
            overdue=len(self.overdue()),
            arena_bytes_used=pages * self.layout.arena_page_size,
            arena_blocks=blocks,
            pinned_here=self._refs.pinned()[0],
        )

    def overdue(self) -> list[SlotAge]:
        """Slots out of FREE for longer than `max_hold_s` (empty if it was not set)."""
        self._check_open()
        limit_s = self._header.max_hold_ns / 1e9
        if not limit_s:
            return []
        return [
            SlotAge(s.slot, s.state, s.owner, s.tag, s.age_s)
            for s in self._slots_now()
            if s.state is not None and s.state is not State.FREE and s.age_s > limit_s
        ]

    def holdings(self) -> list[Holding]:
        """Owned slots grouped by the call site that took them (empty if not traced)."""
        self._check_open()
        return slot_holdings(self._slots_now())

    def _slots_now(self) -> list[SlotSnapshot]:
        """The entries of the slots not FREE, read as `shmslots inspect` reads them."""
        mm, lay, created_ns = self._segment.mm, self.layout, self._header.created_ns
        return [read_slot(mm, lay, created_ns, slot) for slot in owned_slots(mm, lay)]

    def participants(self) -> list[Participant]:
        self._check_open()
        return self._member.registry.participants(self.participant)

    def check_consistency(self) -> list[str]:
        """Problems between bitmap and state words (meaningful when the table is quiet)."""
        self._check_open()
        problems = []
        for slot in range(self.slots):
            word = self._own.word(slot)
            if not known(word):
                problems.append(f"slot {slot}: state word {word:#x} holds no known state")
                continue
            owned = state_of(word) != State.FREE
            if owned != self._own.bit(slot):
                problems.append(
                    f"slot {slot}: bit {int(self._own.bit(slot))} but state {state_of(word).name}"
                )
            if state_of(word) in (State.READY, State.FREE) and owner_of(word):
                problems.append(f"slot {slot}: {state_of(word).name} with owner {owner_of(word)}")
        return problems

    def slot_info(self, slot: int) -> tuple[State, int, int, int]:
        """(state, generation, owner participant index or -1, tag) of one slot."""
        self._check_open()
        self.layout.check_slot(slot)
        word = self._own.word(slot)
        tag = self._atomics.load(self._own.entry(slot) + L.SLOT_TAG)
        if not known(word):
            raise CorruptTable(f"slot {slot} has state word {word:#x}: no state this version knows")
        return state_of(word), generation_of(word), owner_of(word) - 1, tag

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Detach.  Slots still owned here are handed back as if this process had died."""
        if self._closed:
            return
        self._member.leave()  # one compiled step, not repeated by a retried close()
        self._closed = True
        self._core.close()
        self._wake_waiters()
        self._member.drop_lock()
        leaked = self._rows.close()
        self._refs.drop_mapping()
        self._mv.release()
        self._atomics.release()
        self._own.hot.release()
        if leaked:
            warnings.warn(
                f"table {self.name!r} closed while views are referenced ({', '.join(leaked)}); "
                "its mapping is kept until the last of them is gone",
                stacklevel=2,
            )
        self._segment.close()  # unmaps now, or when the last tensor over the mapping goes

    def _wake_waiters(self) -> None:
        """Wake this object's threads asleep in a wait and let them leave it (bounded), so
        each takes its count of sleepers out of the table before the views go."""
        deadline = time.monotonic() + 2 * NAP_S
        while self._waiters and time.monotonic() < deadline:
            for seq in (self._own.publish_seq, self._own.release_seq):
                self._atomics.futex_wake(seq, 1 << 30)
            time.sleep(0.001)  # lets them run

    def unlink(self) -> None:
        """Remove the name; processes already attached keep working until they close."""
        self._segment.unlink()

    def __enter__(self) -> SlotTable:
        return self

    def __del__(self) -> None:
        """A table nobody closed: close it (its slots are handed back), and say so."""
        if getattr(self, "_closed", True):  # closed, or __init__ never finished
            return
        self.close()  # first: a warning raised as an error must not keep the table open
        warnings.warn(
            f"table {self.name!r} was garbage-collected without close(); it was closed",
            ResourceWarning,
            stacklevel=2,
            source=self,
        )

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close; the process that created the table also unlinks it, and then says so if rows
        were left queued, or held here (attaches after this cannot reach them; rows other
        consumers hold, they finish).  A table already unlinked from outside (`shmslots unlink
        --force`) just closes.  While an exception unwinds the block, nothing is added to it."""
        unlinking = self.created_here and not self._forked  # a forked child must not unlink
        left = self._rows_left() if unlinking and not self._closed else (0, 0)
        self.close()
        if unlinking:
            with contextlib.suppress(TableNotFound):
                self.unlink()
        if any(left) and et is None:
            warnings.warn(
                f"table {self.name!r} unlinked by its creator with {left[0]} row(s) queued and "
                f"{left[1]} held here: a consumer attaching later will not find them",
                RowsLeftWarning,
                stacklevel=2,
            )

    def _rows_left(self) -> tuple[int, int]:
        """(READY rows, rows HELD by this participant) now."""
        own = self._own
        words = [own.word(slot) for slot in range(self.slots)]
        queued = sum(1 for w in words if in_state(w, State.READY))
        held = sum(1 for w in words if in_state(w, State.HELD) and owner_of(w) == own.me)
        return queued, held

    def _wait(
        self,
        attempt: Callable[[], T | None],
        words: tuple[int, int, int],
        timeout: float | None,
        on_idle: Callable[[], object] | None = None,
    ) -> T | None:
        """`wait_for` on this table's futex `words` (sequence, sleepers, deadline), for
        `timeout` s (None: no limit); a close by another thread while it waits ends it with
        TableClosed, as every later call."""
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout >= 0
        ):  # NaN fails >= 0 too: it would never time out
            raise InvalidArgument(f"timeout must be a number >= 0 s or None, got {timeout!r}")
        self._waiters += 1
        try:
            return wait_for(self._atomics, attempt, *words, timeout, on_idle)
        except ValueError:
            self._check_open()
            raise
        finally:
            self._waiters -= 1

    def _check_open(self) -> None:
        if self._forked:
            raise TableClosed(
                f"table {self.name!r} was inherited through fork(); attach again in this process"
            )
        if self._closed:
            raise TableClosed(f"table {self.name!r} is closed")

    def _disown(self) -> None:
        """In a forked child: this table object is the parent's participant, not ours.

        Closing the child's copy of the lock descriptor leaves the parent's liveness
        lock to the parent alone (so its death is seen), and marking the object
        closed keeps the child from acting, or closing, in the parent's name.
        """
        if not self._closed:
            self._member.drop_lock()
            self._closed = self._forked = True
            self._core.close()

    def __repr__(self) -> str:
        return (
            f"<SlotTable {self.name!r} slots={self.slots} row={self.layout.row_size}B "
            f"participant={self.participant}{' closed' if self._closed else ''}>"
        )
