"""Byte layout of a table segment: every offset, computed once, in one place.

::

    0     ┌──────────────────────────────────────────────────────────────┐
          │ HEADER        256 B   magic, version, sizes, region offsets   │
    256   ├──────────────────────────────────────────────────────────────┤
          │ SYNC          4 x 64 B, one word family per cache line:       │
          │               ring head │ ring tail │ publish seq + sleepers  │
          │               + sleep deadline │ release seq + sleepers + dl  │
    512   ├──────────────────────────────────────────────────────────────┤
          │ COUNTERS      16 x 64 B, one u64 per cache line (claims,      │
          │               publishes, … see COUNTERS)                     │
    1536  ├──────────────────────────────────────────────────────────────┤
          │ HISTOGRAMS    2 x 3 x 64 B: u64 counts per bucket of how long │
          │               slots stay HELD and rows wait READY, then the  │
          │               u64 sum of the nanoseconds observed            │
    1920  ├──────────────────────────────────────────────────────────────┤
          │ SCHEMA        msgpack field list, padded to 64 B              │
          ├──────────────────────────────────────────────────────────────┤
          │ REGISTRY      capacity x 128 B, one entry per participant     │
          ├──────────────────────────────────────────────────────────────┤
          │ BITMAP        ⌈slots/64⌉ x u64: bit i set ⇔ slot i owned      │
          ├──────────────────────────────────────────────────────────────┤
          │ SLOT STATES   slots x 64 B: state word, tag, stamp,           │
          │               queue position, deliveries, call site record   │
          ├──────────────────────────────────────────────────────────────┤
          │ READY RING    ring_capacity x u64 cells (position, slot)      │
          ├──────────────────────────────────────────────────────────────┤
          │ SEALS         slots x 16 B: generation and checksum each row   │
          │               was published with (u64, u32)                  │
          ├──────────────────────────────────────────────────────────────┤
          │ SITES         participants x trace_sites x 192 B: the call    │
          │               sites each participant's owners were made at   │
          │               (only on a table made with trace=True)         │
          ├──────────────────────────────────────────────────────────────┤ page aligned
          │ COLUMNS       one per field, in schema order: slots x item_len │
          │               bytes, slot i's item at column + item_len * i   │
          │               (schema.py: item_len is a multiple of 64)      │
          ├──────────────────────────────────────────────────────────────┤
          │ ARENA TABLE   arena_pages x u64: (slot + 1, generation) that  │
          │               owns each page, 0 = free  (csrc/arena.c)        │
          ├──────────────────────────────────────────────────────────────┤ page aligned
          │ ARENA         arena_pages x arena_page_size: tensor data that │
          │               ref fields refer to                            │
          └──────────────────────────────────────────────────────────────┘

Everything is little-endian.  Regions start on 64-byte cache lines so that
unrelated words never share a line; SYNC words of different roles sit on
separate lines for the same reason.  `Layout.read` is the validator: a
segment whose stored offsets differ from the ones recomputed from its sizes
is refused, so no later access can fall outside the mapping.
"""

from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass

from ._core import load_acquire, store_release
from .errors import CorruptTable, IncompatibleTable, InvalidArgument, InvalidSlot
from .units import fmt_bytes

MAGIC = b"SHMSLOTS"
# The magic as the word that holds it.  It is stored last with a release store and read with
# an acquire load, so whoever sees it also sees the header and schema stored before it, on
# weak-memory CPUs (Arm) too, where plain copies may become visible in any order.
_MAGIC_WORD = int.from_bytes(MAGIC, sys.byteorder)
# 12: long items' checksum by striped lanes (csrc/rowhash.c), under half wyhash's time;
# 11: a ref's bytes are a fixed binary record for the arena (csrc/refcodec.c), not msgpack;
# 10: handle fields renamed ref fields (the schema stores kind "ref");
# 9: a QUARANTINED state (its deadline in the slot entry) and its two counters;
# 8: a u64 sum of the observed nanoseconds after each histogram's buckets;
# 7: one column per field (rows are addressed as SGLang's metadata buffers), seals beside
#    the slot states, uint64/int8/int16/bool fields;
# 6: hold-time histograms, call-site tracing;
# 5: publish turns READY before queueing, deliveries counted at take, waiters' deadlines;
# 4: row checksum by wyhash; 3: a counter per cache line; 2: row_hash over crc32
VERSION = 12
CACHE_LINE = 64
PAGE = 4096

HEADER_SIZE = 256
# name, struct code; the order is the byte order in the header.
_HEADER_FIELDS = (
    ("magic", "8s"),
    ("version", "I"),
    ("header_size", "I"),
    ("total_size", "Q"),
    ("creator_uid", "I"),
    ("creator_pid", "I"),
    ("created_ns", "Q"),
    ("slots", "I"),
    ("row_size", "I"),
    ("registry_capacity", "I"),
    ("ring_capacity", "I"),
    ("flags", "I"),
    ("schema_len", "I"),
    ("max_hold_ns", "Q"),
    ("sync", "Q"),
    ("counters", "Q"),
    ("histograms", "Q"),
    ("schema", "Q"),
    ("registry", "Q"),
    ("bitmap", "Q"),
    ("slot_states", "Q"),
    ("ring", "Q"),
    ("columns", "Q"),
    ("arena_page_size", "I"),
    ("arena_pages", "I"),
    ("arena_table", "Q"),
    ("arena", "Q"),
    ("trace_sites", "I"),
    ("sites", "Q"),
    ("seals", "Q"),
)
HEADER = struct.Struct("<" + "".join(code for _, code in _HEADER_FIELDS))
assert HEADER.size <= HEADER_SIZE

FLAG_STRICT = 1
FLAG_DROP_ON_CONSUMER_DEATH = 2

# SYNC region: word offsets relative to the region start.
SYNC_SIZE = 4 * CACHE_LINE
RING_HEAD = 0
RING_TAIL = CACHE_LINE
PUBLISH_SEQ = 2 * CACHE_LINE  # u32 futex word, bumped when a slot becomes READY
READERS_WAITING = 2 * CACHE_LINE + 8  # u64 sleepers on PUBLISH_SEQ
READERS_UNTIL = 2 * CACHE_LINE + 16  # u64 CLOCK_MONOTONIC ns the last sleeper may sleep to
RELEASE_SEQ = 3 * CACHE_LINE  # u32 futex word, bumped when a slot becomes FREE
CLAIMERS_WAITING = 3 * CACHE_LINE + 8
CLAIMERS_UNTIL = 3 * CACHE_LINE + 16

COUNTERS = (
    "claims",
    "reserves",
    "publishes",
    "takes",
    "releases",
    "aborts",
    "cancels",
    "leaked_views",
    "reclaimed_writing",
    "reclaimed_reserved",
    "reclaimed_held_dropped",
    "redelivered",
    "participants_reaped",
    "quarantined",
    "quarantines_ended",
)
# A writer bumps claims and publishes and a reader takes and releases on every row:
# sharing a line, they would bounce it between the two cores at each step.
COUNTERS_SIZE = 16 * CACHE_LINE
COUNTER_OFFSET = {name: i * CACHE_LINE for i, name in enumerate(COUNTERS)}
assert len(COUNTERS) * CACHE_LINE <= COUNTERS_SIZE

# HISTOGRAMS: fixed buckets, upper bounds in ns (a 1-3-10 series, 1 µs .. 100 s, then +Inf).
# Counts are per bucket (not cumulative), so an observation is one atomic add on its bucket
# and one on the sum of observed nanoseconds (Prometheus' `_sum`; `_count` is the buckets').
HIST_BOUNDS_NS: tuple[int, ...] = (*(m * 10**e for e in range(3, 11) for m in (1, 3)), 10**11)
HIST_BUCKETS = len(HIST_BOUNDS_NS) + 1
HIST_SUM = 8 * HIST_BUCKETS  # u64, relative to the histogram: right after its buckets
HIST_SIZE = 3 * CACHE_LINE  # one histogram: its buckets and sum, on lines of its own
HISTOGRAMS = ("held", "ready_wait")  # take -> release/abort; publish -> take
HISTOGRAM_OFFSET = {name: i * HIST_SIZE for i, name in enumerate(HISTOGRAMS)}
HISTOGRAMS_SIZE = len(HISTOGRAMS) * HIST_SIZE
assert HIST_SUM + 8 <= HIST_SIZE

# REGISTRY entry (relative to the entry start).
REGISTRY_ENTRY = 128
REG_STATE = 0  # u64: 0 free, 1 active
REG_PID = 8  # u32
REG_START_TICKS = 16  # u64: process start time, clock ticks since boot
REG_ATTACH_NS = 24  # u64: wall clock
REG_LAST_SEEN_NS = 32  # u64: wall clock
REG_ROLE = 40  # 16 bytes, utf-8, NUL padded
REG_NAME = 56  # 32 bytes
ROLE_LEN = 16
NAME_LEN = 32
MAX_PARTICIPANTS = 0xFFFE  # owner ids are 16 bits, 0 means nobody

# SLOT STATES entry (relative to the entry start).
SLOT_ENTRY = 64
SLOT_WORD = 0  # u64 state word, see states.py
SLOT_TAG = 8  # u64 request tag
SLOT_STAMP = 16  # u64 CLOCK_MONOTONIC ns of the last transition
SLOT_QUEUE_POS = 24  # u64 ready-ring position of the current publication
SLOT_DELIVERIES = 32  # u64 times this publication was taken (counted by take itself)
# A QUARANTINED slot is never published at its generation, so its deliveries word holds the
# CLOCK_MONOTONIC ns its window ends (0: not stored yet); the next claim sets it to 0.  Not
# the queue position: a publisher stopped before its push stores that into a slot that
# may have moved on since.
SLOT_DEADLINE = SLOT_DELIVERIES
# Call site of the current owner (traced tables only), written by the owner after the step
# that made it owner: valid while SLOT_SITE_WORD equals the slot's state word.
SLOT_SITE_WORD = 40  # u64 the state word the site was recorded under
SLOT_SITE = 48  # u64 index into the owner's site table (NO_SITE: its table was full)
SLOT_SITE_NS = 56  # u64 CLOCK_MONOTONIC ns of the recording
NO_SITE = 0xFFFF_FFFF

# SITES entry: one interned call site, written once, before any slot names it.
SITE_ENTRY = 192
SITE_LINE = 0  # u32
SITE_FILE_LEN = 4  # u16
SITE_FUNC_LEN = 6  # u16
SITE_FUNC = 8  # 64 bytes, utf-8
SITE_FILE = 72  # 120 bytes, utf-8: the path's tail when it is longer
SITE_FUNC_MAX = 64
SITE_FILE_MAX = 120
DEFAULT_TRACE_SITES = 32
MAX_TRACE_SITES = 4096
NO_QUEUE_POS = 0xFFFF_FFFF_FFFF_FFFF

# SEALS entry (relative to the entry start).
SEAL_ENTRY = 16
SEAL_GENERATION = 0  # u64 generation the row was published under
SEAL_CHECKSUM = 8  # u32 checksum of the row's items (csrc/rowcodec.c)
SEAL = struct.Struct("<QI")  # generation, checksum, as at SEAL_GENERATION and SEAL_CHECKSUM

MAX_SLOTS = 1 << 20  # ring cells carry a 20-bit slot index
MAX_ARENA_PAGES = 1 << 24
MAX_ARENA_PAGE = 1 << 30


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def arena_pages(arena_bytes: int, page_size: int) -> int:
    """Pages for an arena of `arena_bytes`; refusals speak in bytes, the unit the caller used."""
    if not isinstance(arena_bytes, int) or isinstance(arena_bytes, bool) or arena_bytes < 0:
        raise InvalidArgument(f"arena_bytes must be a non-negative int, got {arena_bytes!r}")
    if not arena_bytes:
        return 0
    if not (
        isinstance(page_size, int) and PAGE <= page_size <= MAX_ARENA_PAGE and page_size % PAGE == 0
    ):
        raise InvalidArgument(
            f"arena_page must be a multiple of {PAGE} bytes up to {fmt_bytes(MAX_ARENA_PAGE)}, "
            f"got {page_size!r}"
        )
    limit = MAX_ARENA_PAGES * page_size
    if arena_bytes > limit:
        raise InvalidArgument(
            f"arena_bytes of {fmt_bytes(arena_bytes)} is more than an arena of "
            f"{fmt_bytes(page_size)} pages holds: at most {fmt_bytes(limit)} "
            f"({MAX_ARENA_PAGES:,} pages; a bigger arena_page allows more)"
        )
    return -(-arena_bytes // page_size)


@dataclass(frozen=True)
class Layout:
    """Absolute offsets and sizes of every region of one table."""

    slots: int
    row_size: int
    registry_capacity: int
    ring_capacity: int
    schema_len: int
    sync: int
    counters: int
    histograms: int
    schema: int
    registry: int
    bitmap: int
    slot_states: int
    ring: int
    seals: int
    columns: int
    arena_page_size: int
    arena_pages: int
    arena_table: int
    arena: int
    total_size: int
    # sites per participant; 0: the table is not traced (the header's trace switch)
    trace_sites: int = 0
    sites: int = 0

    @property
    def bitmap_words(self) -> int:
        return (self.slots + 63) // 64

    @classmethod
    def compute(
        cls,
        slots: int,
        row_size: int,
        registry_capacity: int,
        schema_len: int,
        arena_page_size: int = 0,
        arena_pages: int = 0,
        trace_sites: int = 0,
    ) -> Layout:
        if not 1 <= slots <= MAX_SLOTS:
            raise InvalidArgument(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
        if not 1 <= registry_capacity <= MAX_PARTICIPANTS:
            raise InvalidArgument(f"participants must be in 1..{MAX_PARTICIPANTS}")
        if not 0 <= arena_pages <= MAX_ARENA_PAGES:
            raise InvalidArgument(f"arena pages must be in 0..{MAX_ARENA_PAGES}")
        if arena_pages and not (
            PAGE <= arena_page_size <= MAX_ARENA_PAGE and arena_page_size % PAGE == 0
        ):
            raise InvalidArgument(
                f"arena page size must be a multiple of {PAGE} up to {MAX_ARENA_PAGE}"
            )
        if not 0 <= trace_sites <= MAX_TRACE_SITES:
            raise InvalidArgument(f"trace sites must be in 0..{MAX_TRACE_SITES}")
        ring_capacity = 2 * slots
        sync = HEADER_SIZE
        counters = sync + SYNC_SIZE
        histograms = counters + COUNTERS_SIZE
        schema = histograms + HISTOGRAMS_SIZE
        registry = _align(schema + schema_len, CACHE_LINE)
        bitmap = registry + registry_capacity * REGISTRY_ENTRY
        slot_states = _align(bitmap + 8 * ((slots + 63) // 64), CACHE_LINE)
        ring = slot_states + slots * SLOT_ENTRY
        seals = _align(ring + 8 * ring_capacity, CACHE_LINE)
        sites = _align(seals + slots * SEAL_ENTRY, CACHE_LINE)
        columns = _align(sites + registry_capacity * trace_sites * SITE_ENTRY, PAGE)
        arena_table = _align(columns + slots * row_size, CACHE_LINE)
        arena = _align(arena_table + 8 * arena_pages, PAGE)
        total = _align(arena + arena_pages * arena_page_size, PAGE)
        return cls(
            slots, row_size, registry_capacity, ring_capacity, schema_len,
            sync, counters, histograms, schema, registry, bitmap, slot_states, ring, seals,
            columns,
            arena_page_size if arena_pages else 0, arena_pages, arena_table, arena, total,
            trace_sites, sites,
        )  # fmt: skip

    def check_slot(self, slot: object) -> None:
        """InvalidSlot unless `slot` is an int naming one of this table's slots."""
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.slots:
            raise InvalidSlot(f"slot {slot!r} out of range 0..{self.slots - 1}")

    def slot_entry(self, slot: int) -> int:
        return self.slot_states + slot * SLOT_ENTRY

    def column(self, before: int) -> int:
        """Where the column of a field with `before` item bytes ahead of it starts."""
        return self.columns + self.slots * before

    def seal(self, slot: int) -> int:
        return self.seals + slot * SEAL_ENTRY

    def registry_entry(self, index: int) -> int:
        return self.registry + index * REGISTRY_ENTRY

    def site_entry(self, participant: int, site: int) -> int:
        return self.sites + (participant * self.trace_sites + site) * SITE_ENTRY

    def pack_header(
        self, *, uid: int, pid: int, created_ns: int, flags: int, max_hold_ns: int, magic: bytes
    ) -> bytes:
        return HEADER.pack(
            magic,
            VERSION,
            HEADER_SIZE,
            self.total_size,
            uid,
            pid,
            created_ns,
            self.slots,
            self.row_size,
            self.registry_capacity,
            self.ring_capacity,
            flags,
            self.schema_len,
            max_hold_ns,
            self.sync,
            self.counters,
            self.histograms,
            self.schema,
            self.registry,
            self.bitmap,
            self.slot_states,
            self.ring,
            self.columns,
            self.arena_page_size,
            self.arena_pages,
            self.arena_table,
            self.arena,
            self.trace_sites,
            self.sites,
            self.seals,
        )


@dataclass(frozen=True)
class Header:
    """The decoded, validated header of a segment."""

    version: int
    creator_uid: int
    creator_pid: int
    created_ns: int
    flags: int
    max_hold_ns: int
    layout: Layout


# The largest schema blob a valid table can hold: 64 fields of at most ~300 bytes
# each encode to under 20 KiB.  Checked before the blob is copied or decoded, so a
# hostile header cannot make an attacher copy gigabytes.
MAX_SCHEMA_LEN = 64 * 1024


def publish_magic(mm: mmap.mmap) -> None:
    """Store the magic: the creator's last write, after the header and the schema."""
    store_release(mm, 0, _MAGIC_WORD)


def magic_published(mm: mmap.mmap) -> bool:
    """Whether a creator has stored its first word (read_header says if it is our magic)."""
    return len(mm) >= 8 and load_acquire(mm, 0) != 0


def read_header(raw: bytes, segment_size: int) -> Header:
    """Decode and validate a header; refuse anything inconsistent with a clear error."""
    if len(raw) < HEADER.size or segment_size < HEADER_SIZE:
        raise IncompatibleTable(f"segment of {segment_size} bytes is too small for a header")
    values = dict(zip((name for name, _ in _HEADER_FIELDS), HEADER.unpack_from(raw), strict=True))
    if values["magic"] != MAGIC:
        raise IncompatibleTable(f"not a shmslots table (magic {values['magic']!r})")
    if values["version"] != VERSION:
        raise IncompatibleTable(
            f"table format version {values['version']}, this shmslots reads version {VERSION}"
        )
    if values["header_size"] != HEADER_SIZE:
        raise CorruptTable(f"header size {values['header_size']}, expected {HEADER_SIZE}")
    if not 0 < values["schema_len"] <= MAX_SCHEMA_LEN:
        raise CorruptTable(f"schema length {values['schema_len']} is not in 1..{MAX_SCHEMA_LEN}")
    if values["total_size"] != segment_size:
        raise CorruptTable(
            f"header says {values['total_size']} bytes, segment has {segment_size} (truncated?)"
        )
    try:
        layout = Layout.compute(
            values["slots"],
            values["row_size"],
            values["registry_capacity"],
            values["schema_len"],
            values["arena_page_size"],
            values["arena_pages"],
            values["trace_sites"],
        )
    except ValueError as exc:
        raise CorruptTable(f"impossible sizes in header: {exc}") from None
    for region in (
        "sync",
        "counters",
        "histograms",
        "schema",
        "registry",
        "bitmap",
        "slot_states",
        "ring",
        "seals",
        "columns",
        "arena_table",
        "arena",
        "sites",
    ):
        if values[region] != getattr(layout, region):
            raise CorruptTable(
                f"{region} offset {values[region]} does not match the layout "
                f"({getattr(layout, region)})"
            )
    if values["ring_capacity"] != layout.ring_capacity or layout.total_size != segment_size:
        raise CorruptTable("ring capacity or total size does not match the layout")
    if values["arena_page_size"] != layout.arena_page_size:
        raise CorruptTable("arena page size is set for a table without an arena")
    if values["row_size"] % CACHE_LINE or values["row_size"] < CACHE_LINE:
        raise CorruptTable(f"row size {values['row_size']} is not a positive multiple of 64")
    return Header(
        values["version"],
        values["creator_uid"],
        values["creator_pid"],
        values["created_ns"],
        values["flags"],
        values["max_hold_ns"],
        layout,
    )
