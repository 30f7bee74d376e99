"""A table is published by its magic: a reader that sees the magic sees a whole table.

The creator stores the magic last with a release store, readers load it with an
acquire load (layout.publish_magic / magic_published).  On x86 plain stores are
not reordered either, so there this test guards the order of the creator's
writes; on weak-memory CPUs (Arm) it also exercises the barrier pair.
"""

from __future__ import annotations

from multiprocessing.queues import Queue

from conftest import SMALL, SPAWN, Children

from shmslots import IncompatibleTable, SlotTable, TableNotFound
from shmslots import layout as L
from shmslots.segment import Segment
from shmslots.validate import read_schema, read_valid_header

TABLES = 40


def _create_one_by_one(name: str, seen: Queue[int]) -> None:
    for i in range(TABLES):
        with SlotTable.create(f"{name}-{i}", SMALL, slots=1 << 16):
            seen.get(timeout=30)  # until the reader has read it whole


def test_a_reader_that_sees_the_magic_sees_the_whole_table(name: str, children: Children) -> None:
    seen: Queue[int] = SPAWN.Queue()
    children.start(_create_one_by_one, name, seen)
    early = 0  # reads that found the segment before its magic
    for i in range(TABLES):
        while True:  # hammer the segment while it is being built
            try:
                segment = Segment.open(f"{name}-{i}", writable=False)
            except (TableNotFound, IncompatibleTable):  # not there yet, or still empty
                continue
            try:
                if not L.magic_published(segment.mm):
                    early += 1
                    continue
                header = read_valid_header(segment, wait_s=0)  # must not find a half-built one
                assert [f.name for f in read_schema(segment, header).fields] == ["id", "p", "h"]
                break
            finally:
                segment.close()
        seen.put(i)
    children.join_all(30)
    assert early, "no read overlapped the building"
