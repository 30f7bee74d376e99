"""The compiled atomics: results, bounds checks and futex behaviour."""

from __future__ import annotations

import mmap
import threading
import time

import pytest

from shmslots._core import AtomicView, load_acquire, store_release


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


@pytest.mark.parametrize("call", ["add", "add32", "futex_wake", "futex_wait"])
def test_arguments_that_run_python_are_read_before_the_word(call: str) -> None:
    """An argument whose __index__/__float__ releases the view and unmaps the
    buffer must find it released, not leave the call writing to freed memory."""
    mm = mmap.mmap(-1, 1 << 20)
    a = AtomicView(mm)

    class Sneaky:
        def _unmap(self) -> None:
            a.release()
            mm.close()

        def __index__(self) -> int:
            self._unmap()
            return 1

        def __float__(self) -> float:
            self._unmap()
            return 0.0

    args = {
        "add": (0, Sneaky()),
        "add32": (0, Sneaky()),
        "futex_wake": (0, Sneaky()),
        "futex_wait": (0, 1, Sneaky()),
    }[call]
    with pytest.raises(ValueError, match="released"):
        getattr(a, call)(*args)


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


def test_acquire_load_and_release_store_on_any_buffer() -> None:
    """The pair a table's magic is published with: any buffer, read-only ones for loads."""
    mm = mmap.mmap(-1, 64)
    store_release(mm, 8, 2**64 - 1)
    store_release(mm, 56, 7)
    assert load_acquire(mm, 8) == 2**64 - 1 and load_acquire(mm, 56) == 7
    assert AtomicView(mm).load(8) == 2**64 - 1  # the same word the other atomics see
    frozen = bytes(mm)
    assert load_acquire(frozen, 8) == 2**64 - 1  # read-only: the CLI's mapping
    with pytest.raises(BufferError):
        store_release(frozen, 8, 1)
    for off in (-8, 60, 64, 3):
        with pytest.raises(IndexError):
            load_acquire(mm, off)
        with pytest.raises(IndexError):
            store_release(mm, off, 1)
    with pytest.raises(OverflowError):
        store_release(mm, 0, -1)
    assert load_acquire(mm, 0) == 0  # nothing written by the refused calls
    mm.close()
