"""Shared fixtures: unique table names, leak checks on /dev/shm, reaped child processes."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from multiprocessing.context import SpawnProcess
from typing import Any

import pytest
import torch

from shmslots import Field

PREFIX = f"shmslots-test-{os.getpid()}-"
_names = itertools.count()
SPAWN = mp.get_context("spawn")

SMALL = (Field("id", "int64"), Field("p", "float32", (4,)), Field("h", "bfloat16", (2, 8)))


def row_bytes(t: Any, slot: int) -> bytes:
    """Every byte of a slot's row as the table stores it: each column's item, in field order,
    padding included (what "nothing changed" compares)."""
    mm = t._segment.mm
    return b"".join(
        bytes(mm[at : at + fs.item_len])
        for name, fs in t.schema.slots.items()
        for at in (t._rows.item(slot, name),)
    )


def small_row(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "p": torch.full((4,), float(i)),
        "h": torch.full((2, 8), float(i % 100), dtype=torch.bfloat16),
    }


def kill_point(point: str) -> int:
    """A point inside a compiled step where `_core._kill_at` SIGKILLs the process; only the
    test build has them (setup.py), and a test that needs one fails without it."""
    from shmslots import _core

    points: dict[str, int] | None = getattr(_core, "KILL_POINTS", None)
    if points is None:
        pytest.fail(
            "shmslots is not the test build: install it with SHMSLOTS_KILL_POINTS=1 "
            "(the README's test command does)",
            pytrace=False,
        )
    return points[point]


def _ours() -> set[str]:
    """This run's segments: the tests' own names, and the SGLang plugin's tables made here."""
    mine = f"-{os.getpid()}-"
    return {
        n
        for n in os.listdir("/dev/shm")
        if n.startswith(PREFIX) or (n.startswith("sglang-") and mine in n)
    }


@pytest.fixture(autouse=True)
def no_segment_leak() -> Iterator[None]:
    """Every test must leave /dev/shm as it found it."""
    before = _ours()
    yield
    leaked = _ours() - before
    for name in leaked:
        os.unlink(f"/dev/shm/{name}")
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"


@pytest.fixture
def name() -> str:
    return f"{PREFIX}{next(_names)}"


class Children:
    """Spawned processes that are always reaped, even when the test fails."""

    def __init__(self) -> None:
        self.procs: list[SpawnProcess] = []

    def start(self, target: Callable[..., Any], *args: Any) -> SpawnProcess:
        proc = SPAWN.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join_all(self, timeout: float) -> None:
        for proc in self.procs:
            proc.join(timeout)
        alive = [p.pid for p in self.procs if p.is_alive()]
        assert not alive, f"children still running after {timeout} s: {alive}"
        failed = [(p.pid, p.exitcode) for p in self.procs if p.exitcode not in (0, -9)]
        assert not failed, f"children failed: {failed}"

    def reap(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    try:
        yield kids
    finally:
        kids.reap()
