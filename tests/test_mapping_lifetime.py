"""A table closed on one thread while another copies into its mapping: an error, not SIGSEGV.

Big copies run with the GIL released, so `close()` on another thread can land in
the middle of one; unmapping then would crash the copy.  Each case runs in a
spawned child, so a crash shows as its exit code instead of killing the tests.
"""

from __future__ import annotations

import contextlib
import threading
import time
from multiprocessing.queues import Queue
from typing import Any

import pytest
import torch
from conftest import SPAWN, Children
from torch.overrides import TorchFunctionMode

from shmslots import Field, ShmSlotsError, SlotTable

BIG = 64 * 2**20 - 64  # a row of nearly 64 MiB


class _Passthrough(TorchFunctionMode):
    """Any torch-function mode sends writes down the checked Python path."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _write_until_closed(table: SlotTable, path: str, started: threading.Event) -> str:
    big = torch.ones(BIG, dtype=torch.uint8)
    try:
        with _Passthrough() if path == "python" else contextlib.nullcontext():
            for _ in range(1000):
                ws = table.claim(timeout=1)
                started.set()
                ws.write(big=big)
                ws.abort()
        return "ok"
    except ShmSlotsError as exc:  # the slot went with the table
        return f"ShmSlotsError: {exc}"
    except ValueError as exc:  # the next claim found the table closed
        return f"ValueError: {exc}" if "closed" in str(exc) else f"unexpected: {exc!r}"


def _close_under_a_copy(name: str, path: str, results: Queue[str]) -> None:
    table = SlotTable.create(name, [Field("big", "uint8", (BIG,))], slots=2)
    started = threading.Event()
    outcome: list[str] = []
    writer = threading.Thread(
        target=lambda: outcome.append(_write_until_closed(table, path, started))
    )
    writer.start()
    assert started.wait(30)
    time.sleep(0.05)  # well inside the loop: most of it is a copy with the GIL released
    table.close()
    writer.join(60)
    table.unlink()
    results.put(outcome[0] if outcome else "writer did not finish")


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_closing_a_table_under_a_big_copy_does_not_crash(
    name: str, children: Children, path: str
) -> None:
    results: Queue[str] = SPAWN.Queue()
    proc = children.start(_close_under_a_copy, name, path, results)
    proc.join(90)
    assert proc.exitcode == 0, f"child exited with {proc.exitcode} (-11: SIGSEGV)"
    outcome = results.get(timeout=5)
    assert outcome.startswith(("ShmSlotsError", "ValueError")), outcome
