"""Spin briefly, then sleep on a futex: waiting that burns no core and holds no lock.

Sleepers announce themselves so that the hot path only pays for a wake-up
syscall when someone may be asleep: a count of sleepers, and the latest time
any of them may still sleep to (every nap is bounded).  Wakers make the call
only while both say so, so a sleeper killed (or interrupted) while counted
costs them syscalls for one nap at most, never for good; nothing can be left
locked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ._core import AtomicView

T = TypeVar("T")

# Try again without sleeping for this long: a futex wake-up costs tens of µs (40-90 on this
# project's VM), more than a reply that a writer's Python takes to send.
SPIN_S = 50e-6
# Sleep at most this long at a time, so `on_idle` (dead-owner checks) runs.
NAP_S = 0.25
# Added to a sleeper's announced deadline: a sleeper delayed this much between announcing
# and sleeping may miss a wake-up, and then waits out its nap.
DEADLINE_SLACK_NS = 1_000_000_000


def wait_for(
    a: AtomicView,
    attempt: Callable[[], T | None],
    seq: int,
    waiting: int,
    until: int,
    timeout: float | None,
    on_idle: Callable[[], object] | None = None,
) -> T | None:
    """Call `attempt` until it returns non-None or `timeout` seconds pass.

    `seq` is a 32-bit futex word that is bumped whenever `attempt` may have
    become able to succeed; `waiting` counts sleepers on it and `until` holds
    the latest CLOCK_MONOTONIC ns one of them may sleep to.
    """
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    result = attempt()
    spin = SPIN_S if timeout is None else min(SPIN_S, timeout)  # never past the deadline
    while result is None and time.monotonic() - start < spin:
        result = attempt()
    while result is None:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return None
        nap = NAP_S if deadline is None else min(NAP_S, deadline - now)
        _announce(a, until, time.monotonic_ns() + int(nap * 1e9) + DEADLINE_SLACK_NS)
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


def _announce(a: AtomicView, until: int, deadline_ns: int) -> None:
    """Raise the sleepers' deadline to `deadline_ns` unless it is later already."""
    while (current := a.load(until)) < deadline_ns and not a.cas(until, current, deadline_ns):
        pass
