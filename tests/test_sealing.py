"""One sealing order for publish, send and keep, killed between every two of its steps (#24, 2).

keep() used to change the state before it sealed, while publish sealed before: a writer
SIGKILLed between the two left a kept (HELD) row under a stale seal, which the reaper
redelivered and a strict reader refused, so a committed row was lost.  Now both prove the
slot is theirs, seal, then move it.  A child is SIGKILLed at each point, inside the compiled
step (`_core._kill_at`), and the table is checked with public calls after a reap.
"""

from __future__ import annotations

import pytest
from conftest import SMALL, Children, kill_point, small_row

from shmslots import SlotTable, _core

PUBLISH_SEALED, KEEP_SEALED, KEEP_HELD = (
    kill_point(p) for p in ("PUBLISH_SEALED", "KEEP_SEALED", "KEEP_HELD")
)


def _write_then_die(name: str, op: str, point: int) -> None:
    table = SlotTable.attach(name, "writer")
    if op == "send":  # claim, write and the seal inside the one compiled call
        _core._kill_at(point)
        table.send(small_row(7), tag=7)
        raise SystemExit("the kill point was not reached")
    ws = table.claim(tag=7)
    ws.write(**small_row(7))
    _core._kill_at(point)
    if op == "publish":
        ws.publish()
    else:
        ws.keep()
    raise SystemExit("the kill point was not reached")


@pytest.mark.parametrize(
    ("op", "point", "after"),
    [
        ("publish", PUBLISH_SEALED, "nothing"),  # sealed, still WRITING: never published
        ("send", PUBLISH_SEALED, "nothing"),  # the same point inside send's one call
        ("keep", KEEP_SEALED, "nothing"),  # sealed, still WRITING: never kept
        ("keep", KEEP_HELD, "the row"),  # kept and sealed: a dead holder's row comes back
    ],
)
def test_a_writer_killed_inside_publish_or_keep_leaves_no_stale_seal(
    name: str, children: Children, op: str, point: int, after: str
) -> None:
    with SlotTable.create(name, SMALL, slots=2, strict=True) as table:
        proc = children.start(_write_then_die, name, op, point)
        proc.join(60)
        assert proc.exitcode == -9, proc.exitcode
        table.reap()
        lease = table.take()  # strict: a row under a stale seal raises CorruptTable here
        if after == "nothing":
            assert lease is None
        else:
            assert lease is not None and lease.tag == 7 and lease.verify()
            assert lease.item("id") == 7 and lease.deliveries == 1  # once: to its writer
            lease.release()
        assert table.check_consistency() == [] and table.stats().owned == 0
        assert len([table.claim(), table.claim()]) == 2  # every slot can be claimed again
