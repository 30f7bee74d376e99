"""The compiled atomics: results, bounds checks and futex behaviour."""

from __future__ import annotations

import mmap
import threading
import time

import pytest

from shmslots._atomic import AtomicView


def test_cas_load_store_and_rmw() -> None:
    mm = mmap.mmap(-1, 64)
    a = AtomicView(mm)
    assert a.load(8) == 0
    assert a.cas(8, 0, 5) and not a.cas(8, 0, 6)
    assert a.load(8) == 5
    assert a.add(8, -2) == 5 and a.load(8) == 3
    assert a.fetch_or(8, 0b1000) == 3 and a.load(8) == 0b1011
    assert a.fetch_and(8, 0b0011) == 0b1011 and a.load(8) == 0b0011
    a.store(16, 2**64 - 1)
    assert a.load(16) == 2**64 - 1
    assert a.add32(24, 1) == 0 and a.load32(24) == 1
    a.release()
    mm.close()


@pytest.mark.parametrize("off", [-8, 60, 64, 3])
def test_out_of_range_or_misaligned_offsets_raise(off: int) -> None:
    mm = mmap.mmap(-1, 64)
    a = AtomicView(mm)
    with pytest.raises(IndexError):
        a.load(off)
    with pytest.raises(IndexError):
        a.cas(off, 0, 1)
    a.release()
    mm.close()


def test_released_view_refuses_access_and_frees_the_buffer() -> None:
    mm = mmap.mmap(-1, 64)
    a = AtomicView(mm)
    with pytest.raises(BufferError):
        mm.close()
    a.release()
    with pytest.raises(ValueError):
        a.load(0)
    mm.close()


def test_futex_wait_times_out_and_is_woken() -> None:
    mm = mmap.mmap(-1, 64)
    a = AtomicView(mm)
    t0 = time.monotonic()
    assert a.futex_wait(0, 0, 0.05) is False
    assert time.monotonic() - t0 >= 0.04
    assert a.futex_wait(0, 1, 1.0) is True  # value differs: returns at once

    def waker() -> None:
        time.sleep(0.05)
        a.add32(0, 1)
        a.futex_wake(0, 1)

    thread = threading.Thread(target=waker)
    thread.start()
    t0 = time.monotonic()
    assert a.futex_wait(0, 0, 5.0) is True
    assert time.monotonic() - t0 < 2.0
    thread.join()
    a.release()
    mm.close()
