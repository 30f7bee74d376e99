"""A read-only look at a table, for people and monitoring (the CLI).

It maps the segment read-only and never registers as a participant, so
looking can never change a table, even while workers run at full speed.
Slot entries are read without locks: a slot whose state word changed while
its entry was being read is reported as changing, never as a mix of two
states.  Rows are decoded with struct, not torch, so the CLI starts at once.
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from . import layout as L
from . import validate
from ._core import row_hash
from .errors import CorruptTable
from .participants import Participant, RegistryReader
from .ref_codec import decode as decode_ref
from .schema import DTYPE_CODES, Field, RowSchema
from .segment import Segment
from .states import State, generation_of, in_state, known, owner_of, state_of
from .tracing import CallSite, Holding, holdings, site_of
from .validate import INSPECT_WAIT_S, read_schema, read_valid_header

_ENTRY = struct.Struct("<QQQQQ")  # word, tag, stamp, queue position, deliveries (or deadline)


@dataclass(frozen=True)
class SlotSnapshot:
    slot: int
    state: State | None  # None: the slot changed while it was read
    generation: int
    owner: int  # participant index, -1 for nobody
    tag: int
    age_s: float
    deliveries: int
    site: CallSite | None = None  # the owner's call site, on a traced table
    frees_in_s: float | None = None  # QUARANTINED: until its window ends (< 0: it has)


@dataclass(frozen=True)
class Histogram:
    """One of a table's histograms (layout.HISTOGRAMS) as read: the count of each bucket
    (upper bounds layout.HIST_BOUNDS_NS, then the rest) and the sum of the nanoseconds
    observed.  The two are read apart: an observation in flight may show in one only."""

    counts: list[int]
    sum_ns: int

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def sum_s(self) -> float:
        return self.sum_ns / 1e9


@dataclass(frozen=True)
class TableSnapshot:
    name: str
    version: int
    creator_uid: int
    creator_pid: int
    created_ns: int
    slots: int
    row_size: int
    total_size: int
    strict: bool
    on_consumer_death: str
    max_hold_s: float | None
    fields: tuple[Field, ...]
    participants: list[Participant]
    counters: dict[str, int]
    states: dict[str, int]
    queued: int
    slot_states: list[SlotSnapshot]
    traced: bool = False
    histograms: dict[str, Histogram] = dataclass_field(default_factory=dict)  # layout.HISTOGRAMS


@dataclass(frozen=True)
class DecodedRow:
    slot: int
    values: dict[str, list[int] | list[float]]  # inline fields, flat, in row order
    sealed_generation: int
    checksum_ok: bool
    # ref fields: the decoded ref (backend, shape, dtype, ...) or {"error": why}
    refs: dict[str, dict[str, Any]] = dataclass_field(default_factory=dict)


def owned_slots(mm: mmap.mmap, lay: L.Layout) -> list[int]:
    """The slots whose state word is not FREE, every word read in one strided copy (a big
    table's FREE slots cost next to nothing).  The words themselves, not the ownership bitmap:
    a claimer stopped between its CAS and its bit owns a slot the bitmap does not show."""
    start = lay.slot_states
    with (
        memoryview(mm) as whole,
        whole[start : start + lay.slots * L.SLOT_ENTRY] as entries,
        entries.cast("Q") as u64s,
        u64s[:: L.SLOT_ENTRY // 8] as words,
    ):
        return [s for s, word in enumerate(words.tolist()) if not in_state(word, State.FREE)]


def read_slot(mm: mmap.mmap, lay: L.Layout, created_ns: int, slot: int) -> SlotSnapshot:
    """One slot's entry as it is now, read without locks: a slot whose state word changed
    while it was read, or holds no state this version knows, reads as changing (state None),
    never as a mix of two states.  How a table is observed, by TableView and by a table's
    own participant (SlotTable.overdue, holdings) alike."""
    entry = lay.slot_entry(slot)
    word, tag, stamp, _, deliveries = _ENTRY.unpack_from(mm, entry)
    steady = struct.unpack_from("<Q", mm, entry)[0] == word
    if stamp:
        age = max(0, time.monotonic_ns() - stamp) / 1e9
    else:  # never moved: in its first state since the table was made
        age = max(0, time.time_ns() - created_ns) / 1e9
    state = state_of(word) if steady and known(word) else None
    site = site_of(mm, lay, slot, word) if state is not None else None
    frees_in = None
    if state is State.QUARANTINED:  # its deliveries word is its deadline (layout.py)
        deadline, deliveries = deliveries, 0
        frees_in = (deadline - time.monotonic_ns()) / 1e9 if deadline else None
    return SlotSnapshot(
        slot, state, generation_of(word), owner_of(word) - 1, tag, age, deliveries, site, frees_in
    )


class TableView:
    """A read-only mapping of one table."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self._header = read_valid_header(segment, min(validate.INIT_WAIT_S, INSPECT_WAIT_S))
        self.layout = self._header.layout
        self.schema: RowSchema = read_schema(segment, self._header)
        self._registry = RegistryReader(memoryview(segment.mm), self.layout, segment.fd)

    @classmethod
    def open(cls, name: str) -> TableView:
        segment = Segment.open(name, writable=False)
        try:
            return cls(segment)
        except BaseException:
            segment.close()
            raise

    @property
    def name(self) -> str:
        return self._segment.name

    def live_participants(self) -> list[Participant]:
        """Participants still alive (their kernel-held lock says so), without a full snapshot."""
        return [p for p in self._registry.participants() if p.alive]

    def unlinked(self) -> bool:
        """Whether the table's name was removed (this mapping stays readable meanwhile)."""
        return self._segment.unlinked

    def _u64(self, offset: int) -> int:
        value: int = struct.unpack_from("<Q", self._segment.mm, offset)[0]
        return value

    def _histogram(self, offset: int) -> Histogram:
        counts = struct.unpack_from(f"<{L.HIST_BUCKETS}Q", self._segment.mm, offset)
        return Histogram(list(counts), self._u64(offset + L.HIST_SUM))

    def slot(self, slot: int) -> SlotSnapshot:
        self.layout.check_slot(slot)
        return read_slot(self._segment.mm, self.layout, self._header.created_ns, slot)

    def snapshot(self) -> TableSnapshot:
        h = self._header
        lay = self.layout
        slots = [self.slot(i) for i in range(lay.slots)]
        states = {s.name: 0 for s in State}
        states["CHANGING"] = 0
        for s in slots:
            states[s.state.name if s.state is not None else "CHANGING"] += 1
        head = self._u64(lay.sync + L.RING_HEAD)
        tail = self._u64(lay.sync + L.RING_TAIL)
        return TableSnapshot(
            name=self.name,
            version=h.version,
            creator_uid=h.creator_uid,
            creator_pid=h.creator_pid,
            created_ns=h.created_ns,
            slots=lay.slots,
            row_size=lay.row_size,
            total_size=lay.total_size,
            strict=bool(h.flags & L.FLAG_STRICT),
            on_consumer_death=("drop" if h.flags & L.FLAG_DROP_ON_CONSUMER_DEATH else "redeliver"),
            max_hold_s=h.max_hold_ns / 1e9 if h.max_hold_ns else None,
            fields=self.schema.fields,
            participants=self._registry.participants(),
            counters={n: self._u64(lay.counters + L.COUNTER_OFFSET[n]) for n in L.COUNTERS},
            states=states,
            queued=max(0, tail - head),
            slot_states=slots,
            traced=bool(lay.trace_sites),
            histograms={
                name: self._histogram(lay.histograms + offset)
                for name, offset in L.HISTOGRAM_OFFSET.items()
            },
        )

    def dead_owned(self, snap: TableSnapshot) -> list[SlotSnapshot]:
        """Slots owned by dead participants, each confirmed by a second read of its slot.

        The slots are read before the registry; a participant that handed its slots back
        and detached in between would otherwise look like a dead owner.
        """
        confirmed = []
        for s in dead_owned(snap):
            again = self.slot(s.slot)
            if (again.state, again.generation, again.owner) == (s.state, s.generation, s.owner):
                confirmed.append(s)
        return confirmed

    def row(self, slot: int) -> DecodedRow:
        """The values of one row's fields and whether its checksum matches its seal."""
        self.layout.check_slot(slot)
        mm = self._segment.mm
        values: dict[str, list[int] | list[float]] = {}
        refs: dict[str, dict[str, Any]] = {}
        for name, fs in self.schema.slots.items():
            f = fs.field
            start = self.layout.column(fs.before) + fs.item_len * slot
            if f.is_ref:
                try:
                    refs[name] = decode_ref(bytes(mm[start : start + f.nbytes]))
                except CorruptTable as exc:
                    refs[name] = {"error": str(exc)}
                continue
            values[name] = _decode(f, mm, start)
        generation, ok = self.seal(slot)
        return DecodedRow(slot, values, generation, ok, refs)

    def seal(self, slot: int) -> tuple[int, bool]:
        """(the generation a row was sealed at, whether its bytes hash to its seal)."""
        mm = self._segment.mm
        items = []
        for fs in self.schema.slots.values():
            start = self.layout.column(fs.before) + fs.item_len * slot
            items.append(memoryview(mm)[start : start + fs.field.nbytes])
        generation, crc = L.SEAL.unpack_from(mm, self.layout.seal(slot))
        try:
            return generation, crc == row_hash(items)
        finally:
            for item in items:
                item.release()

    def broken_seals(self, snap: TableSnapshot) -> list[SlotSnapshot]:
        """Queued rows (READY) that do not match their seal (bytes or generation), each
        confirmed by a second read of its slot (a row taken and rewritten meanwhile is no
        finding).  HELD rows are their holder's: a lease may change its row in place."""
        broken = []
        for s in snap.slot_states:
            if s.state is not State.READY:
                continue
            generation, ok = self.seal(s.slot)
            again = self.slot(s.slot)
            if not (ok and generation == s.generation) and (again.state, again.generation) == (
                s.state,
                s.generation,
            ):
                broken.append(s)
        return broken

    def close(self) -> None:
        self._segment.close()

    def __enter__(self) -> TableView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def by_index(snap: TableSnapshot) -> dict[int, Participant]:
    return {p.index: p for p in snap.participants}


def in_use(snap: TableSnapshot) -> list[SlotSnapshot]:
    """Every slot that is not FREE (a slot read mid-change included)."""
    return [s for s in snap.slot_states if s.state is not State.FREE]


def dead_owned(snap: TableSnapshot) -> list[SlotSnapshot]:
    """Owned slots whose owner is not a live participant."""
    parts = by_index(snap)
    return [
        s
        for s in in_use(snap)
        if s.state is not None and s.owner >= 0 and not (s.owner in parts and parts[s.owner].alive)
    ]


def oldest(snap: TableSnapshot) -> SlotSnapshot | None:
    steady = [s for s in in_use(snap) if s.state is not None]
    return max(steady, key=lambda s: s.age_s, default=None)


def slot_holdings(slots: Iterable[SlotSnapshot], older_than: float | None = None) -> list[Holding]:
    """Owned slots (at least `older_than` old) grouped by the call site that took them."""
    return holdings(
        (s.slot, s.state.name, s.owner, s.site, s.age_s)
        for s in slots
        if s.state not in (None, State.FREE) and (older_than is None or s.age_s >= older_than)
    )


def quantile(counts: list[int], q: float) -> float | None:
    """The q-quantile in seconds of a histogram's bucket counts, interpolated inside its
    bucket as Prometheus' histogram_quantile does; None if empty.  Past the last bound it
    is that bound (the histogram cannot say more)."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    below = 0
    for i, n in enumerate(counts):
        if n and below + n >= rank:
            if i == len(L.HIST_BOUNDS_NS):
                return L.HIST_BOUNDS_NS[-1] / 1e9
            low = L.HIST_BOUNDS_NS[i - 1] if i else 0
            return (low + (L.HIST_BOUNDS_NS[i] - low) * (rank - below) / n) / 1e9
        below += n
    return L.HIST_BOUNDS_NS[-1] / 1e9


def _decode(f: Field, buffer: Any, offset: int) -> list[int] | list[float]:
    """An inline field's elements as Python numbers, as torch's tolist() would give them."""
    n = f.nbytes // f.itemsize
    raw = struct.unpack_from(f"<{n}{DTYPE_CODES[f.dtype]}", buffer, offset)
    if f.dtype != "bfloat16":
        return list(raw)
    return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *(h << 16 for h in raw))))
