# python examples/service.py [TABLE]
"""A producer and a consumer run as services: started in any order, killed, restarted."""

import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.synchronize import Event as EventType

from shmslots import Field, SlotTable, TableExists, TableNotFound

FIELDS = [Field("request", "int64"), Field("token", "int64")]


def producer(name: str, first: int, up: EventType) -> None:
    """Owns the table.  A restart after a crash replaces the table its dead predecessor left
    (replace_orphaned); while a consumer still holds that one, it waits and tries again."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SIGTERM: leave the with block
    while True:
        try:
            table = SlotTable.create(name, FIELDS, slots=16, replace_orphaned=True)
            break
        except TableExists:  # a live consumer is still attached to the old table
            time.sleep(0.05)
    with table:  # closes and unlinks on the way out, saying if rows were left
        up.set()
        for request in range(first, first + 1000):
            with table.claim(timeout=10) as ws:
                ws.write(request=request, token=request % 7)
                ws.publish()
            time.sleep(0.01)


def consumer(name: str, seen: "mp.Queue[int]") -> None:
    """Attaches whenever there is a table (waiting while there is none, or while one is
    being made), and lets go of one whose producer has gone, to find its successor."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        try:
            with SlotTable.attach(name, "consumer", timeout=30, expect=FIELDS) as table:
                while True:
                    lease = table.take(timeout=0.1)
                    if lease is not None:
                        seen.put(int(lease.item("request")))
                        lease.release()
                    elif table.unlinked or not table.peers():
                        break  # drained, and its producer has gone: find its successor
        except TableNotFound:
            pass  # between a producer's death and its restart


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "service-demo"
    ctx = mp.get_context("spawn")
    seen: mp.Queue[int] = ctx.Queue()
    consume = ctx.Process(target=consumer, args=(name, seen))
    consume.start()  # first: it waits for the table
    runs: list[tuple[str, int]] = []
    for first, sig in ((0, signal.SIGKILL), (10_000, signal.SIGTERM)):
        up = ctx.Event()
        produce = ctx.Process(target=producer, args=(name, first, up))
        produce.start()
        assert up.wait(30)
        got = [seen.get(timeout=10) for _ in range(5)]
        os.kill(produce.pid, sig)  # type: ignore[arg-type]
        produce.join(10)
        runs.append((sig.name, got[0] // 10_000))
    os.kill(consume.pid, signal.SIGTERM)  # type: ignore[arg-type]
    consume.join(10)
    for stop, run in runs:
        print(f"producer run {run}: rows reached the consumer, then {stop}")
    return 0 if consume.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
