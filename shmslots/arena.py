"""The arena: pages of the table's segment that hold CPU tensors rows refer to.

Each page has one 64-bit owner word: 0 when free, else ``(slot + 1) << 32 |
generation`` of the write slot that allocated it.  A block is live exactly
while its slot is still at that generation, so the arena needs no lock and
no cooperation from a process that died: once the slot's generation moves
on (release, abort or reclaim), anyone may free the block's pages.

The search, where it starts, and this process's book of the blocks it lent
are one compiled object (csrc/arena.c: `Arena`); this module opens it over
a table's layout.
"""

from __future__ import annotations

from . import layout as L
from ._core import Arena, AtomicView


def open_arena(atomics: AtomicView, lay: L.Layout) -> Arena | None:
    """The table's arena as seen by this process (its own book empty), or None without one."""
    if not lay.arena_pages:
        return None
    return Arena(
        atomics,
        table=lay.arena_table,
        pages=lay.arena_pages,
        page_size=lay.arena_page_size,
        data=lay.arena,
        entries=lay.slot_states,
        entry_size=L.SLOT_ENTRY,
        slots=lay.slots,
    )
