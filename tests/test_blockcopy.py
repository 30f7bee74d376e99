"""The same-host engine's host copy (csrc/blockcopy.c): memmove's result for every block,
whether it is streamed past the cache (large, disjoint) or moved (small, or overlapping)."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from shmslots._core import COPY_STREAM_BYTES, copy_blocks

STREAM = COPY_STREAM_BYTES or 64 * 1024  # where not streamed, the same cases still hold


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


def test_large_blocks_are_streamed_on_x86_64() -> None:
    """Streaming is an x86-64 build's (SSE2 is in its baseline): not silently lost."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("non-temporal stores are built for x86-64 only")
    assert COPY_STREAM_BYTES == 64 * 1024


@pytest.mark.parametrize("overlap", [-1, 0, 1, 2, 15, 16, 17, 64])
@pytest.mark.parametrize("above", [True, False])
def test_blocks_at_the_edge_of_overlapping(overlap: int, above: bool) -> None:
    """Adjacent (overlap 0), a byte apart (-1) or overlapping by a byte or more: a block
    streamed though it overlaps its source would read bytes it had already written."""
    length = STREAM + 37
    rng = np.random.default_rng(overlap * 2 + above + 100)
    buf = rng.integers(0, 256, 2 * length + 256, dtype=np.uint8)
    a, b = 32, 32 + length - overlap
    src, dst = (a, b) if above else (b, a)
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
