"""Anonymous memory moved, in place, onto a sealed memfd, so that a peer can map it (and
back onto private pages once it is no longer published).

Registering anonymous memory (the decode's CPU KV and state pools) moves its whole pages onto a
memfd: their content is copied into the file and the file is mapped over them (MAP_FIXED,
64 MiB at a time), so the owner's tensors keep their addresses and bytes.  The memfd is
sealed against shrinking, so a peer's mapping of it can never fault.  The partial pages at
either end stay private (they may hold other allocations).  While a range moves, nothing
else may write it; SGLang registers its pools before serving.  Registered memory must stay
allocated until it is deregistered (as with Mooncake's registrations); deregistering a
range, or closing the engine, moves it back onto private pages (`unshare`).  A child forked
meanwhile does not get the moved pages (MADV_DONTFORK).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterable

from .errors import TransferError
from .regions import Region, mappings

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]  # fmt: skip
_libc.mmap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
]  # fmt: skip
_libc.mremap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED_FIXED = mmap.MAP_SHARED | mmap.MAP_POPULATE | 0x10  # MAP_FIXED: resident, as before
MAP_ANONYMOUS_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
MAP_FAILED = ctypes.c_void_p(-1).value
MREMAP_MAYMOVE_FIXED = 1 | 2
FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
MADV_DONTFORK = 10
MADV_POPULATE_WRITE = 23  # Linux 5.14
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # what a peer's mapping needs: no SIGBUS
MEMFD_NAME = "shmslots-pd"  # /proc/<pid>/maps shows it as /memfd:shmslots-pd

PAGE = mmap.PAGESIZE
SHARE_CHUNK = 64 << 20  # copied and remapped at a time: the most memory the move adds

# Moved ranges are MADV_DONTFORK (as RDMA registrations are): a child made by fork() does
# not get them, rather than share them with its parent (its malloc could write the parent's
# memory) or copy whole pools at every fork.  The guard keeps fork out of the moment between
# a chunk's mapping and its madvise (and peer.py's, between a peer's file's open and close).
fork_guard = threading.Lock()


_fork_generation = 0  # one more in each forked child: mappings made before are not its


def _release_in_child() -> None:
    global _fork_generation
    _fork_generation += 1
    with contextlib.suppress(RuntimeError):  # held by `before`, unless fork skipped it
        fork_guard.release()


os.register_at_fork(
    before=fork_guard.acquire,
    after_in_parent=fork_guard.release,
    after_in_child=_release_in_child,
)


class FileMapping:
    """A peer's whole file mapped shared here, by address.  It keeps no descriptor (Python's
    mmap keeps one, which kept a decode's memory alive in a prefill's forked child) and is
    MADV_DONTFORK, so a child made by fork() has neither.  Unmapped by `close` or when
    collected, but never by a child's copy (its range there may hold the child's own
    mappings by then), nor at interpreter exit (a daemon copy thread may still write)."""

    def __init__(self, fd: int, size: int) -> None:
        """Mapped and marked under `fork_guard` (no child between the two), by the caller."""
        flags = mmap.MAP_SHARED if POPULATE_LATER else mmap.MAP_SHARED | mmap.MAP_POPULATE
        address = _libc.mmap(None, size, PROT_RW, flags, fd, 0)
        if address in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")
        if _libc.madvise(address, size, MADV_DONTFORK):
            err = ctypes.get_errno()
            _libc.munmap(address, size)
            raise OSError(err, f"madvise(MADV_DONTFORK): {os.strerror(err)}")
        self.address, self.size = int(address), size
        self.close = weakref.finalize(self, _unmap, self.address, size, _fork_generation)
        self.close.atexit = False

    def populate(self) -> None:
        """Make its page tables now, so no transfer pays page faults: outside the fork
        guard (GiBs take a while) where the kernel can (MADV_POPULATE_WRITE, Linux 5.14),
        else at the mapping (MAP_POPULATE)."""
        if POPULATE_LATER:
            _libc.madvise(self.address, self.size, MADV_POPULATE_WRITE)


def _unmap(address: int, size: int, generation: int) -> None:
    if generation == _fork_generation:  # a forked child's copy: not mapped there
        _libc.munmap(address, size)


def _populates_later() -> bool:
    page = _libc.mmap(None, PAGE, PROT_RW, MAP_ANONYMOUS_PRIVATE, -1, 0)
    try:
        return bool(_libc.madvise(page, PAGE, MADV_POPULATE_WRITE) == 0)
    finally:
        _libc.munmap(page, PAGE)


POPULATE_LATER = _populates_later()


def share(region: Region) -> list[Region]:
    """Move the whole pages of an anonymous `region` onto a new sealed memfd, in place (see
    the module's docstring); returns the region's parts: the head and tail pages it shares
    with other memory, and the middle on the memfd (its `memfd` is open here)."""
    lo = -(-region.base // PAGE) * PAGE
    hi = region.end // PAGE * PAGE
    if hi <= lo:
        return [region]
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    moved = 0
    try:
        os.ftruncate(fd, hi - lo)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        for at in range(0, hi - lo, SHARE_CHUNK):
            n = min(SHARE_CHUNK, hi - lo - at)
            data = memoryview((ctypes.c_char * n).from_address(lo + at)).cast("B")
            done = 0
            while done < n:
                done += os.pwrite(fd, data[done:], at + done)
            with fork_guard:  # no child may be forked between the mapping and the madvise
                got = _libc.mmap(lo + at, n, PROT_RW, MAP_SHARED_FIXED, fd, at)
                if got != lo + at:  # the old pages may be gone: no quiet fallback from here
                    err = ctypes.get_errno()
                    raise TransferError(
                        f"mapping a memfd over {n} bytes at {lo + at:#x} failed "
                        f"({os.strerror(err)}); that range of this process may now be unmapped"
                    )
                moved = at + n
                if _libc.madvise(lo + at, n, MADV_DONTFORK):
                    err = ctypes.get_errno()
                    raise OSError(err, f"madvise(MADV_DONTFORK): {os.strerror(err)}")
    except BaseException:
        for at in range(0, moved, SHARE_CHUNK):  # back: the range stays private, as told
            try:
                _private(lo + at, min(SHARE_CHUNK, moved - at))
            except TransferError as exc:
                log.error("shmslots: %s; that chunk stays on a memfd no peer knows", exc)
        os.close(fd)
        raise
    parts = [
        Region(region.base, lo - region.base),
        Region(lo, hi - lo, None, os.fstat(fd).st_ino, 0, fd),
        Region(hi, region.end - hi),
    ]
    return [r for r in parts if r.length]


def unshare(groups: Iterable[list[Region]], punch: bool = True) -> None:
    """Move what is still mapped of the regions this engine put on memfds back onto private
    anonymous pages, bytes kept, and close the memfds: memory the engine no longer publishes
    must not stay shared (a child forked later would share it, malloc's chunks included,
    instead of copying it).  With `punch`, each chunk's pages leave the memfd as it moves,
    so a peer still mapping the file holds no memory of it (and reads zeros).  Pages the
    owner unmapped meanwhile are left alone.  Bytes a thread writes into the range while it
    moves may be lost: the range must be quiet, as for registering."""
    moved = [r for r in itertools.chain(*groups) if r.memfd >= 0]
    if not moved:
        return
    maps = mappings()
    for region in moved:
        for start, end, perms, _, inode, path in maps:
            lo, hi = max(start, region.base), min(end, region.end)
            ours = inode == region.inode and path.startswith(f"/memfd:{MEMFD_NAME}")
            if lo >= hi or not ours or perms[3] != "s":
                continue
            for at in range(lo, hi, SHARE_CHUNK):
                n = min(SHARE_CHUNK, hi - at)
                _private(at, n)
                if punch:  # the file's offsets are the range's, from the region's base
                    offset = region.offset + at - region.base
                    if _libc.fallocate(region.memfd, FALLOC_PUNCH_HOLE, offset, n):
                        err = os.strerror(ctypes.get_errno())
                        log.warning("shmslots: a memfd keeps %d bytes moved back (%s)", n, err)
        os.close(region.memfd)


def _private(at: int, n: int) -> None:
    """Put the `n` bytes at `at` on private anonymous pages, bytes kept: copied onto fresh
    pages mapped elsewhere, which one mremap then moves over the range.  (Never through a
    heap buffer: the range may be memory its owner freed, where that buffer could lie.)"""
    fresh = _libc.mmap(None, n, PROT_RW, MAP_ANONYMOUS_PRIVATE, -1, 0)
    if fresh in (None, MAP_FAILED):
        raise TransferError(f"no memory to copy {n} bytes at {at:#x} onto private pages")
    ctypes.memmove(fresh, at, n)
    if _libc.mremap(fresh, n, n, MREMAP_MAYMOVE_FIXED, at) != at:
        _libc.munmap(fresh, n)
        raise TransferError(f"moving private pages over {at:#x} failed")
