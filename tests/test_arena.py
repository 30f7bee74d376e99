"""The compiled arena (csrc/arena.c) over a plain mapping: where blocks go, when they come
back, and what it refuses.  tests/test_refs.py drives the same object through tables."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator

import pytest

from shmslots._core import WARM_BLOCKS, Arena, AtomicView

SLOTS, ENTRY, PAGES, PAGE = 4, 64, 16, 4096
TABLE = SLOTS * ENTRY  # the page words follow the slot words
DATA = TABLE + 8 * PAGES


class Mapping:
    """Slot words, page words and pages, as a table lays them out."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, DATA + PAGES * PAGE)
        self.a = AtomicView(self.mm)
        self.arena = Arena(
            self.a, table=TABLE, pages=PAGES, page_size=PAGE, data=DATA, entries=0,
            entry_size=ENTRY, slots=SLOTS,
        )  # fmt: skip

    def pages(self) -> list[int]:
        return [self.a.load(TABLE + 8 * i) for i in range(PAGES)]

    def move_on(self, slot: int, generation: int) -> None:
        """The slot's word at a new generation (its row released, aborted or reclaimed)."""
        self.a.store(slot * ENTRY, generation << 32)

    def close(self) -> None:
        self.a.release()
        self.mm.close()


def tag(slot: int, generation: int) -> int:
    return (slot + 1) << 32 | generation


def at(page: int) -> int:
    return DATA + page * PAGE


@pytest.fixture
def m() -> Iterator[Mapping]:
    mapping = Mapping()
    yield mapping
    mapping.close()


def test_blocks_go_first_fit_past_foreign_pages_and_a_failed_loan_takes_nothing(
    m: Mapping,
) -> None:
    assert m.arena.pages_for(0) == 1 and m.arena.pages_for(PAGE + 1) == 2
    assert m.arena.loan(2 * PAGE, 0, 0) == at(0)
    m.a.store(TABLE + 8 * 3, tag(3, 7))  # page 3 is another process's
    assert m.arena.loan(2 * PAGE, 1, 0) == at(4)  # pages 2-3 hold no run of two
    assert m.arena.loan(PAGE, 2, 0) == at(6)  # next fit: past the last block
    before = m.pages()
    assert m.arena.loan(10 * PAGE, 2, 0) is None  # 9 free pages in a row at most
    assert m.arena.loan((PAGES + 1) * PAGE, 2, 0) is None  # more than the arena
    assert m.arena.pages_for(2**64 - 1) == 2**52  # no wrap to one page near 2**64
    assert m.arena.loan(2**64 - 1, 2, 0) is None
    assert m.pages() == before
    assert before[:7] == [tag(0, 0)] * 2 + [0, tag(3, 7)] + [tag(1, 0)] * 2 + [tag(2, 0)]
    assert m.arena.usage() == (6, 4)
    assert m.arena.pinned() == (3, 5 * PAGE)


def test_a_block_given_back_before_publish_is_its_owners_alone(m: Mapping) -> None:
    offset = m.arena.loan(3 * PAGE, 1, 5)
    assert offset is not None
    assert not m.arena.unpin(offset, 1, 6)  # another generation's: nothing
    assert not m.arena.unpin(offset, 2, 5)  # another slot's: nothing
    assert not m.arena.unpin(offset + PAGE, 1, 5)  # not where a block starts: nothing
    assert m.pages()[:3] == [tag(1, 5)] * 3
    assert m.arena.unpin(offset, 1, 5)
    assert m.pages() == [0] * PAGES and m.arena.pinned() == (0, 0)
    assert not m.arena.unpin(offset, 1, 5)  # twice: nothing
    m.move_on(1, 6)
    assert m.arena.collect_own() == 0


def test_a_consumed_rows_block_is_freed_and_warms_the_next_block_of_its_size(
    m: Mapping,
) -> None:
    assert m.arena.loan(2 * PAGE, 0, 0) == at(0)
    assert m.arena.loan(PAGE, 1, 0) == at(2)
    assert m.arena.collect_own() == 0  # both slots still at their generations
    m.move_on(0, 1)  # slot 0's row consumed
    assert m.arena.collect_own() == 1
    assert m.pages()[:3] == [0, 0, tag(1, 0)]
    assert m.arena.loan(PAGE, 2, 0) == at(3)  # another size: next fit, not into the hole
    assert m.arena.loan(2 * PAGE, 0, 1) == at(0)  # its size: where the last was freed
    for slot in (1, 2):
        m.move_on(slot, 1)
    assert m.arena.collect_own() == 2 and m.arena.pinned() == (1, 2 * PAGE)


def test_a_block_given_back_before_publish_warms_nothing(m: Mapping) -> None:
    """A replaced loan may still be referenced (reported): its pages must not start this
    row's next block, which would then overlap it."""
    assert m.arena.loan(PAGE, 0, 0) == at(0)
    assert m.arena.unpin(at(0), 0, 0)
    assert m.arena.loan(PAGE, 0, 0) == at(1)


def test_a_search_that_finds_no_room_keeps_its_warm_start(m: Mapping) -> None:
    assert m.arena.loan(2 * PAGE, 0, 0) == at(0)
    m.move_on(0, 1)
    assert m.arena.collect_own() == 1  # pages 0-1: the warm start of a 2-page block
    for page in range(PAGES):
        m.a.store(TABLE + 8 * page, tag(3, 0))  # another process holds every page
    assert m.arena.loan(2 * PAGE, 0, 1) is None
    for page in range(PAGES):
        m.a.store(TABLE + 8 * page, 0)
    assert m.arena.loan(2 * PAGE, 0, 1) == at(0)  # still warm: not next fit (page 2)


def test_the_warm_list_keeps_the_newest_blocks(m: Mapping) -> None:
    for slot in range(SLOTS):
        assert m.arena.loan(PAGE, slot, 0) == at(slot)
    for slot in range(SLOTS):
        m.move_on(slot, 1)
    assert m.arena.collect_own() == SLOTS
    assert WARM_BLOCKS >= SLOTS
    assert [m.arena.loan(PAGE, 0, 1) for _ in range(SLOTS)] == [at(3), at(2), at(1), at(0)]


def test_collect_frees_the_pages_of_any_process_whose_slot_moved_on(m: Mapping) -> None:
    assert m.arena.loan(PAGE, 0, 0) == at(0)
    m.a.store(TABLE + 8 * 5, tag(2, 3))  # another process's, its slot at generation 0 now
    m.a.store(TABLE + 8 * 6, tag(99, 0))  # naming no slot: a corrupt word
    m.a.store(TABLE + 8 * 7, 5)  # slot number 0: naming none
    m.move_on(3, 4)
    m.a.store(TABLE + 8 * 8, tag(3, 4))  # alive: its slot is at that generation
    assert m.arena.collect() == 3
    assert m.pages()[:9] == [tag(0, 0)] + [0] * 7 + [tag(3, 4)]
    m.move_on(0, 1)
    assert m.arena.collect() == 1 and m.arena.collect_own() == 1  # freed already: dropped


def test_bad_arguments_and_a_released_view_change_nothing(m: Mapping) -> None:
    for slot in (-1, SLOTS):
        with pytest.raises(ValueError, match="not one of"):
            m.arena.loan(PAGE, slot, 0)
    with pytest.raises(OverflowError):
        m.arena.loan(-1, 0, 0)
    with pytest.raises(TypeError):
        m.arena.loan(PAGE, 0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        m.arena.loan(PAGE, 0, "0")  # type: ignore[arg-type]  # ints only: no Python runs
    m.a.release()
    for call in (m.arena.usage, m.arena.collect, lambda: m.arena.loan(PAGE, 0, 0)):
        with pytest.raises(ValueError, match="released"):
            call()
    m.a = AtomicView(m.mm)  # for the fixture's close
    assert m.pages() == [0] * PAGES


@pytest.mark.parametrize(
    "where",
    [
        {"table": DATA + PAGES * PAGE - 8},  # page words past the mapping
        {"entries": DATA + PAGES * PAGE - 64},  # slot words past the mapping
        {"table": TABLE + 4},  # misaligned
        {"pages": 0},
        {"entry_size": 12},
        {"entry_size": 2**62, "slots": 32},  # a span whose size wraps to 0 words
        {"data": DATA + PAGE},  # pages past the mapping
        {"page_size": 12},
    ],
)
def test_an_arena_outside_its_mapping_is_refused(m: Mapping, where: dict[str, int]) -> None:
    spans = {
        "table": TABLE, "pages": PAGES, "page_size": PAGE, "data": DATA, "entries": 0,
        "entry_size": ENTRY, "slots": SLOTS, **where,
    }  # fmt: skip
    with pytest.raises((IndexError, ValueError)):
        Arena(m.a, **spans)


def test_an_arena_is_made_over_an_atomic_view_once(m: Mapping) -> None:
    spans = {
        "table": TABLE, "pages": PAGES, "page_size": PAGE, "data": DATA, "entries": 0,
        "entry_size": ENTRY, "slots": SLOTS,
    }  # fmt: skip
    with pytest.raises(TypeError, match="AtomicView"):
        Arena(m.mm, **spans)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="once"):
        m.arena.__init__(m.a, **spans)  # type: ignore[misc]
    bare = Arena.__new__(Arena)  # never initialized: refused, not a crash
    calls: list[Callable[[], object]] = [
        lambda: bare.pages_for(1), bare.usage, bare.collect, bare.pinned,
        lambda: bare.loan(1, 0, 0), lambda: bare.unpin(0, 0, 0),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(TypeError, match="never initialized"):
            call()
