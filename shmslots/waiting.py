"""Spin briefly, then sleep on a futex: waiting that burns no core and holds no lock.

Waiters announce themselves in a counter so that the hot path only pays for
a wake-up syscall when someone is actually asleep.  A waiter that dies while
counted only costs wakers an unneeded syscall; nothing can be left locked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ._atomic import AtomicView

T = TypeVar("T")

SPIN_S = 20e-6
# Sleep at most this long at a time, so `on_idle` (dead-owner checks) runs.
NAP_S = 0.25


def wait_for(
    a: AtomicView,
    attempt: Callable[[], T | None],
    seq: int,
    waiting: int,
    timeout: float | None,
    on_idle: Callable[[], object] | None = None,
) -> T | None:
    """Call `attempt` until it returns non-None or `timeout` seconds pass.

    `seq` is a 32-bit futex word that is bumped whenever `attempt` may have
    become able to succeed; `waiting` counts sleepers on it.
    """
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    result = attempt()
    while result is None and time.monotonic() - start < SPIN_S:
        result = attempt()
    while result is None:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return None
        nap = NAP_S if deadline is None else min(NAP_S, deadline - now)
        a.add(waiting, 1)
        try:
            observed = a.load32(seq)
            result = attempt()
            if result is None and not a.futex_wait(seq, observed, nap) and on_idle is not None:
                on_idle()
        finally:
            a.add(waiting, -1)
        if result is None:
            result = attempt()
    return result


def wake_all(a: AtomicView, seq: int, waiting: int) -> None:
    a.add32(seq, 1)
    if a.load(waiting):
        a.futex_wake(seq, -1)
