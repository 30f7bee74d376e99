"""The arena: pages of the table's segment that hold CPU tensors rows refer to.

Each page has one 64-bit owner word: 0 when free, else ``(slot + 1) << 32 |
generation`` of the write slot that allocated it.  A block is live exactly
while its slot is still at that generation, so the arena needs no lock and
no cooperation from a process that died: once the slot's generation moves
on (release, abort or reclaim), anyone may free the block's pages.
"""

from __future__ import annotations

from collections.abc import Callable

from . import layout as L
from ._core import AtomicView

_GEN = 0xFFFF_FFFF


def page_tag(slot: int, generation: int) -> int:
    return ((slot + 1) << 32) | (generation & _GEN)


class Arena:
    def __init__(self, atomics: AtomicView, lay: L.Layout) -> None:
        self._a = atomics
        self.page_size = lay.arena_page_size
        self.pages = lay.arena_pages
        self._table = lay.arena_table
        self._data = lay.arena
        self._hint = 0

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_size))

    def alloc(self, nbytes: int, slot: int, generation: int) -> int | None:
        """Offset (in the segment) of `nbytes` on free pages now owned by (slot, generation).

        First fit from a hint: past this process's last block, or at the block it last
        freed, whose pages are likely still in its cache (a producer's next loan then
        fills warm memory, as a ring reusing one cell does).  A page lost to a racing
        allocator rolls back what was taken and the search goes on past it: one compiled
        call (`claim_run`), however many pages.
        """
        need = self.pages_for(nbytes)
        if need > self.pages:
            return None
        tag = page_tag(slot, generation)
        first = self._a.claim_run(self._table, self.pages, need, self._hint, tag)
        if first < 0:
            return None
        self._hint = first + need
        return self._data + first * self.page_size

    def free(self, offset: int, nbytes: int, slot: int, generation: int) -> None:
        first = (offset - self._data) // self.page_size
        self._release(first, self.pages_for(nbytes), page_tag(slot, generation))
        self._hint = first  # the next block starts on these pages, warm in this cache

    def _release(self, first: int, count: int, tag: int) -> None:
        if count:
            self._a.cas_run(self._table + 8 * first, count, tag, 0, False)

    def collect(self, generation_of_slot: Callable[[int], int]) -> int:
        """Free every page whose slot has moved past the generation that allocated it."""
        freed = 0
        for page in range(self.pages):
            word = self._table + 8 * page
            tag = self._a.load(word)
            if tag and generation_of_slot((tag >> 32) - 1) != tag & _GEN:
                freed += self._a.cas(word, tag, 0)
        return freed

    def usage(self) -> tuple[int, int]:
        """(pages in use, blocks in use) — a block is a run of pages with one tag."""
        pages = blocks = 0
        previous = 0
        for page in range(self.pages):
            tag = self._a.load(self._table + 8 * page)
            if tag:
                pages += 1
                blocks += tag != previous
            previous = tag
        return pages, blocks
