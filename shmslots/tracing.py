"""Call sites of owners: which code took each owned slot, readable by any process.

On a traced table (`SlotTable.create(..., trace=True)`, or `SHMSLOTS_TRACE=1` in the
creating process's environment) every participant has a small table of interned call
sites in the segment (layout.py, SITES).  Each call that makes a new owner (claim,
reserve, open_reserved, take, poll) walks the stack to the first frame outside
shmslots, interns it, and writes the site's index and the time into the slot's entry,
under the state word the slot has as the new owner's.  So the CLI, or any process,
reads who took a slot without the owner's help, and after the owner died.

The record is written in Python after the compiled step made the handle: it is
diagnostic data only, valid exactly while the slot's state word equals the word it
was recorded under, and never read by the protocol.  This module is torch-free.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import CodeType

from . import layout as L
from ._core import AtomicView
from .states import owner_of, pack

TRACE_ENV = "SHMSLOTS_TRACE"
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SITE_HEAD = struct.Struct("<IHH")  # line, file length, function length
_RECORD = struct.Struct("<QQQ")  # state word, site index, recorded at (monotonic ns)
_SITE_NS = struct.Struct("<QQ")  # the record's last two words
assert L.SLOT_SITE == L.SLOT_SITE_WORD + 8 and L.SLOT_SITE_NS == L.SLOT_SITE + 8


def trace_from_env() -> bool:
    """Whether SHMSLOTS_TRACE asks for tracing (so a server restarts traced, code unchanged)."""
    return os.environ.get(TRACE_ENV, "").strip().lower() not in ("", "0", "no", "false", "off")


@dataclass(frozen=True)
class CallSite:
    """Where an owner was made: the first frame outside shmslots."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"

    @property
    def short(self) -> str:
        """The file's base name, for tables and messages; JSON carries the whole path."""
        return f"{os.path.basename(self.file)}:{self.line} in {self.function}"


UNKNOWN_SITE = CallSite("(more call sites than the table holds)", 0, "?")


def _clip(text: str, size: int, keep_tail: bool) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) <= size:
        return raw
    cut = raw[-size:] if keep_tail else raw[:size]
    return cut.decode("utf-8", "ignore").encode("utf-8")


class SiteWriter:
    """One participant's call sites: interned here, written once each into its site table."""

    def __init__(self, atomics: AtomicView, mm: memoryview, lay: L.Layout, participant: int):
        self._a = atomics
        self._mv = mm
        self._layout = lay
        self._participant = participant
        self._owner = participant + 1
        self._records = lay.slot_states + L.SLOT_SITE  # slot 0's; one SLOT_ENTRY apart
        # (file, line) -> site index: str hashes are cached, a code object's are not
        self._interned: dict[tuple[str, int], int] = {}

    def _intern(self, code: CodeType, line: int) -> int:
        """A new site's index, its entry written first (NO_SITE once the table is full)."""
        index = len(self._interned)
        if index >= self._layout.trace_sites:
            return L.NO_SITE
        base = self._layout.site_entry(self._participant, index)
        file = _clip(code.co_filename, L.SITE_FILE_MAX, keep_tail=True)
        func = _clip(code.co_qualname, L.SITE_FUNC_MAX, keep_tail=False)
        _SITE_HEAD.pack_into(self._mv, base, line, len(file), len(func))
        self._mv[base + L.SITE_FUNC : base + L.SITE_FUNC + len(func)] = func
        self._mv[base + L.SITE_FILE : base + L.SITE_FILE + len(file)] = file
        self._interned[code.co_filename, line] = index  # last: an interrupt above rewrites it
        return index

    def record(self, handles: Iterable[tuple[int, int]], state: int) -> None:
        """Record the first frame outside shmslots as the call site of these
        (slot, generation) owners, now in `state` (an int: IntEnum's int() is slow)."""
        frame = sys._getframe(1)
        while frame.f_code.co_filename.startswith(_PACKAGE) and frame.f_back is not None:
            frame = frame.f_back
        code, line = frame.f_code, frame.f_lineno
        site = self._interned.get((code.co_filename, line))
        if site is None:
            site = self._intern(code, line)
        now = time.monotonic_ns()
        for slot, generation in handles:
            at = self._records + slot * L.SLOT_ENTRY
            # The old record's word names an ownership that has ended, so no reader pairs
            # it with the current word; the new word goes in last.
            _SITE_NS.pack_into(self._mv, at, site, now)
            self._a.store(at - 8, pack(generation, self._owner, state))


def read_site(
    mm: mmap.mmap | memoryview | bytes, lay: L.Layout, participant: int, index: int
) -> CallSite:
    """The interned site `index` of `participant`; the segment is untrusted, so lengths are
    clipped and bytes decoded leniently."""
    if index == L.NO_SITE or not 0 <= index < lay.trace_sites:
        return UNKNOWN_SITE
    base = lay.site_entry(participant, index)
    line, file_len, func_len = _SITE_HEAD.unpack_from(mm, base)
    file_len, func_len = min(file_len, L.SITE_FILE_MAX), min(func_len, L.SITE_FUNC_MAX)
    file = bytes(mm[base + L.SITE_FILE : base + L.SITE_FILE + file_len])
    func = bytes(mm[base + L.SITE_FUNC : base + L.SITE_FUNC + func_len])
    return CallSite(file.decode("utf-8", "replace"), line, func.decode("utf-8", "replace"))


def site_of(
    mm: mmap.mmap | memoryview | bytes, lay: L.Layout, slot: int, word: int
) -> CallSite | None:
    """The call site of `slot`'s owner, if the slot's record is for state word `word`
    (read just before) and was read whole; None if untraced, ownerless or unrecorded."""
    if not lay.trace_sites or not owner_of(word):
        return None
    at = lay.slot_entry(slot) + L.SLOT_SITE_WORD
    recorded, site, _ = record = _RECORD.unpack_from(mm, at)
    owner = owner_of(word) - 1
    if recorded != word or _RECORD.unpack_from(mm, at) != record or owner >= lay.registry_capacity:
        return None
    return read_site(mm, lay, owner, site)


@dataclass
class Holding:
    """What one call site holds now: its slots, the oldest one's age, in which states."""

    site: CallSite
    slots: list[int] = field(default_factory=list)
    oldest_s: float = 0.0
    states: dict[str, int] = field(default_factory=dict)
    owners: set[int] = field(default_factory=set)  # participant indices


def holdings(owned: Iterable[tuple[int, str, int, CallSite | None, float]]) -> list[Holding]:
    """(slot, state, owner, site, age_s) of owned slots grouped by call site, most slots
    first (then oldest first); slots without a recorded site are left out."""
    by_site: dict[CallSite, Holding] = {}
    for slot, state, owner, site, age in owned:
        if site is None:
            continue
        h = by_site.setdefault(site, Holding(site))
        h.slots.append(slot)
        h.oldest_s = max(h.oldest_s, age)
        h.states[state] = h.states.get(state, 0) + 1
        h.owners.add(owner)
    return sorted(by_site.values(), key=lambda h: (-len(h.slots), -h.oldest_s))


def describe_holders(found: list[Holding], top: int = 3) -> str:
    """`top holders: decode.py:88 in consume (40 slots, oldest 61.2 s), ...`."""
    shown = ", ".join(
        f"{h.site.short} ({len(h.slots)} slots, oldest {h.oldest_s:.3g} s)" for h in found[:top]
    )
    more = f" and {len(found) - top} more sites" if len(found) > top else ""
    return f"top holders by call site: {shown}{more}" if found else "no call site recorded"
