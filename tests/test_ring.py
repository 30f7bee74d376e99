"""The ready ring: what its model (tools/ring_model/ring.pml, checked by Spin) proves, and
the cases the model found, replayed on the compiled ring."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SMALL, small_row

from shmslots import SlotTable, _core
from shmslots import layout as L
from shmslots.states import Event, next_word

# a cell: position << POS_SHIFT | full | slot (csrc/core.h; docs/protocol.md draws it)
_POS_SHIFT = _core.CELL_BITS["POS_SHIFT"]
_FULL = 1 << _core.CELL_BITS["FULL_BIT"]


def _push_and_stop_before_tail(t: SlotTable, tag: int) -> int:
    """Publish one row as the compiled publish does — READY, then its position stored, then
    its cell filled — and stop there, as a publisher killed before it moved the tail."""
    ws = t.claim(tag=tag).write(**small_row(tag))
    t._rows.seal(ws.slot, ws.generation)
    own, lay = t._own, t.layout
    tail = own.a.load(lay.sync + L.RING_TAIL)
    word = own.word(ws.slot)
    assert own.a.cas(own.entry(ws.slot), word, next_word(word, int(Event.PUBLISH), own.me))
    own.a.store(own.entry(ws.slot) + L.SLOT_QUEUE_POS, tail)
    cell = lay.ring + 8 * (tail % lay.ring_capacity)
    assert own.a.cas(cell, tail << _POS_SHIFT, tail << _POS_SHIFT | _FULL | ws.slot)
    ws._open = False  # the process that held it is gone
    return ws.slot


def test_a_row_taken_before_its_publisher_moved_the_tail_leaves_the_ring_working(
    name: str,
) -> None:
    """Found by the model: a reader pops the entry of a publisher that stopped between
    filling its cell and moving the tail, so head passes tail.  Unsigned, `tail - head`
    read as a full ring, and no publish could ever queue a row again."""
    with SlotTable.create(name, SMALL, slots=2) as t:
        slot = _push_and_stop_before_tail(t, tag=1)
        lease = t.take()
        assert lease is not None and (lease.slot, lease.tag) == (slot, 1)
        lease.release()
        for tag in (2, 3, 4, 5):  # laps of the ring past the stuck position
            t.claim(tag=tag).write(**small_row(tag)).publish(timeout=0.5)
            lease = t.take()
            assert lease is not None and lease.tag == tag and lease.item("id") == tag
            lease.release()
        assert t.check_consistency() == []


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None,
    reason="the ring model needs Spin (Debian: apt-get install spin) and gcc",
)
def test_the_ring_model_holds_and_finds_the_wrapping_full_check() -> None:
    """Every cast of tools/ring_model/ring.pml explored whole: no publication delivered
    twice, the ring's shape kept, no row lost once recovery has run; and the ring-full check
    replaced above loses rows in it."""
    script = Path(__file__).parent.parent / "tools" / "ring_model" / "check.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("every property holds") == 2 and "as found" in done.stdout
