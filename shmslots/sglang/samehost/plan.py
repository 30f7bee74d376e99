"""A transfer's plan: every block checked against both sides' registered regions, and
routed (host to host, or GPU to GPU on one GPU's stream), before any byte is written.  One
rule says what may be copied where (`_route`); SGLang's blocks, each inside one region on
each side, are placed by array lookups, and any other block by the same rule, piece by
piece."""

from __future__ import annotations

import bisect
import operator
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import TransferError
from .regions import ADDRESS_END, Region, RegionTable


@dataclass(frozen=True)
class Plan:
    """A transfer's blocks, every one checked: per block its source, its target (the peer's
    address), its length, the index of the peer's region holding the target, and its route,
    an index into `routes`: the GPU (UUID) whose stream copies it, or None, host to host."""

    src: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    region: np.ndarray
    route: np.ndarray
    routes: list[str | None]
    regions: tuple[Region, ...]  # the peer's, as read for this plan


ADDRESS_LIMIT = 1 << 62  # a block at or past it is planned alone (Python's ints, no wrap)


def plan(
    own: RegionTable,
    theirs: RegionTable,
    peer: str,
    sources: Sequence[int],
    targets: Sequence[int],
    lengths: Sequence[int],
) -> Plan:
    """Every block of a transfer checked against both sides' regions before any is written:
    TransferError for the first block that is not wholly inside registered memory on each
    side, or that crosses between host and GPU memory (`_route`).  The blocks that one region
    holds on each side (SGLang's, always) are placed by array lookups and routed once per
    kind (source device, target on a GPU or not); any other, across adjacent regions or odd,
    goes through `_cover` alone (the same rule, block by block)."""
    if not len(sources) == len(targets) == len(lengths):
        raise TransferError("sources, targets and lengths must be as many")
    arrays = [_int64(a) for a in (sources, targets, lengths)]
    if any(a is None for a in arrays):  # each block is then read as a Python int below
        sources, targets, lengths = list(sources), list(targets), list(lengths)
        arrays = [np.full(len(sources), -1, dtype=np.int64)] * 3
    src, dst, n = (a for a in arrays if a is not None)
    # looked up by arrays: lengths and addresses below 2**62, so no sum wraps (a negative
    # address lies below every region)
    plain = (n > 0) & (n < ADDRESS_LIMIT) & (src < ADDRESS_LIMIT) & (dst < ADDRESS_LIMIT)
    mine, their = _holder(own, src, n), _holder(theirs, dst, n)
    whole = plain & (mine >= 0) & (their >= 0)
    routes: list[str | None] = []
    route = _routes(own, theirs, src, dst, n, mine, their, whole, routes)
    if whole.all():  # SGLang's calls: nothing to place piece by piece, the call's order kept
        return Plan(src, dst, n, their, route, routes, theirs.regions)
    extra: list[list[int]] = [[], [], [], [], [], []]  # src, dst, n, region, route, block
    for k in np.flatnonzero(~whole & (n != 0)).tolist():
        try:
            s, d, length = (integer(v) for v in (sources[k], targets[k], lengths[k]))
        except TypeError:  # a float (16.9 bytes is no length), a string, a list
            raise TransferError(
                f"block {k} {reprlib.repr((sources[k], targets[k], lengths[k]))} is not three "
                "integers"
            ) from None
        if length <= 0:
            if length < 0:
                raise TransferError(f"negative length {length}")
            continue
        if max(s, d) + length > ADDRESS_END:
            raise TransferError(f"{length} bytes from {s:#x} to {d:#x} run past any address")
        held = _cover(own, s, length)
        if not held:
            raise TransferError(f"{length} bytes at {s:#x} are not registered here")
        pieces = _cover(theirs, d, length)
        if not pieces:
            raise TransferError(
                f"{length} bytes at {d:#x} are not inside memory the peer {peer!r} registered"
            )
        gpu = _route(
            [own.regions[i] for _, _, i in held],
            [theirs.regions[i] for _, _, i in pieces],
            s,
            d,
            length,
        )
        code = _index(routes, gpu)
        for a, k2, i in pieces:
            for column, value in zip(extra, (s + (a - d), a, k2, i, code, k), strict=True):
                column.append(value)
    more = [np.array(column, dtype=np.int64) for column in extra]
    # every placed block or piece keeps its call's order: where targets overlap, the
    # later block lands last, as it did block by block (cuda_kv keeps that order too)
    order = np.argsort(np.concatenate([np.flatnonzero(whole), more[5]]), kind="stable")
    return Plan(
        np.concatenate([src[whole], more[0]])[order],
        np.concatenate([dst[whole], more[1]])[order],
        np.concatenate([n[whole], more[2]])[order],
        np.concatenate([their[whole], more[3]])[order],
        np.concatenate([route[whole], more[4]])[order],
        routes,
        theirs.regions,
    )


def _routes(
    own: RegionTable,
    theirs: RegionTable,
    src: np.ndarray,
    dst: np.ndarray,
    n: np.ndarray,
    mine: np.ndarray,
    their: np.ndarray,
    whole: np.ndarray,
    routes: list[str | None],
) -> np.ndarray:
    """Per block, its index into `routes` (appended to), for the blocks one region holds on
    each side (`whole`; any other gets 0, unread).  All that `_route` reads of such a block
    is the source's device and whether the target is a GPU's: a kind or two per transfer,
    so `_route` runs once per kind, not once per block."""
    placed = np.flatnonzero(whole)
    which = np.zeros(len(src), dtype=np.int64)
    if not len(placed):
        return which
    if own.one_device and theirs.one_device:  # one kind (SGLang's calls): one route
        first = placed[:1]
    else:
        kinds = own.device[mine[placed]] * 2 + (theirs.device[their[placed]] >= 0)
        _, first_of_kind, inverse = np.unique(kinds, return_index=True, return_inverse=True)
        first = placed[first_of_kind]
        which[placed] = inverse.reshape(-1)
    codes = []
    for k in first.tolist():  # the first block of each kind
        held, into = own.regions[mine[k]], theirs.regions[their[k]]
        codes.append(_index(routes, _route([held], [into], int(src[k]), int(dst[k]), int(n[k]))))
    return np.array(codes, dtype=np.int64)[which]


def _int64(values: Sequence[int]) -> np.ndarray | None:
    """`values` as a flat int64 array where they are integers (uint64 past 2**63 wraps
    negative: such a block is planned alone), else None (floats, bools, anything odd: read
    one by one, `integer`)."""
    try:
        array = np.asarray(values)
    except Exception:
        return None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        return None
    return array.astype(np.int64)


def integer(value: object) -> int:
    """`value` as a Python int if it is an integer (numpy's included; a bool is one, to
    Python and to numpy's arrays alike), never a float or a string cut down to one."""
    return operator.index(value)  # type: ignore[arg-type]


def _index(items: list[str | None], item: str | None) -> int:
    """`item`'s index in `items`, appended if new (a transfer has a route or two)."""
    if item not in items:
        items.append(item)
    return items.index(item)


def _route(mine: list[Region], theirs: list[Region], src: int, dst: int, n: int) -> str | None:
    """The GPU whose stream copies `n` bytes from `src` (in the regions `mine`, registered
    here) to `dst` (in the peer's `theirs`), or None for host to host: the one rule of what
    may be copied where.  TransferError for host to GPU, GPU to host, a block over two GPUs
    or over two CUDA allocations."""
    gpus = {r.device for r in mine}
    if len(gpus) > 1 or {r.device is None for r in theirs} != {None in gpus}:
        raise TransferError(
            f"{n} bytes from {src:#x} to {dst:#x} cross between host and GPU memory, "
            "or span GPUs: the same-host engine copies host to host and GPU to GPU"
        )
    if None not in gpus and len(mine) > 1:  # one copy may not span CUDA allocations
        raise TransferError(f"{n} GPU bytes at {src:#x} span ranges registered apart")
    return gpus.pop()


def _holder(table: RegionTable, address: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per block, the index in `table` of the one region that holds all its `n` bytes at
    `address`, or -1 (read only for `plain` blocks: any other may have wrapped)."""
    i = np.searchsorted(table.bases, address, side="right") - 1
    return np.where(address + n <= table.ends[i], i, -1)  # i == -1: below every base


def _cover(table: RegionTable, address: int, length: int) -> list[tuple[int, int, int]]:
    """The (address, length, region's index) pieces of `length` bytes at `address` over
    adjacent regions of `table` (a moved range is published as up to three), or [] where any
    byte lies outside them."""
    regions = table.regions
    i = bisect.bisect_right(regions, address, key=lambda r: r.base) - 1
    pieces = []
    at, end = address, address + length
    while 0 <= i < len(regions) and regions[i].base <= at < regions[i].end:
        r = regions[i]
        pieces.append((at, min(end, r.end) - at, i))
        at = r.end
        if at >= end:
            return pieces
        i += 1
    return []
