"""What a same-host engine's registered memory is: `Region`s, sorted into a `RegionTable`,
and `classify`, which tells what a range of this process is (a /dev/shm file, anonymous
memory that may be moved onto a memfd, or a GPU allocation shared by CUDA IPC)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ...segment import SHM_DIR, valid_name
from .. import cuda_kv
from .errors import TransferError

ADDRESS_END = 1 << 63  # registered bases and lengths lie below it (`registry.parse_regions`)


@dataclass(frozen=True)
class Region:
    """One registered range; `shm` names the /dev/shm file it lies in, or `memfd` is the
    owner's descriptor of the memfd it lies in, if any; `offset` is the range's in that
    file.  A GPU range names its device's UUID and the CUDA IPC handle of the allocation
    holding it, `offset` being its offset in that allocation (cuda_kv)."""

    base: int
    length: int
    shm: str | None = None
    inode: int = 0
    offset: int = 0
    memfd: int = -1
    device: str | None = None
    handle: str | None = None

    @property
    def end(self) -> int:
        return self.base + self.length

    @property
    def mapped(self) -> bool:
        """Whether a peer writes it through its own mapping of the file (else by
        process_vm_writev into the owner's address space)."""
        return self.shm is not None or self.memfd >= 0


@dataclass(frozen=True, eq=False)
class RegionTable:
    """Regions sorted by base, with their bases and ends as arrays: made once each time a
    registry changes, so that planning a transfer (plan.py) looks its blocks up in them
    without building them again.  Read unlocked by transfers on other threads: swapped
    whole, never changed (the arrays are read-only)."""

    regions: tuple[Region, ...]
    bases: np.ndarray  # int64, for a transfer's blocks at once (searchsorted)
    ends: np.ndarray  # int64, each capped below 2**63, then a -1 (so `ends[-1]`, read for
    # an address below every base, is there in an empty table too)
    device: np.ndarray  # int64: one number per GPU (same GPU, same number), -1 for host
    one_device: bool  # all host memory, or all one GPU's: a transfer's blocks take one route

    @classmethod
    def of(cls, regions: Iterable[Region]) -> RegionTable:
        ordered = tuple(sorted(regions, key=lambda r: r.base))
        gpus = {uuid: i for i, uuid in enumerate(sorted({r.device for r in ordered if r.device}))}
        arrays = (
            np.array([r.base for r in ordered], dtype=np.int64),
            np.array([*(min(r.end, ADDRESS_END - 1) for r in ordered), -1], dtype=np.int64),
            np.array([gpus.get(r.device or "", -1) for r in ordered], dtype=np.int64),
        )
        for array in arrays:
            array.setflags(write=False)
        return cls(ordered, *arrays, one_device=len({r.device for r in ordered}) <= 1)


EMPTY = RegionTable.of([])


def mappings() -> list[tuple[int, int, str, int, int, str]]:
    """(start, end, perms, offset, inode, path) of each mapping of this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            out.append((start, end, parts[1], int(parts[2], 16), int(parts[4]), path))
    return out


def classify_host(base: int, length: int, shared: bool = True) -> tuple[Region, bool]:
    """The region at [base, base+length) of this process, and whether it may be moved onto
    a memfd (to be `shared`, and all private anonymous memory, none of it pinned);
    TransferError when it is not writable host memory (a CUDA allocation, a read-only or
    unmapped range)."""
    if base <= 0 or length <= 0:
        raise TransferError(f"cannot register {length} bytes at {base:#x}")
    maps = mappings()
    end = base + length
    at = base
    covering = []
    for m in maps:
        if m[1] <= at or m[0] > at:
            continue
        if "r" not in m[2] or "w" not in m[2]:
            break
        covering.append(m)
        at = m[1]
        if at >= end:
            break
    if at < end:
        raise TransferError(
            f"{length} bytes at {base:#x} are not all readable and writable host memory of this "
            "process (a read-only or unmapped range is refused here, at registration)"
        )
    first = covering[0]
    path = first[5]
    mapped_shared = first[2][3] == "s"  # a private mapping keeps its own copies of pages
    name = path[len(SHM_DIR) + 1 :]
    if (
        len(covering) == 1
        and mapped_shared
        and path.startswith(SHM_DIR + "/")
        and not path.endswith("(deleted)")
        and valid_name(name)  # one peers take (not in a subdirectory, say)
        and _ours(path, first[4])
    ):
        return Region(base, length, name, first[4], first[3] + (base - first[0])), False
    anonymous = all(m[2][3] == "p" and m[5] in ("", "[heap]") for m in covering)
    movable = shared and anonymous and not _cuda_runs() and not _pinned(base, end)
    return Region(base, length), movable


def _ours(path: str, inode: int) -> bool:
    """Whether `path` is still the file of `inode`, and this user's: peers open it by its
    name and refuse another user's (one of those goes as anonymous memory instead)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return st.st_ino == inode and st.st_uid == os.geteuid()


def classify(base: int, length: int, shared: bool = True) -> tuple[Region, bool]:
    """`classify_host`, or where the range is not host memory, a GPU range by CUDA IPC (never
    moved); TransferError for anything else, and DeviceError for device memory CUDA IPC
    cannot share.  A range not `shared` (only copied from) is never moved, and any device
    memory will do for it."""
    try:
        return classify_host(base, length, shared)
    except TransferError as refusal:
        drv = cuda_kv.driver() if base > 0 and length > 0 else None
        found = drv.describe(base, length, shared) if drv is not None else None
        if found is None:
            raise refusal from None
    region = Region(base, length, offset=found.offset, device=found.uuid, handle=found.handle)
    return region, False


def _cuda_runs() -> bool:
    """Whether this process has (or may have) started CUDA, which can hold host pages by
    registration (`cudaHostRegister`) without marking them in /proc: then no range is
    moved.  (CUDA started other than through torch is not seen.)"""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # torch half imported on another thread: assume the worst
        return True


PINNED_FLAGS = {"lo", "dc", "io", "pf"}  # mlocked, MADV_DONTFORK (CUDA, RDMA), I/O, PFN


def _pinned(base: int, end: int) -> bool:
    """Whether any mapping over [base, end) carries a flag of memory something else may hold
    by its physical pages (mlocked, or MADV_DONTFORK as an RDMA memory region is under
    `ibv_fork_init`): moving such pages would leave the holder on the old ones.  A long-term
    pin leaves no flag (`_cuda_runs` covers CUDA's)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > base
            elif inside and head == "VmFlags:" and PINNED_FLAGS & set(line.split()[1:]):
                return True
    return False
