"""Where a row's time goes, step by step, in one process (no IPC wait): the measured answer
to "why is this target missed".

    python tools/bench.py steps [--rounds N]

Eight tables, each step timed on its own over N rounds (median per round, after a warmup):
the busy round trip, of small rows and of EAGLE rows, as tools/bench.py's shmslots busy
transport makes it (A sends, B echoes the row back through its views, A reads the reply);
the small-row round trip as a user first writes it (lease.copy() of every field, write() of
the copies); a batch of 64 rows (claim_n, a scatter per field or 64 writes, publish_all,
poll, gather of the id, release_all) of small rows, and by scatter of EAGLE rows; a 1 MiB
tensor filled into a loan (ws.alloc) and read through lease.tensor. A last table times what
lies under them: the facts write() checks on each tensor and the tensors made over a
mapping, through torch's C++ objects as shmslots does and through its Python API as before.
"""

from __future__ import annotations

import ctypes
import statistics
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from shmslots import Lease, SlotTable, WriteSlot
from shmslots._core import mapped
from shmslots.rows import RULES

from . import command_parser
from .common import EAGLE, SMALL, TENSOR_1M, Kind, touch, unique_name
from .shm import BATCH, created_table, id_field, record_values

NAMES = ("id", "ints", "vec")


class Steps:
    """Named marks within one round; medians over rounds, the first tenth dropped."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self._last = 0

    def start(self) -> None:
        self._last = time.perf_counter_ns()

    def mark(self, name: str) -> None:
        now = time.perf_counter_ns()
        self.samples.setdefault(name, []).append((now - self._last) / 1e3)
        self._last = time.perf_counter_ns()

    def print(self, title: str, per: int = 1) -> None:
        print(f"\n{title}\n")
        total = 0.0
        for name, samples in self.samples.items():
            median = statistics.median(samples[len(samples) // 10 :])
            total += median
            extra = f"  {median / per * 1e3:7.0f} ns/row" if per > 1 else ""
            print(f"  {name:34} {median:8.2f} us{extra}")
        extra = f"  {total / per * 1e3:7.0f} ns/row" if per > 1 else ""
        print(f"  {'total':34} {total:8.2f} us{extra}")


@contextmanager
def two_tables(kind: Kind = SMALL) -> Iterator[tuple[SlotTable, SlotTable]]:
    with (
        created_table(unique_name("steps-req"), kind) as req,
        created_table(unique_name("steps-resp"), kind) as resp,
    ):
        yield req, resp


def taken(table: SlotTable) -> Lease:
    lease = table.take(0.0)
    assert lease is not None
    return lease


def busy_round_trip(rounds: int, kind: Kind) -> Steps:
    """benchkit/shm.py's ShmEnd's send, echo and recv, one step at a time."""
    values, s = record_values(kind), Steps()
    rid_name = id_field(kind)
    names = (rid_name, *values)
    rest = names[1:]
    row = {rid_name: 0, **values}
    with two_tables(kind) as (req, resp):
        for rid in range(rounds):
            s.start()
            row[rid_name] = rid
            req.send(row, tag=1)
            s.mark(f"A send (int + {len(rest)} tensors)")
            lease = taken(req)
            s.mark("B take")
            views = lease.views(names)
            s.mark(f"B views ({len(names)})")
            lease.item(rid_name)
            s.mark("B item")
            resp.send(views, tag=1)
            s.mark(f"B send ({len(names)} views)")
            del views
            lease.release()
            s.mark(f"B release ({len(names)} views checked)")
            back = taken(resp)
            s.mark("A take")
            back.views(rest)
            s.mark(f"A views ({len(rest)})")
            back.item(rid_name)
            s.mark("A item")
            back.release()
            s.mark("A release")
    return s


def copying_round_trip(rounds: int) -> Steps:
    """benchkit/shm.py's CopyingEnd's echo and recv (A sends as above), one step at a time."""
    values, s = record_values(SMALL), Steps()
    with two_tables() as (req, resp):
        for rid in range(rounds):
            s.start()
            ws = req.claim(tag=1)
            ws.write(id=rid, **values)
            ws.publish()
            s.mark("A claim, write, publish")
            lease = taken(req)
            s.mark("B take")
            copies = {name: lease.copy(name) for name in NAMES}
            s.mark("B 3 copies")
            lease.release()
            s.mark("B release")
            reply = resp.claim(tag=1)
            s.mark("B claim")
            reply.write(**copies)
            s.mark("B write (3 copies)")
            reply.publish()
            s.mark("B publish")
            back = taken(resp)
            s.mark("A take")
            kept = [back.copy(name) for name in NAMES]
            s.mark("A 3 copies")
            back.release()
            s.mark("A release")
            del kept
    return s


def batch(rounds: int, kind: Kind, scattered: bool) -> Steps:
    """benchkit/shm.py's BatchEnd's flush and recv (`scattered`), or with a write() per row."""
    values, s, rid = record_values(kind), Steps(), id_field(kind)
    batches = {
        name: value.expand(BATCH, *value.shape).contiguous() for name, value in values.items()
    }
    with created_table(unique_name("steps"), kind, batches=1) as table:
        for _ in range(rounds):
            s.start()
            slots: list[WriteSlot] = table.claim_n(BATCH, tag=1)
            s.mark(f"claim_n({BATCH})")
            if scattered:
                table.scatter(slots, rid, list(range(BATCH)))
                for name, rows in batches.items():
                    table.scatter(slots, name, rows)
                s.mark(f"{len(batches) + 1} scatters (the ids from a list)")
            else:
                for i, ws in enumerate(slots):
                    ws.write(**{rid: i}, **values)
                s.mark(f"{BATCH} x write (int + {len(values)} tensors)")
            table.publish_all(slots)
            s.mark(f"publish_all({BATCH})")
            leases = table.poll(BATCH)
            s.mark(f"poll({BATCH})")
            table.gather(leases, rid).tolist()
            s.mark(f"gather({BATCH}, id).tolist()")
            table.release_all(leases)
            s.mark(f"release_all({BATCH})")
            assert len(leases) == BATCH
    return s


def loaned_tensor(rounds: int) -> Steps:
    """benchkit/shm.py's LoanEnd's send of a 1 MiB tensor and ShmEnd's read of it."""
    payload, s = record_values(TENSOR_1M)["x"], Steps()
    with created_table(unique_name("steps-loan"), TENSOR_1M) as table:
        for rid in range(rounds):
            s.start()
            ws = table.claim(tag=1)
            s.mark("claim (frees the last loan's pages)")
            loan = ws.alloc("x", tuple(payload.shape))
            s.mark("alloc (arena pages, ref, tensor)")
            ctypes.memmove(loan.data_ptr(), payload.data_ptr(), payload.nbytes)
            del loan
            s.mark("fill: memmove of 1 MiB")
            ws.write(id=rid)
            s.mark("write id")
            ws.publish()
            s.mark("publish (the loan checked)")
            lease = taken(table)
            s.mark("take")
            x = lease.tensor("x")
            s.mark("tensor (open the ref)")
            touch(x)
            del x
            s.mark("touch: a byte per 4 KiB page")
            lease.release()
            s.mark("release")
    return s


def torch_costs() -> None:
    """ns per call of what write() learns of a tensor and of making tensors, compiled against
    torch's C++ objects (shmslots._tensors) and through its Python API."""
    t = record_values(SMALL)["vec"]
    storage = t.untyped_storage()
    pin = memoryview(bytearray(1 << 16))

    def python_facts() -> object:
        return (
            t.dtype, t.shape, t.is_cpu, t.storage_offset(), t.is_contiguous(),
            t.untyped_storage(), storage.nbytes(), t.is_neg(), t.data_ptr(),
            torch._C._is_torch_function_mode_enabled(),
        )  # fmt: skip

    calls: dict[str, Callable[[], object]] = {
        "RULES.check(tensor), facts from C++": lambda: RULES.check(t, torch.float32, (64,)),
        "the same facts, 10 torch Python calls": python_facts,
        "mapped(64 floats), C++ from_blob": lambda: mapped(pin, 0, torch.float32, (64,)),
        "torch.frombuffer(64 floats)": lambda: torch.frombuffer(pin, dtype=torch.float32, count=64),
        "torch.empty(64, dtype=float32)": lambda: torch.empty(64, dtype=torch.float32),
        "(a Python call of nothing)": lambda: None,
    }
    print("\ntorch underneath (ns per call, a Python call included)\n")
    n = 100_000
    for label, call in calls.items():
        best = min(timeit.repeat(call, number=n, repeat=5)) / n * 1e9
        print(f"  {label:38} {best:7.0f} ns")


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("steps", __doc__)
    parser.add_argument("--rounds", type=int, default=5000)
    rounds = parser.parse_args(argv).rounds
    torch.set_num_threads(1)
    busy_round_trip(rounds, SMALL).print(
        "busy small-row round trip (tools/bench.py: shmslots busy)"
    )
    busy_round_trip(rounds, EAGLE).print(
        "busy EAGLE-row round trip (tools/bench.py: shmslots busy)"
    )
    copying_round_trip(rounds).print("as a user first writes it (shmslots copying)")
    for kind, scattered, how in (
        (SMALL, True, "scatter per field"),
        (SMALL, False, "write() per row"),
        (EAGLE, True, "scatter per field"),
    ):
        steps = batch(max(1, rounds // 10), kind, scattered)
        steps.print(f"a batch of {BATCH} {kind.name} rows, {how}", per=BATCH)
    loaned_tensor(max(1, rounds // 5)).print("a 1 MiB tensor through a loan (shmslots loan)")
    torch_costs()
    return 0
