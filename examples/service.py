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
    (replace_orphaned); while a consumer still holds that one, it tries again.  SIGTERM stops
    it cleanly: no new rows, the queued ones taken, then the table closed and unlinked."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while True:
        try:
            table = SlotTable.create(name, FIELDS, slots=16, replace_orphaned=True)
            break
        except TableExists:  # a consumer is still attached to the old table
            time.sleep(0.02)
    with table:  # closes and unlinks on the way out, saying if rows were left
        up.set()
        request = first
        while not stopping:
            with table.claim(timeout=10) as ws:
                ws.write(request=request, token=request % 7)
                ws.publish()
            request += 1
            time.sleep(0.01)
        deadline = time.monotonic() + 5
        while table.stats().queued and time.monotonic() < deadline:
            time.sleep(0.01)  # let the consumer take what is queued


def consumer(name: str, seen: "mp.Queue[int]") -> None:
    """Attaches whenever there is a table (waiting while there is none, or while one is
    being made); drains and lets go of one whose producer has gone, and waits for the
    producer's restart to replace it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    dropped = None
    while True:
        try:
            with SlotTable.attach(name, "consumer", timeout=30, expect=FIELDS) as table:
                stale = table.identity == dropped  # still the dead producer's table
                while not stale:
                    lease = table.take(timeout=0.1)
                    if lease is not None:
                        seen.put(int(lease.item("request")))
                        lease.release()
                    elif table.unlinked or not table.creator_attached():
                        dropped = table.identity  # drained, and its producer has gone
                        break
            if stale:
                time.sleep(0.1)  # detached: the producer's restart can replace it now
        except TableNotFound:
            pass  # between a producer's death and its restart


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "service-demo"
    ctx = mp.get_context("spawn")
    seen: mp.Queue[int] = ctx.Queue()
    consume = ctx.Process(target=consumer, args=(name, seen), daemon=True)
    consume.start()  # first: it waits for the table
    produce = None
    try:
        for run, sig in enumerate((signal.SIGKILL, signal.SIGTERM)):
            up = ctx.Event()
            first = run * 10_000
            produce = ctx.Process(target=producer, args=(name, first, up), daemon=True)
            produce.start()
            if not up.wait(30):
                print(f"producer run {run} did not start within 30 s", file=sys.stderr)
                return 1
            while seen.get(timeout=10) < first:  # rows the last run left: drained first
                pass
            os.kill(produce.pid, sig)  # type: ignore[arg-type]
            produce.join(10)
            print(f"producer run {run}: rows reached the consumer, then {sig.name}")
        os.kill(consume.pid, signal.SIGTERM)  # type: ignore[arg-type]
        consume.join(10)
        return 0 if consume.exitcode == 0 else 1
    finally:  # whatever happened, no child outlives the demo, nor its table
        for proc in (produce, consume):
            if proc is not None and proc.is_alive():
                proc.terminate()  # SIGTERM: the producer drains and unlinks
                proc.join(10)
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(10)


if __name__ == "__main__":
    sys.exit(main())
