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


def test_runs_of_words_are_claimed_and_given_back() -> None:
    """claim_run/cas_run: the arena's page table taken and given back, one call each."""
    mm = mmap.mmap(-1, 8 * 16)
    a = AtomicView(mm)

    def words() -> list[int]:
        return [a.load(8 * i) for i in range(16)]

    a.store(8 * 2, 7)  # a page that is someone else's
    assert a.claim_run(0, 16, 2, 0, 9) == 0  # first fit
    assert a.claim_run(0, 16, 2, 1, 9) == 3  # from the hint: word 1 is taken, word 2 foreign
    assert a.claim_run(0, 16, 12, 0, 8) == -1  # 11 free words in a row at most
    assert words() == [9, 9, 7, 9, 9] + [0] * 11  # a failed claim takes nothing
    assert a.claim_run(0, 16, 2, 15, 9) == 5  # a hint too near the end: from 0
    assert a.cas_run(8 * 9, 7, 0, 4, True) == 7
    assert a.claim_run(0, 16, 2, 9, 9) == 7  # nothing from the hint on: then from 0
    assert words() == [9, 9, 7] + [9] * 6 + [4] * 7
    a.store(8 * 5, 4)  # a word that is someone else's
    assert a.cas_run(8 * 3, 13, 9, 0, True) == 2  # stops at it
    assert a.cas_run(8 * 3, 13, 9, 0, False) == 3  # goes on past it
    assert words() == [9, 9, 7, 0, 0, 4, 0, 0, 0] + [4] * 7
    assert a.cas_run(0, 0, 0, 1, True) == 0
    for need, start, tag in ((0, 0, 1), (1, -1, 1), (1, 0, 0)):  # no run, no place, no owner
        with pytest.raises(ValueError):
            a.claim_run(0, 16, need, start, tag)
    a.release()
    mm.close()


@pytest.mark.parametrize(
    ("off", "count", "error"),
    [(0, 9, IndexError), (8, 8, IndexError), (3, 1, IndexError), (-8, 1, IndexError),
     (0, -1, ValueError)],
)  # fmt: skip
def test_runs_past_the_buffer_raise_and_change_nothing(
    off: int, count: int, error: type[Exception]
) -> None:
    mm = mmap.mmap(-1, 64)
    a = AtomicView(mm)
    with pytest.raises(error):
        a.claim_run(off, count, 1, 0, 1)
    with pytest.raises(error):
        a.cas_run(off, count, 0, 1, True)
    assert bytes(mm) == bytes(64)
    a.release()
    mm.close()


@pytest.mark.parametrize("call", ["cas_run", "add", "add32", "futex_wake", "futex_wait"])
def test_arguments_that_run_python_are_read_before_the_word(call: str) -> None:
    """An argument whose __bool__/__index__/__float__ releases the view and unmaps the
    buffer must find it released, not leave the call writing to freed memory."""
    mm = mmap.mmap(-1, 1 << 20)
    a = AtomicView(mm)

    class Sneaky:
        def _unmap(self) -> None:
            a.release()
            mm.close()

        def __bool__(self) -> bool:
            self._unmap()
            return True

        def __index__(self) -> int:
            self._unmap()
            return 1

        def __float__(self) -> float:
            self._unmap()
            return 0.0

    args = {
        "cas_run": (0, 1 << 17, 0, 1, Sneaky()),
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
