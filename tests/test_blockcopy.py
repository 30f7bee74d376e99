"""The same-host engine's host copy (csrc/blockcopy.c): memmove's result for every block,
whether it is streamed past the cache (large, disjoint) or moved (small, or overlapping)."""

from __future__ import annotations

import numpy as np
import pytest

from shmslots._core import copy_blocks

STREAM = 64 * 1024  # blockcopy.c's STREAM_BYTES


def _reference(buf: np.ndarray, blocks: list[tuple[int, int, int]]) -> np.ndarray:
    """memmove of each block in order, by numpy (a copy of the source first)."""
    out = buf.copy()
    for src, dst, n in blocks:
        out[dst : dst + n] = out[src : src + n].copy()
    return out


def _run(buf: np.ndarray, blocks: list[tuple[int, int, int]]) -> None:
    base = buf.ctypes.data
    copy_blocks([(base + s, base + d, n) for s, d, n in blocks])


@pytest.mark.parametrize(
    "length",
    [1, 63, 64, 4095, STREAM - 1, STREAM, STREAM + 1, STREAM + 15, STREAM + 63, 3 * STREAM + 7],
)
@pytest.mark.parametrize("skew", [(0, 0), (1, 0), (0, 1), (5, 11), (15, 3), (33, 48)])
def test_each_block_lands_whole_at_any_alignment(length: int, skew: tuple[int, int]) -> None:
    rng = np.random.default_rng(length * 100 + skew[0] * 10 + skew[1])
    size = 2 * length + 4096
    buf = rng.integers(0, 256, size, dtype=np.uint8)
    src, dst = 64 + skew[0], length + 2048 + skew[1]  # disjoint, each byte distinct-ish
    want = _reference(buf, [(src, dst, length)])
    _run(buf, [(src, dst, length)])
    assert np.array_equal(buf, want)  # the bytes around the target untouched too


@pytest.mark.parametrize("shift", [1, 16, 64, 4096, STREAM // 2])
def test_overlapping_blocks_move_as_memmove_does(shift: int) -> None:
    length = 2 * STREAM + 5
    rng = np.random.default_rng(shift)
    for src, dst in ((shift, 0), (0, shift)):  # target below the source, then above it
        buf = rng.integers(0, 256, length + shift + 128, dtype=np.uint8)
        want = _reference(buf, [(src, dst, length)])
        _run(buf, [(src, dst, length)])
        assert np.array_equal(buf, want)


def test_a_call_of_many_blocks_lands_in_call_order() -> None:
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    blocks = []
    for _ in range(40):
        n = int(rng.choice([17, 4096, STREAM, STREAM + 9, 200_001]))
        s, d = (int(x) for x in rng.integers(0, len(buf) - n, 2))
        blocks.append((s, d, n))  # some overlap others: the later lands last
    want = _reference(buf, blocks)
    _run(buf, blocks)
    assert np.array_equal(buf, want)
