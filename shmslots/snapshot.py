"""A read-only look at a table, for people and monitoring (the CLI).

It maps the segment read-only and never registers as a participant, so
looking can never change a table, even while workers run at full speed.
Slot entries are read without locks: a slot whose state word changed while
its entry was being read is reported as changing, never as a mix of two
states.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import torch

from . import layout as L
from . import validate
from .errors import CorruptTable
from .handles import decode as decode_handle
from .participants import Participant, RegistryReader
from .rows import Rows
from .schema import Field, RowSchema
from .segment import Segment
from .states import State, generation_of, owner_of, state_of
from .validate import INSPECT_WAIT_S, read_schema, read_valid_header

_ENTRY = struct.Struct("<QQQQQ")  # word, tag, stamp, queue position, deliveries


@dataclass(frozen=True)
class SlotSnapshot:
    slot: int
    state: State | None  # None: the slot changed while it was read
    generation: int
    owner: int  # participant index, -1 for nobody
    tag: int
    age_s: float
    deliveries: int


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


@dataclass(frozen=True)
class DecodedRow:
    slot: int
    values: dict[str, torch.Tensor]  # inline fields, copied
    sealed_generation: int
    checksum_ok: bool
    # handle fields: the decoded handle (backend, shape, dtype, ...) or {"error": why}
    handles: dict[str, dict[str, Any]] = dataclass_field(default_factory=dict)


class TableView:
    """A read-only mapping of one table."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self._header = read_valid_header(segment, min(validate.INIT_WAIT_S, INSPECT_WAIT_S))
        self.layout = self._header.layout
        self.schema: RowSchema = read_schema(segment, self._header)
        self._registry = RegistryReader(memoryview(segment.mm), self.layout, segment.fd)
        self._rows = Rows(segment.mm, self.layout, self.schema)

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

    def _u64(self, offset: int) -> int:
        value: int = struct.unpack_from("<Q", self._segment.mm, offset)[0]
        return value

    def slot(self, slot: int) -> SlotSnapshot:
        self.layout.check_slot(slot)
        entry = self.layout.slot_entry(slot)
        mm = self._segment.mm
        word, tag, stamp, _, deliveries = _ENTRY.unpack_from(mm, entry)
        steady = self._u64(entry) == word
        age = max(0, time.monotonic_ns() - stamp) / 1e9
        try:
            state: State | None = state_of(word) if steady else None
        except ValueError:
            state = None  # not a state this version knows: show as changing, not garbage
        return SlotSnapshot(
            slot, state, generation_of(word), owner_of(word) - 1, tag, age, deliveries
        )

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
        )

    def row(self, slot: int) -> DecodedRow:
        """Copies of one row's fields and whether its checksum matches its seal."""
        self.layout.check_slot(slot)
        base = self.layout.row(slot)
        values = {}
        handles: dict[str, dict[str, Any]] = {}
        for name, fs in self.schema.slots.items():
            f = fs.field
            if f.is_handle:
                try:
                    handles[name] = decode_handle(self._rows.field_bytes(slot, name))
                except CorruptTable as exc:
                    handles[name] = {"error": str(exc)}
                continue
            raw = bytearray(self._segment.mm[base + fs.offset : base + fs.offset + f.nbytes])
            values[name] = (
                torch.frombuffer(raw, dtype=torch.uint8).view(f.torch_dtype).view(f.fixed_shape)
            )
        generation, crc = self._rows.sealed(slot)
        return DecodedRow(slot, values, generation, crc == self._rows.checksum(slot), handles)

    def close(self) -> None:
        self._rows.close()
        self._segment.close()

    def __enter__(self) -> TableView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
