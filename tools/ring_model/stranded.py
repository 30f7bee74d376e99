"""What the stranded-row sweep costs, and how long a stranded row waits (docs/protocol.md:
The model, and why the sweep stays).

A row is stranded when it is READY but no ring entry names it: its publisher was killed
or stopped between the two, or its push found the ring full of stale entries.  Idle
readers sweep for such rows (`requeue_stranded`) at most every STRANDED_CHECK_S, taking
those READY for STRANDED_AGE_NS.  This measures, on this machine:

  * one sweep that finds nothing, by table size (what every idle reader pays per period);
  * how long a reader blocked in `take()` waits for a row stranded while it waits.

Run: .venv/bin/python tools/ring_model/stranded.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from shmslots import Field, SlotTable
from shmslots.ownership import STRANDED_AGE_NS, STRANDED_CHECK_S
from shmslots.states import Event, next_word

FIELDS = (Field("id", "int64"), Field("p", "float32", (4,)))


def sweep_cost_us(name: str, slots: int, calls: int) -> float:
    """Microseconds one sweep takes over a table of `slots` FREE slots."""
    with SlotTable.create(name, FIELDS, slots=slots) as t:
        hot = t._own.hot
        hot.requeue_stranded(STRANDED_AGE_NS)
        start = time.perf_counter()
        for _ in range(calls):
            hot.requeue_stranded(STRANDED_AGE_NS)
        cost = (time.perf_counter() - start) / calls * 1e6
        t.unlink()
    return cost


def strand(t: SlotTable, tag: int) -> None:
    """Make a row READY and queue it nowhere: a publisher stopped between the two."""
    ws = t.claim(tag=tag).write(id=tag, p=torch.zeros(4))
    t._rows.seal(ws.slot, ws.generation)
    own = t._own
    word = own.word(ws.slot)
    assert own.a.cas(own.entry(ws.slot), word, next_word(word, int(Event.PUBLISH), own.me))
    ws._open = False


def stranded_wait_s(name: str, rounds: int) -> list[float]:
    """Seconds from stranding a row to its delivery to a reader blocked in take()."""
    waits: list[float] = []
    with SlotTable.create(name, FIELDS, slots=8) as producer:
        with SlotTable.attach(name, "reader") as reader:
            for tag in range(1, rounds + 1):
                got: list[float] = []
                thread = threading.Thread(target=_take_into, args=(reader, got))
                thread.start()
                time.sleep(0.05)  # the reader is asleep by now
                stranded_at = time.monotonic()
                strand(producer, tag)
                thread.join(10)
                waits.append(got[0] - stranded_at)
                time.sleep(STRANDED_CHECK_S * (tag % 3) / 3)  # vary the phase
        producer.unlink()
    return waits


def _take_into(reader: SlotTable, got: list[float]) -> None:
    """Block in take() and note when the row came."""
    lease = reader.take(timeout=5.0)
    got.append(time.monotonic())
    assert lease is not None
    lease.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    base = f"shmslots-stranded-{os.getpid()}"
    print(f"sweep period {STRANDED_CHECK_S} s, minimum age {STRANDED_AGE_NS / 1e9} s")
    for slots in (1024, 65536):
        cost = sweep_cost_us(f"{base}-{slots}", slots, calls=200)
        share = cost / (STRANDED_CHECK_S * 1e6) * 100
        print(f"one sweep of {slots:>6} slots: {cost:8.1f} us ({share:.4f} % of an idle reader)")
    waits = stranded_wait_s(f"{base}-wait", args.rounds)
    print(
        f"a stranded row reached a blocked reader after {min(waits):.3f} s min, "
        f"{statistics.median(waits):.3f} s median, {max(waits):.3f} s max ({len(waits)} rows)"
    )


if __name__ == "__main__":
    main()
