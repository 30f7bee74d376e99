"""Crash points: interrupt or kill a participant at every line of the library's Python code.

For each operation (claim->write->publish, take->release, reserve->open_reserved->publish,
keep, a quarantine, cancel, poll, reap of a dead consumer, close with a slot still being
written), an actor
process runs it with a `sys.settrace` counter that, at its k-th line event inside
shmslots, either raises KeyboardInterrupt (the actor catches it and stays alive) or
SIGKILLs the actor.  A checker process then proves, with public calls only:

* while an interrupted actor lives, it owns no slot that no handle refers to, and every
  READY row reaches a reader within 2 s (no reader is blocked by it);
* once the actor is gone (closed or dead, and reaped): no row is lost or delivered twice,
  every row a reader gets again reports `deliveries > 0`, every row verifies and holds what
  was written, the bitmap and the state words agree, and every slot can be claimed again.

Actors are forked from one spawned "zygote" that has torch imported already, so each of
the few hundred kill points costs milliseconds, not an interpreter start.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from types import FrameType
from typing import Any

import pytest
import torch
from conftest import PREFIX, SMALL, SPAWN, Children, small_row

import shmslots
from shmslots import SlotTable, State

SLOTS = 6
MAX_POINTS = 40  # kill points per operation, spread evenly over its line events
REPLY_S = 20.0
READER_BOUND_S = 2.0
PKG_DIR = os.path.dirname(shmslots.__file__)

Op = Callable[[SlotTable, int], None]


def _produce(t: SlotTable, tag: int) -> None:
    ws = t.claim(tag=tag, timeout=1.0)
    ws.write(**small_row(tag))
    ws.publish()


def _consume(t: SlotTable, tag: int) -> None:
    lease = t.take(timeout=1.0)
    assert lease is not None
    lease.view("p")
    lease.release()


def _reserve(t: SlotTable, tag: int) -> None:
    reservation = t.reserve(tag=tag)
    ws = t.open_reserved(reservation.slot, reservation.generation)
    ws.write(**small_row(tag))
    ws.publish()


def _keep(t: SlotTable, tag: int) -> None:
    reservation = t.reserve(tag=tag)
    ws = t.open_reserved(reservation.slot, reservation.generation)
    ws.write(**small_row(tag))
    lease = ws.keep()
    lease.view("p")
    lease.release()


def _quarantine(t: SlotTable, tag: int) -> None:
    """An aborted transfer's reservation, quarantined with no window: held, then freed."""
    quarantine = shmslots.Quarantine(0.0)
    quarantine.hold(t.reserve(tag=tag))
    assert len(quarantine) == 0


def _cancel(t: SlotTable, tag: int) -> None:
    t.cancel(tag)


def _poll(t: SlotTable, tag: int) -> None:
    for lease in t.poll(4):
        lease.release()


def _reap(t: SlotTable, tag: int) -> None:
    t.reap()


def _close(t: SlotTable, tag: int) -> None:
    ws = t.claim(tag=tag)
    ws.write(**small_row(tag))
    t.close()


# operation -> (what it runs, rows the checker publishes first, rows a dead consumer holds)
OPS: dict[str, tuple[Op, int, int]] = {
    "produce": (_produce, 0, 0),
    "consume": (_consume, 1, 0),
    "reserve": (_reserve, 0, 0),
    "keep": (_keep, 0, 0),
    "quarantine": (_quarantine, 0, 0),
    "cancel": (_cancel, 1, 0),
    "poll": (_poll, 3, 0),
    "reap": (_reap, 2, 2),
    "close": (_close, 0, 0),
}


class _Counter:
    """Counts line events in the library's frames; acts at the `limit`-th (0: never)."""

    def __init__(self, limit: int, kill: bool) -> None:
        self.limit, self.kill, self.lines = limit, kill, 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(PKG_DIR):
            return None
        return self._local

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.limit:
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise KeyboardInterrupt
        return self._local


def _send(fd: int, text: str) -> None:
    os.write(fd, (text + "\n").encode())


def _recv(fd: int) -> str:
    """One line from `fd`, or "" at end of file; raises TimeoutError past REPLY_S."""
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], REPLY_S)
        if not ready:
            raise TimeoutError("the actor did not answer")
        chunk = os.read(fd, 256)
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()


def _actor(name: str, op: Op, tag: int, limit: int, kill: bool, rx: int, tx: int) -> None:
    """In a forked child: attach, wait for the go, run `op` under the counter, report."""
    code = 1
    try:
        t = SlotTable.attach(name, "actor")
        _send(tx, f"attached {t.participant}")
        assert _recv(rx) == "go"
        counter = _Counter(limit, kill)
        sys.settrace(counter)
        try:
            op(t, tag)
            outcome = "done"
        except KeyboardInterrupt:
            outcome = "interrupted"
        finally:
            sys.settrace(None)
        gc.collect()  # whatever the interrupt left behind is dropped now
        _send(tx, f"{outcome} {counter.lines}")
        assert _recv(rx) == "exit"
        t.close()
        code = 0
    except BaseException as exc:  # report, never hang the checker
        _send(tx, f"error {type(exc).__name__}: {exc}")
    finally:
        os._exit(code)


def _victim(name: str, rows: int) -> None:
    """In a forked child: take `rows` rows and die holding them."""
    t = SlotTable.attach(name, "victim")
    leases = [t.take(timeout=5.0) for _ in range(rows)]
    assert None not in leases
    os.kill(os.getpid(), signal.SIGKILL)


def _fork(target: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target()
        finally:
            os._exit(1)
    return pid


@dataclass
class Iteration:
    """What the checker saw in one run of one operation with one kill point."""

    outcome: str = ""
    lines: int = 0
    problems: list[str] = field(default_factory=list)


def _drain(t: SlotTable, delivered: list[tuple[int, int]], problems: list[str]) -> None:
    """Take every READY row; each must come within READER_BOUND_S and hold what was written."""
    while t.stats().states["READY"]:
        lease = t.take(timeout=READER_BOUND_S)
        if lease is None:
            problems.append(f"a READY row did not reach a reader in {READER_BOUND_S} s")
            return
        if not lease.verify() or lease.item("id") != lease.tag:
            problems.append(f"row of tag {lease.tag} does not hold what was written")
        delivered.append((lease.tag, lease.deliveries))
        lease.release()


def _run_once(checker: SlotTable, op_name: str, limit: int, kill: bool, tag: int) -> Iteration:
    op, published, held_by_dead = OPS[op_name]
    result = Iteration()
    problems = result.problems
    before = checker.stats().counters
    to_actor, from_checker = os.pipe()
    from_actor, to_checker = os.pipe()
    actor = _fork(lambda: _actor(checker.name, op, tag, limit, kill, to_actor, to_checker))
    os.close(to_actor)  # the actor's ends: its death must read as end of file here
    os.close(to_checker)
    try:
        reply = _recv(from_actor)
        assert reply.startswith("attached"), reply
        actor_index = int(reply.split()[1])
        tags = [tag + i for i in range(published)] if op_name != "cancel" else [tag]
        for t in tags:
            checker.claim(tag=t).write(**small_row(t)).publish()
        if held_by_dead:
            victim = _fork(lambda: _victim(checker.name, held_by_dead))
            os.waitpid(victim, 0)
        _send(from_checker, "go")
        reply = _recv(from_actor)
        delivered: list[tuple[int, int]] = []
        if reply.startswith(("done", "interrupted")):
            result.outcome, lines = reply.split()
            result.lines = int(lines)
            # a QUARANTINED slot is held by its deadline (passed here), not by a handle
            owned = [
                s
                for s in range(SLOTS)
                if checker.slot_info(s)[2] == actor_index
                and checker.slot_info(s)[0] is not State.QUARANTINED
            ]
            if owned:
                problems.append(f"the live actor owns slots {owned} that no handle refers to")
            _drain(checker, delivered, problems)  # no reader is blocked by the live actor
            _send(from_checker, "exit")
        elif reply:
            problems.append(f"actor failed: {reply}")
        else:
            result.outcome = "killed"
        os.waitpid(actor, 0)
        checker.reap()
        _drain(checker, delivered, problems)
    finally:
        os.close(from_checker)
        os.close(from_actor)
    after = checker.stats().counters
    d = {k: after[k] - before[k] for k in after}
    mine = len(delivered)
    actor_takes = d["takes"] - mine - held_by_dead
    actor_releases = d["releases"] - mine
    actor_published = d["publishes"] - len(tags)
    rows = len(tags) + actor_published
    if actor_published not in (0, 1):
        problems.append(f"{actor_published} publications by the actor")
    if actor_published and not actor_releases and tag not in [t for t, _ in delivered]:
        problems.append("the actor's published row was lost")
    if len({t for t, _ in delivered}) != mine:
        problems.append(f"a row was delivered twice to the checker: {delivered}")
    if rows != mine + actor_releases + d["cancels"]:
        problems.append(
            f"{rows} rows, but {mine} delivered, {actor_releases} consumed by the actor, "
            f"{d['cancels']} cancelled"
        )
    if sum(n for _, n in delivered) != actor_takes + held_by_dead - actor_releases:
        problems.append(f"deliveries reported {delivered} after {actor_takes} actor takes")
    stats = checker.stats()
    if stats.owned or checker.check_consistency():
        problems.append(f"not settled: {stats.states} {checker.check_consistency()}")
    claimed = [checker.claim(tag=0, timeout=1.0) for _ in range(SLOTS)]  # every slot claimable
    for ws in claimed:
        ws.abort()
    if any(s != State.FREE for s in (checker.slot_info(i)[0] for i in range(SLOTS))):
        problems.append("a slot is not FREE after the claim-all check")
    return result


def _points(lines: int) -> list[int]:
    if lines <= MAX_POINTS:
        return list(range(1, lines + 1))
    return sorted({1 + i * (lines - 1) // (MAX_POINTS - 1) for i in range(MAX_POINTS)})


def sweep(name: str, kill: bool, out: Queue[dict[str, Any]]) -> None:
    """In a spawned zygote: every operation at every (sampled) kill point."""
    torch.set_num_threads(1)
    report: dict[str, Any] = {"points": {}, "problems": []}
    try:
        with SlotTable.create(name, SMALL, slots=SLOTS) as checker:
            tag = 1000
            for op_name in OPS:
                tag += 1000
                full = _run_once(checker, op_name, 0, kill, tag)  # no kill: how many lines
                report["problems"] += [f"{op_name} uninterrupted: {p}" for p in full.problems]
                points = _points(full.lines)
                report["points"][op_name] = len(points)
                for limit in points:
                    tag += 10
                    got = _run_once(checker, op_name, limit, kill, tag)
                    if kill and got.outcome not in ("killed", "done"):
                        got.problems.append(f"outcome {got.outcome!r} in kill mode")
                    where = f"{op_name} at line {limit}"
                    report["problems"] += [f"{where}: {p}" for p in got.problems]
    except Exception as exc:  # reported, so the test fails with it instead of timing out
        report["problems"].append(f"{where if 'where' in dir() else 'setup'}: {exc!r}")
    out.put(report)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill", [False, True], ids=["interrupt", "sigkill"])
def test_every_line_event_is_a_safe_place_to_stop(
    name: str, children: Children, kill: bool
) -> None:
    assert name.startswith(PREFIX)
    out: Queue[dict[str, Any]] = SPAWN.Queue()
    children.start(sweep, name, kill, out)
    report = out.get(timeout=220)
    children.join_all(timeout=30)
    assert report["problems"] == []
    assert set(report["points"]) == set(OPS)
    assert all(n >= 1 for n in report["points"].values()), report["points"]
