"""The chaos scenario: producers and consumers SIGKILLed at random, replaced, audited.

Each worker appends one line per event to its own log with a single
`write()` (no Python buffering), so a kill loses at most the event in
flight.  The order of log line and action makes every case decidable:

* producer: ``W tag`` before claiming, ``P tag`` after publish returned,
  ``A tag`` before aborting;
* consumer: ``C tag deliveries ok`` / ``X tag deliveries ok`` *before*
  release / abort, so a consumer killed in between is redelivered and the
  tag shows a second line with a higher delivery count.

The audit then proves: every tag logged published was handled (consumed or
aborted by a consumer); no delivery of a tag was handed to two consumers;
every handled tag was attempted by a producer; every row matched its tag.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import random
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
from stress import SCHEMA, expected_payload

from shmslots import SlotTable

CHUNK = 2000  # tags per producer process
ABORT_P = 0.05


def _log(fd: int, *words: object) -> None:
    os.write(fd, (" ".join(map(str, words)) + "\n").encode())


def chaos_producer(name: str, tags: range, log: str, seed: int) -> None:
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with SlotTable.attach(name, "producer") as table:
        for tag in tags:
            _log(fd, "W", tag)
            ws = table.claim(tag=tag, timeout=30.0)
            ws.write(tag=tag, producer=os.getpid() & 0x7FFFFFFF, payload=expected_payload(tag))
            if rng.random() < ABORT_P:
                _log(fd, "A", tag)
                ws.abort()
            else:
                ws.publish(timeout=30.0)
                _log(fd, "P", tag)


def chaos_consumer(name: str, log: str, seed: int, stop: ctypes.c_byte) -> None:
    """`stop` is a bare shared byte, not an Event: an Event's lock, held by a consumer at
    the moment it is SIGKILLed, would block every other consumer's check for good."""
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with SlotTable.attach(name, "consumer") as table:
        while not stop.value:
            lease = table.take(timeout=0.05)
            if lease is None:
                continue
            tag = lease.tag
            ok = lease.item("tag") == tag and torch.equal(
                lease.view("payload"), expected_payload(tag)
            )
            if rng.random() < ABORT_P:
                _log(fd, "X", tag, lease.deliveries, int(ok))
                lease.abort()
            else:
                _log(fd, "C", tag, lease.deliveries, int(ok))
                lease.release()


@dataclass
class ChaosReport:
    rows_handled: int = 0
    kills: int = 0
    published: int = 0
    producer_aborts: int = 0
    consumer_aborts: int = 0
    redelivered_rows: int = 0
    lost: list[int] = field(default_factory=list)
    double_delivered: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)
    corrupted: list[int] = field(default_factory=list)
    reclaims: dict[str, int] = field(default_factory=dict)
    owned_at_end: int = 0
    dead_participants_at_end: int = 0
    inconsistencies: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.double_delivered
            or self.unknown
            or self.corrupted
            or self.owned_at_end
            or self.dead_participants_at_end
            or self.inconsistencies
        )


def audit(logdir: Path, report: ChaosReport) -> None:
    attempted: set[int] = set()
    published: set[int] = set()
    deliveries: dict[int, list[int]] = defaultdict(list)
    for path in logdir.glob("*.log"):
        for line in path.read_text().splitlines():
            kind, tag_text, *rest = line.split()
            tag = int(tag_text)
            if kind == "W":
                attempted.add(tag)
            elif kind == "P":
                published.add(tag)
            elif kind == "A":
                report.producer_aborts += 1
            elif kind in ("C", "X"):
                deliveries[tag].append(int(rest[0]))
                report.consumer_aborts += kind == "X"
                if rest[1] != "1":
                    report.corrupted.append(tag)
    report.published = len(published)
    report.rows_handled = len(deliveries)
    report.lost = sorted(published - deliveries.keys())
    report.unknown = sorted(deliveries.keys() - attempted)
    report.double_delivered = sorted(t for t, d in deliveries.items() if len(d) != len(set(d)))
    report.redelivered_rows = sum(1 for d in deliveries.values() if max(d) > 0)


def run_chaos(
    name: str, logdir: Path, rows: int, kills: int, seed: int = 0, max_seconds: float = 600.0
) -> ChaosReport:
    """Run 2 producers and 2 consumers until `rows` are handled and `kills` were made."""
    ctx = mp.get_context("forkserver")
    # torch and shmslots, not this module: on 3.11 the fork server imports its preloads on
    # its own sys.path, where the tests' folder is not (children get the parent's path)
    ctx.set_forkserver_preload(["torch", "shmslots"])
    rng = random.Random(seed)
    stop = ctx.RawValue(ctypes.c_byte, 0)
    report = ChaosReport()
    started = time.monotonic()
    next_tag = 1
    serial = 0
    producers: list[BaseProcess] = []
    consumers: list[BaseProcess] = []

    def start_producer() -> None:
        nonlocal next_tag, serial
        serial += 1
        tags = range(next_tag, next_tag + CHUNK)
        next_tag += CHUNK
        log = str(logdir / f"producer-{serial}.log")
        proc = ctx.Process(target=chaos_producer, args=(name, tags, log, seed * 1000 + serial))
        proc.start()
        producers.append(proc)

    def start_consumer() -> None:
        nonlocal serial
        serial += 1
        log = str(logdir / f"consumer-{serial}.log")
        args = (name, log, seed * 1000 + serial, stop)
        proc = ctx.Process(target=chaos_consumer, args=args)
        proc.start()
        consumers.append(proc)

    with SlotTable.create(name, SCHEMA, slots=32, role="auditor") as table:
        try:
            for _ in range(2):
                start_consumer()
                start_producer()
            next_kill = time.monotonic() + rng.uniform(0.05, 0.3)
            while True:
                if time.monotonic() - started > max_seconds:
                    raise TimeoutError(f"chaos run exceeded {max_seconds} s")
                handled = table.stats().counters
                more = handled["releases"] + handled["aborts"] < rows or report.kills < kills
                for group, start in ((producers, start_producer), (consumers, start_consumer)):
                    for proc in list(group):
                        if proc.exitcode is None:
                            continue
                        group.remove(proc)
                        proc.join()
                        if proc.exitcode not in (0, -signal.SIGKILL):
                            raise RuntimeError(f"worker exited with {proc.exitcode}")
                        if group is consumers or more:
                            start()
                if not more and not producers:
                    break
                if report.kills < kills and time.monotonic() >= next_kill:
                    victims = [p.pid for p in producers + consumers if p.is_alive() and p.pid]
                    try:
                        if victims:
                            os.kill(rng.choice(victims), signal.SIGKILL)
                            report.kills += 1
                    except ProcessLookupError:  # it exited (and was reaped) just now
                        pass
                    next_kill = time.monotonic() + rng.uniform(0.05, 0.3)
                table.reap()
                time.sleep(0.02)
            _drain(table, max_seconds - (time.monotonic() - started))
        finally:
            stop.value = 1
            for proc in producers + consumers:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        table.reap()
        totals = table.stats().counters
        report.reclaims = {
            k: totals[k]
            for k in (
                "reclaimed_writing",
                "reclaimed_reserved",
                "redelivered",
                "participants_reaped",
            )
        }
        stats = table.stats()
        report.owned_at_end = stats.owned
        report.dead_participants_at_end = sum(1 for p in table.participants() if not p.alive)
        report.inconsistencies = table.check_consistency()
    report.seconds = time.monotonic() - started
    audit(logdir, report)
    return report


def _drain(table: SlotTable, budget: float) -> None:
    """Wait until nothing is queued or owned (consumers still running), reaping meanwhile."""
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        table.reap()
        stats = table.stats()
        if stats.owned == 0 and stats.queued == 0:
            return
        time.sleep(0.05)
    raise TimeoutError("table did not drain")
