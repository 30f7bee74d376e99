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
WARM_BLOCKS = 8  # blocks this process freed, remembered for a next block of their size


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
        self._warm: list[tuple[int, int]] = []  # (pages, first page), the newest last

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_size))

    def alloc(self, nbytes: int, slot: int, generation: int) -> int | None:
        """Offset (in the segment) of `nbytes` on free pages now owned by (slot, generation).

        First fit from the block of this size this process freed last (`free(warm=True)`),
        whose pages are likely still in its cache: a producer's next loan of a shape then
        fills warm memory, as a ring reusing one cell does.  Otherwise next fit, past its
        last such block, so that a block of another size does not split a freed hole.  A
        page lost to a racing allocator rolls back what was taken and the search goes on
        past it: one compiled call (`claim_run`), however many pages.
        """
        need = self.pages_for(nbytes)
        if need > self.pages:
            return None
        warm = self._warm_start(need)
        start = self._hint if warm is None else warm
        first = self._a.claim_run(self._table, self.pages, need, start, page_tag(slot, generation))
        if first < 0:
            return None
        if warm is None:
            self._hint = first + need
        return self._data + first * self.page_size

    def _warm_start(self, need: int) -> int | None:
        """The first page of the block of `need` pages this process freed last, if any."""
        for i in range(len(self._warm) - 1, -1, -1):
            if self._warm[i][0] == need:
                return self._warm.pop(i)[1]
        return None

    def free(
        self, offset: int, nbytes: int, slot: int, generation: int, warm: bool = False
    ) -> None:
        """Free a block of (slot, generation).  `warm`: its next block of this size may
        start here; never for pages something may still reference, which would then
        overlap the very next row."""
        first, count = (offset - self._data) // self.page_size, self.pages_for(nbytes)
        self._release(first, count, page_tag(slot, generation))
        if warm:
            self._warm = [*self._warm, (count, first)][-WARM_BLOCKS:]

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
