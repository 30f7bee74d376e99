"""The same-host planner's rule on tables of regions alone (planning reads no memory), GPU
regions included, so the routing of a call that mixes host and GPU blocks is checked on a
machine without CUDA too."""

from __future__ import annotations

import numpy as np
import pytest

from shmslots.sglang.samehost import Region, TransferError
from shmslots.sglang.samehost.plan import plan
from shmslots.sglang.samehost.regions import EMPTY, RegionTable

MiB = 1 << 20
GPU = "GPU-0f0f0f0f-0000-0000-0000-000000000000"
# here: host at 1 MiB, GPU at 64 MiB; the peer: host at 8 MiB, GPU at 128 MiB
OWN = RegionTable.of([Region(1 * MiB, MiB), Region(64 * MiB, MiB, device=GPU, handle="h")])
THEIRS = RegionTable.of([Region(8 * MiB, MiB), Region(128 * MiB, MiB, device=GPU, handle="h")])
HOST_ONLY = RegionTable.of([Region(1 * MiB, MiB), Region(4 * MiB, MiB)])


def _plan(own: RegionTable, theirs: RegionTable, blocks: list[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    sources, targets, lengths = zip(*blocks, strict=True) if blocks else ((), (), ())
    return plan(own, theirs, "peer", sources, targets, lengths)


def test_host_and_gpu_blocks_in_one_call_take_their_own_routes_in_call_order() -> None:
    blocks = [
        (64 * MiB, 128 * MiB, 64),  # GPU to GPU
        (1 * MiB, 8 * MiB, 32),  # host to host
        (64 * MiB + 64, 128 * MiB + 64, 16),  # GPU again
        (1 * MiB + 32, 8 * MiB + 32, 8),  # host again
    ]
    got = _plan(OWN, THEIRS, blocks)
    assert got.src.tolist() == [b[0] for b in blocks]
    assert got.dst.tolist() == [b[1] for b in blocks]
    assert got.n.tolist() == [b[2] for b in blocks]
    assert [got.routes[r] for r in got.route.tolist()] == [GPU, None, GPU, None]
    assert [got.regions[i].base for i in got.region.tolist()] == [128 * MiB, 8 * MiB] * 2


def test_a_host_only_call_is_one_route_and_keeps_its_order() -> None:
    blocks = [(4 * MiB + 8, 8 * MiB + 100, 4), (1 * MiB, 8 * MiB, 4), (4 * MiB, 8 * MiB + 50, 8)]
    got = _plan(HOST_ONLY, THEIRS, blocks)
    assert got.routes == [None]
    assert got.route.tolist() == [0, 0, 0]
    assert got.src.tolist() == [b[0] for b in blocks]


@pytest.mark.parametrize(
    ("block", "why"),
    [
        ((1 * MiB, 128 * MiB, 8), "cross between host and GPU"),  # host to GPU
        ((64 * MiB, 8 * MiB, 8), "cross between host and GPU"),  # GPU to host
        ((MiB - 8, 8 * MiB, 8), "not registered here"),  # below every region here
        ((1 * MiB, 8 * MiB - 8, 8), "not inside memory the peer"),  # below every peer region
        ((1 * MiB, 8 * MiB + MiB - 4, 8), "not inside memory the peer"),  # past its end
        ((-(1 << 20), 8 * MiB, 8), "not registered here"),  # a negative address
        ((1 * MiB, 8 * MiB, -8), "negative length"),
        ((1 * MiB, 8 * MiB, 1 << 63), "run past any address"),
        ((1 << 62, 8 * MiB, 8), "not registered here"),  # past the array lookup's limit
        # sums that would wrap in int64: each refused in Python ints
        (((1 << 63) - 4, 8 * MiB, 8), "run past any address"),
        ((1 * MiB, (1 << 63) - 4, 8), "run past any address"),
        ((1 * MiB, 8 * MiB, (1 << 63) - 1), "run past any address"),
    ],
)
def test_a_block_outside_the_rule_is_refused_whole(block: tuple[int, int, int], why: str) -> None:
    good = (1 * MiB, 8 * MiB, 8)
    with pytest.raises(TransferError, match=why):
        _plan(OWN, THEIRS, [good, block, good])


def test_an_empty_table_holds_nothing() -> None:
    with pytest.raises(TransferError, match="not inside memory the peer"):
        _plan(OWN, EMPTY, [(1 * MiB, 8 * MiB, 8)])
    with pytest.raises(TransferError, match="not registered here"):
        _plan(EMPTY, THEIRS, [(1 * MiB, 8 * MiB, 8)])
    assert len(_plan(EMPTY, EMPTY, []).src) == 0


def test_a_block_over_two_adjacent_regions_is_placed_in_pieces() -> None:
    split = RegionTable.of([Region(8 * MiB, MiB), Region(9 * MiB, MiB)])
    got = _plan(HOST_ONLY, split, [(1 * MiB, 9 * MiB - 16, 32), (1 * MiB, 8 * MiB, 4)])
    assert got.dst.tolist() == [9 * MiB - 16, 9 * MiB, 8 * MiB]
    assert got.n.tolist() == [16, 16, 4]
    assert got.src.tolist() == [1 * MiB, 1 * MiB + 16, 1 * MiB]
    assert np.array_equal(got.region, [0, 1, 0])


GPU_ONLY = RegionTable.of([Region(64 * MiB, MiB, device=GPU, handle="h")])
PEER_HOST_ONLY = RegionTable.of([Region(8 * MiB, MiB)])


@pytest.mark.parametrize(
    ("own", "theirs", "first", "crossing"),
    [
        (HOST_ONLY, THEIRS, (1 * MiB, 8 * MiB, 8), (1 * MiB, 128 * MiB, 8)),
        (GPU_ONLY, THEIRS, (64 * MiB, 128 * MiB, 8), (64 * MiB, 8 * MiB, 8)),
        (OWN, PEER_HOST_ONLY, (1 * MiB, 8 * MiB, 8), (64 * MiB, 8 * MiB, 8)),
    ],
)
def test_a_table_of_one_kind_beside_a_mixed_one_still_routes_every_block(
    own: RegionTable,
    theirs: RegionTable,
    first: tuple[int, int, int],
    crossing: tuple[int, int, int],
) -> None:
    """A good block first, then one crossing between host and GPU memory: refused, whichever
    side's table holds one kind only."""
    with pytest.raises(TransferError, match="cross between host and GPU"):
        _plan(own, theirs, [first, crossing])


def test_columns_of_different_lengths_are_refused() -> None:
    with pytest.raises(TransferError, match="as many"):
        plan(OWN, THEIRS, "peer", [1 * MiB], [8 * MiB, 8 * MiB + 8], [8, 8])
