"""A transfer engine for peers on one host: Mooncake's `TransferEngine` calls, answered by
shared memory, `process_vm_writev` and CUDA IPC, with no network and no engine thread.

SGLang's Mooncake manager moves every byte through five engine calls (`batch_register`,
`batch_deregister`, `get_session_id`, `send_probe`, `batch_transfer_sync`); `backend.py` puts
this class behind them.  Each engine publishes a small *registry* segment, `/dev/shm/<name>`:

- a header: magic, format, a sequence number (odd while the owner rewrites it), the owner's
  pid, start time and pid namespace, and the length of the region list;
- the region list (JSON): every registered range, and for a range mapped shared from a file
  (a shmslots table's columns in `/dev/shm`, or a sealed memfd, below) how to map that file:
  its name or its descriptor number in the owner, its inode and the range's offset in it.

Registering anonymous memory (SGLang's CPU KV and state pools) moves its whole pages, in
place, onto a memfd: their content is copied into the file and the file is mapped over
them (MAP_FIXED, 64 MiB at a time), so the owner's tensors keep their addresses and bytes.
The memfd is sealed against shrinking, so a peer's mapping of it can never fault.  The
partial pages at either end stay private (they may hold other allocations).  While
`batch_register` runs, nothing else may write the range; SGLang registers its pools before
serving.  Registered memory must stay allocated until it is deregistered (as with Mooncake's
registrations); deregistering a range, or closing the engine, moves it back onto private
pages.  A child forked meanwhile does not get the moved pages (MADV_DONTFORK).

The owner holds an OFD write lock on the registry's first byte for its whole life, so a peer
learns that it died (or was stopped by SIGKILL) from the kernel, at once, never from a pid
number.  A session id names the registry *and* its inode (`<name>#<inode>:<port>`), so a
restarted peer, which makes a new registry under the same name, is another session: every
mapping of the old one is dropped.

A write into a peer goes, per destination region:
- into a file region: by `memmove` into this process's own mapping of that file, mapped
  once: a `/dev/shm` file by its name, a memfd by `pidfd_getfd` from the peer; either is
  checked to be the inode the peer registered and owned by this user, and a memfd to be
  sealed against shrinking;
- into any other (anonymous) region: by `process_vm_writev`, every block of a call in one
  system call (IOV_MAX a call).  The pid comes from the registry; a pidfd of it, opened once
  and confirmed by the registry's lock and the start time after opening, says before each
  call that the peer has not been reaped, so its pid number is not yet anyone else's (what
  remains is the microseconds between that check and the call, in which the peer would have
  to die, be reaped and have its number handed to another process of this user);
- into a GPU region (CUDA memory, registered by IPC handle, never moved): by `cuMemcpyAsync`
  from GPU memory registered here into the peer's allocation, opened once (cuda_kv).

Both are synchronous: when `transfer` returns, or raises, no byte of it can still land.
Every destination byte must lie inside a region the peer registered and every source byte
inside one registered here; otherwise nothing of the call is written.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import functools
import itertools
import json
import logging
import mmap
import os
import signal
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, ShmSlotsError, TableExists
from ..participants import _lock_request, process_start_ticks, stat_fields
from ..segment import SHM_DIR, Segment, unlink, validate_name
from . import cuda_kv

MAGIC = b"SHMSLPD1"
FORMAT = 3
REGISTRY_BYTES = 256 * 1024
# magic, format, flags, seq, pid, start ticks, pid-namespace inode, owner uid, payload length
_HEADER = struct.Struct("<8sIIQQQQII")
PAYLOAD_AT = 64
MAX_REGIONS = 4096
LIVENESS_BYTE = 0


log = logging.getLogger(__name__)


class TransferError(ShmSlotsError):
    """A same-host transfer was refused or failed; nothing of it was written after this."""


class PeerGone(TransferError):
    """The peer's registry is gone, replaced (a restart), or its owner is dead."""


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


def _pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _mappings() -> list[tuple[int, int, str, int, int, str]]:
    """(start, end, perms, offset, inode, path) of each mapping of this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            out.append((start, end, parts[1], int(parts[2], 16), int(parts[4]), path))
    return out


def classify(base: int, length: int) -> tuple[Region, bool]:
    """The region at [base, base+length) of this process, and whether it may be moved onto
    a memfd (all private anonymous memory, none of it pinned); TransferError when it is not
    writable host memory (a CUDA allocation, a read-only or unmapped range)."""
    if base <= 0 or length <= 0:
        raise TransferError(f"cannot register {length} bytes at {base:#x}")
    maps = _mappings()
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
    shared = first[2][3] == "s"  # a private mapping of the file keeps its own copies of pages
    if (
        len(covering) == 1
        and shared
        and path.startswith(SHM_DIR + "/")
        and not path.endswith("(deleted)")
    ):
        name = path[len(SHM_DIR) + 1 :]
        return Region(base, length, name, first[4], first[3] + (base - first[0])), False
    anonymous = all(m[2][3] == "p" and m[5] in ("", "[heap]") for m in covering)
    return Region(base, length), anonymous and not _cuda_runs() and not _pinned(base, end)


def _classify(base: int, length: int) -> tuple[Region, bool]:
    """`classify`, or where the range is not host memory, a GPU range by CUDA IPC (never
    moved); TransferError for anything else, and DeviceError for device memory CUDA IPC
    cannot share."""
    try:
        return classify(base, length)
    except TransferError as refusal:
        drv = cuda_kv.driver() if base > 0 and length > 0 else None
        found = drv.describe(base, length) if drv is not None else None
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


PAGE = mmap.PAGESIZE
SHARE_CHUNK = 64 << 20  # copied and remapped at a time: the most memory the move adds


def share(region: Region) -> list[Region]:
    """Move the whole pages of an anonymous `region` onto a new sealed memfd, in place (see
    the module's docstring); returns the region's parts: the head and tail pages it shares
    with other memory, and the middle on the memfd (its `memfd` is open here)."""
    lo = -(-region.base // PAGE) * PAGE
    hi = region.end // PAGE * PAGE
    if hi <= lo:
        return [region]
    fd = os.memfd_create("shmslots-pd", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
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
            with _fork_guard:  # no child may be forked between the mapping and the madvise
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


PREFIX = "shmslots-pd-"
SWEEP_AGE_S = 10.0  # a registry with no owner yet, younger than this, is still being made


def sweep() -> list[str]:
    """Remove this user's registries whose owners died (SIGKILL leaves them): those unlocked
    and either published or older than SWEEP_AGE_S.  Returns the names removed."""
    removed = []
    for entry in os.scandir(SHM_DIR):
        if not entry.name.startswith(PREFIX):
            continue
        try:
            reg = PeerRegistry(entry.name, None)
        except ShmSlotsError:
            continue
        try:
            if reg.alive():
                continue
            made = reg.segment.mm[:8] == MAGIC
            old = time.time() - os.fstat(reg.segment.fd).st_mtime > SWEEP_AGE_S
            if (made or old) and reg.named():
                unlink(entry.name)
                removed.append(entry.name)
        except (OSError, ShmSlotsError):
            continue
        finally:
            reg.close()
    return removed


class Registry:
    """This engine's registry segment: what peers may write into, and its liveness lock."""

    def __init__(self, name: str) -> None:
        validate_name(name)
        self.segment = self._create(name)
        self.name = name
        self.inode = self.segment.identity[1]
        self._lock_fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        fcntl.fcntl(self._lock_fd, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_WRLCK, LIVENESS_BYTE))
        pid = os.getpid()
        self._seq = 0
        self._identity = (pid, process_start_ticks(pid), _pidns(), os.geteuid())
        self.publish([])
        _owned.add(self)

    @staticmethod
    def _create(name: str) -> Segment:
        """A new registry; one left under the name by a dead owner is removed first."""
        try:
            return Segment.create(name, REGISTRY_BYTES)
        except TableExists:
            old = PeerRegistry(name, None)  # refuses another user's object: never removed here
            try:
                if old.alive():
                    raise TransferError(f"registry {name!r} belongs to a live engine") from None
                if old.named():
                    unlink(name)  # a dead engine's, left by SIGKILL
            finally:
                old.close()
            return Segment.create(name, REGISTRY_BYTES)

    def publish(self, regions: Sequence[Region]) -> None:
        """Rewrite the region list under the sequence number (odd while writing)."""
        payload = json.dumps(
            [
                [r.base, r.length, r.shm, r.inode, r.offset, r.memfd, r.device, r.handle]
                for r in regions
            ]
        ).encode()
        if len(payload) > REGISTRY_BYTES - PAYLOAD_AT or len(regions) > MAX_REGIONS:
            raise TransferError(f"{len(regions)} regions do not fit in a registry")
        mm = self.segment.mm
        self._seq += 1
        struct.pack_into("<Q", mm, 16, self._seq)
        mm[PAYLOAD_AT : PAYLOAD_AT + len(payload)] = payload
        pid, start, ns, uid = self._identity
        self._seq += 1
        _HEADER.pack_into(mm, 0, MAGIC, FORMAT, 0, self._seq, pid, start, ns, uid, len(payload))

    def close(self) -> None:
        """Unlink first, then let go of the lock: a peer sees the owner gone either way."""
        if self._lock_fd < 0:
            return
        with contextlib.suppress(ShmSlotsError):
            self.segment.unlink()
        self.segment.close()
        os.close(self._lock_fd)
        self._lock_fd = -1


_owned: weakref.WeakSet[Registry] = weakref.WeakSet()
_engines: weakref.WeakSet[SameHostEngine] = weakref.WeakSet()


# Moved ranges are MADV_DONTFORK (as RDMA registrations are): a child made by fork() does
# not get them, rather than share them with its parent (its malloc could write the parent's
# memory) or copy whole pools at every fork.  The guard keeps fork out of the moment between
# a chunk's mapping and its madvise.
_fork_guard = threading.Lock()


def _forget_in_child() -> None:
    """A child made by fork() shares the liveness lock's open file description: its copy is
    closed, so that the lock goes when the engine's own process dies, not when all children
    do (the child's engines are its parent's, not its own).  Its engines let go of the
    memfds too (the files are its parent's; their ranges are not mapped here)."""
    with contextlib.suppress(RuntimeError):  # held by `before`, unless fork skipped it
        _fork_guard.release()
    for reg in list(_owned):
        if reg._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(reg._lock_fd)
            reg._lock_fd = -1
    for engine in list(_engines):
        # the child's engines are closed: a lock the pruner held at the fork stays held here
        engine._lock = threading.Lock()
        engine._idle = threading.Condition(engine._lock)
        engine._closed, engine._peers, engine._lingering = True, {}, []
        parts, engine._parts = engine._parts, {}
        engine._own = ([], [])
        for region in itertools.chain(*parts.values()):
            if region.memfd >= 0:
                with contextlib.suppress(OSError):
                    os.close(region.memfd)


os.register_at_fork(
    before=_fork_guard.acquire,
    after_in_parent=_fork_guard.release,
    after_in_child=_forget_in_child,
)


class PeerRegistry:
    """A peer's registry, opened read-only: its regions, and whether its owner lives."""

    def __init__(self, name: str, inode: int | None) -> None:
        validate_name(name)
        try:
            self.segment = Segment.open(name, writable=False)
        except ShmSlotsError as exc:
            raise PeerGone(f"no same-host engine registry {name!r}: {exc}") from None
        try:
            st = os.fstat(self.segment.fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise TransferError(
                    f"registry {name!r} is owned by uid {st.st_uid} with mode "
                    f"{st.st_mode & 0o777:o}; only this user's 0600 registries are trusted"
                )
            if inode is not None and st.st_ino != inode:
                raise PeerGone(f"registry {name!r} was replaced: the peer restarted")
            if st.st_size != REGISTRY_BYTES:
                raise TransferError(f"{name!r} is not a same-host engine registry")
        except BaseException:
            self.segment.close()
            raise
        self.name = name
        self.inode = st.st_ino
        self._seq = -1
        # (regions, their bases), swapped whole: transfers on other threads read it unlocked
        self.table: tuple[list[Region], list[int]] = ([], [])
        self.pid = self.start_ticks = self.pidns = 0

    def named(self) -> bool:
        """Whether its name still refers to this registry (not removed, nor made anew)."""
        try:
            return os.stat(os.path.join(SHM_DIR, self.name)).st_ino == self.inode
        except OSError:
            return False

    def alive(self) -> bool:
        """Whether the registry's owner still holds its liveness lock."""
        if self.segment.fd < 0:
            return False
        reply = fcntl.fcntl(
            self.segment.fd, fcntl.F_OFD_GETLK, _lock_request(fcntl.F_WRLCK, LIVENESS_BYTE)
        )
        return bool(struct.unpack("hh", reply[:4])[0] != fcntl.F_UNLCK)

    def owner_gone(self) -> bool:
        """Whether the registry's owner (its pid and start time, as last read) no longer runs
        user code: gone, its pid reused, or every thread of it exiting.  A process killed by
        SIGKILL tears down its address space before its descriptors close, which takes tens
        of ms with large shared mappings; its lock goes only after.  False where the owner
        lives in another pid namespace (the lock then says it)."""
        if not self.pid or self.pidns != _pidns():
            return False
        tasks = f"/proc/{self.pid}/task"
        try:
            seen = set(os.listdir(tasks))
            if _start_ticks(self.pid) != self.start_ticks:
                return True
            for tid in seen:
                if not _exiting(f"{tasks}/{tid}/stat"):
                    return False
            # a thread made after the listing: the listing again (an exiting thread makes none)
            return set(os.listdir(tasks)) == seen
        except (FileNotFoundError, ProcessLookupError):
            return True  # reaped: the pid is no longer anyone's
        except OSError:
            return False  # not known (out of descriptors, say): alive until known otherwise

    def refresh(self) -> bool:
        """Re-read the region list if the owner changed it; True if it did."""
        mm = self.segment.mm
        for _ in range(100):
            (seq,) = struct.unpack_from("<Q", mm, 16)
            if seq == self._seq:
                return False
            if seq % 2:
                continue
            magic, fmt, _, _, pid, start, ns, _, size = _HEADER.unpack_from(mm, 0)
            payload = bytes(mm[PAYLOAD_AT : PAYLOAD_AT + min(size, REGISTRY_BYTES - PAYLOAD_AT)])
            if struct.unpack_from("<Q", mm, 16)[0] != seq:
                continue
            if magic != MAGIC or fmt != FORMAT:
                raise TransferError(f"{self.name!r} is not a same-host engine registry")
            regions = _parse_regions(self.name, payload)
            self.pid, self.start_ticks, self.pidns = pid, start, ns
            self.table = (regions, [r.base for r in regions])
            self._seq = seq
            return True
        raise TransferError(f"registry {self.name!r} is being rewritten without end")

    def close(self) -> None:
        self.segment.close()


PF_EXITING = 0x4  # include/linux/sched.h: set as a thread enters do_exit


def _start_ticks(pid: int) -> int:
    """`pid`'s start time (field 22 of its stat); FileNotFoundError once it is reaped, and
    any other OSError as it came (not a sign of death)."""
    return int(stat_fields(f"/proc/{pid}/stat")[19])


def _exiting(stat_path: str) -> bool:
    """Whether the thread of this /proc stat file has begun to exit (its flags, field 9)."""
    try:
        return bool(int(stat_fields(stat_path)[6]) & PF_EXITING)
    except FileNotFoundError:
        return True  # reaped since the listing


def _parse_regions(name: str, payload: bytes) -> list[Region]:
    """The region list as the peer wrote it, every field type- and range-checked."""
    try:
        raw = json.loads(payload)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        raise TransferError(f"registry {name!r} holds no region list") from None
    if not isinstance(raw, list) or len(raw) > MAX_REGIONS:
        raise TransferError(f"registry {name!r} holds no region list")
    regions = []
    for item in raw:
        ok = isinstance(item, list) and len(item) == 8
        base, length, shm, inode, offset, memfd, device, handle = (
            item if ok else (0, 0, None, 0, 0, -1, None, None)
        )
        ints = all(type(v) is int and 0 <= v < 1 << 63 for v in (base, length, inode, offset))
        ok = ok and ints and length > 0 and type(memfd) is int and -1 <= memfd < 1 << 31
        ok = ok and (shm is None or (isinstance(shm, str) and memfd == -1))
        gpu = _hex(device, 16) and _hex(handle, 64) and shm is None and memfd == -1
        if not (ok and (gpu or (device is None and handle is None))):
            raise TransferError(f"registry {name!r} holds a malformed region: {item!r}")
        if shm is not None:
            try:
                validate_name(shm)
            except InvalidArgument:
                raise TransferError(f"registry {name!r} names no /dev/shm file: {shm!r}") from None
        regions.append(Region(base, length, shm, inode, offset, memfd, device, handle))
    regions.sort(key=lambda r: r.base)
    for a, b in itertools.pairwise(regions):
        if a.end > b.base:
            raise TransferError(f"registry {name!r} holds overlapping regions")
    return regions


def _hex(value: object, size: int) -> bool:
    """Whether `value` is `size` bytes written in lowercase hex."""
    return isinstance(value, str) and len(value) == 2 * size and set(value) <= HEX_DIGITS


HEX_DIGITS = set("0123456789abcdef")


@dataclass
class _DeviceMapping:
    """A peer's CUDA allocation opened here by its IPC handle."""

    device: str
    address: int
    size: int

    def close(self) -> None:
        drv = cuda_kv.driver()
        if drv is not None:  # opened through it: it is there
            drv.close(self.device, self.address)


class _Peer:
    """What this engine keeps of one peer session: its registry, and the ways into it."""

    def __init__(self, registry: PeerRegistry) -> None:
        self.registry = registry
        self.pidfd = -1
        self.maps: dict[tuple[str | int, int], tuple[mmap.mmap, int]] = {}
        self.devices: dict[tuple[str, str], _DeviceMapping] = {}  # by (IPC handle, our GPU)
        self.no_getfd = False  # pidfd_getfd refused: memfd regions go as anonymous memory
        self.lock = threading.Lock()  # opening: the registry's re-read, mappings, the pidfd
        self.users = 0  # transfers and probes using it now (the engine's lock guards this)
        self.dropped = False  # out of the engine's table: closed by its last user

    def write(self, blocks: list[tuple[int, int, int]]) -> None:
        """(source, target, length) blocks into the peer's anonymous memory, by
        process_vm_writev, IOV_MAX blocks a call.  The pid is the one the registry lock
        vouched for when the pidfd was opened, and the pidfd says, just before each call,
        that this process has not been reaped, so its pid number is not yet anyone else's."""
        pid = self.registry.pid
        for at in range(0, len(blocks), IOV_MAX):
            chunk = blocks[at : at + IOV_MAX]
            local, remote = (_iovec * len(chunk))(), (_iovec * len(chunk))()
            for i, (src, dst, n) in enumerate(chunk):
                local[i].base, local[i].len = src, n
                remote[i].base, remote[i].len = dst, n
            try:
                signal.pidfd_send_signal(self._pidfd(), 0)
            except ProcessLookupError:
                raise PeerGone(f"peer {self.registry.name!r} died") from None
            wrote = _libc.process_vm_writev(pid, local, len(chunk), remote, len(chunk), 0)
            if wrote < 0:
                err = ctypes.get_errno()
                if err in (errno.EPERM, errno.EACCES):
                    raise TransferError(_access_refusal(pid, err))
                raise OSError(err, os.strerror(err))
            if wrote != sum(n for _, _, n in chunk):
                raise OSError(errno.EFAULT, "a partial write into the peer's memory")

    def _pidfd(self) -> int:
        """A pidfd of the registry's owner, confirmed by its lock and start time after it
        is opened (so it is the owner's, not a later holder's of the pid number)."""
        with self.lock:
            return self._open_pidfd()

    def _open_pidfd(self) -> int:
        if self.pidfd < 0:
            reg = self.registry
            if reg.pidns != _pidns():
                raise TransferError(
                    f"peer {reg.name!r} runs in another pid namespace: only its /dev/shm "
                    "regions can be written from here"
                )
            try:
                fd = os.pidfd_open(reg.pid)
            except ProcessLookupError:
                raise PeerGone(f"peer {reg.name!r} died") from None
            if not reg.alive() or process_start_ticks(reg.pid) != reg.start_ticks:
                os.close(fd)
                raise PeerGone(f"peer {reg.name!r} died")
            self.pidfd = fd
        return self.pidfd

    def mapping(self, region: Region) -> int | None:
        """This process's address of `region`'s file (a /dev/shm file or a memfd), mapped
        once; None for a memfd this process cannot take from the peer (then its bytes go by
        process_vm_writev, as to anonymous memory)."""
        with self.lock:
            return self._map(region)

    def _map(self, region: Region) -> int | None:
        key = (region.shm or region.memfd, region.inode)
        got = self.maps.get(key)
        if got is None:
            fd = self._open_file(region)
            if fd < 0:
                return None
            try:
                st = os.fstat(fd)
                if st.st_ino != region.inode or st.st_uid != os.geteuid():
                    raise PeerGone(
                        f"{self._file(region)} is no longer the file the peer registered"
                    )
                if region.memfd >= 0 and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                    raise TransferError(
                        f"{self._file(region)} may shrink under this mapping (not sealed)"
                    )
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
            got = (mm, ctypes.addressof(ctypes.c_char.from_buffer(mm)))
            self.maps[key] = got
        mm, address = got
        if region.offset + region.length > len(mm):
            raise TransferError(f"region of {self._file(region)} lies past its end")
        return address + region.offset

    def _open_file(self, region: Region) -> int:
        """A descriptor of `region`'s file, or -1 where pidfd_getfd is refused here."""
        if region.shm is not None:
            return os.open(os.path.join(SHM_DIR, region.shm), os.O_RDWR | os.O_CLOEXEC)
        if self.no_getfd:
            return -1
        try:
            return _getfd(self._open_pidfd(), region.memfd)
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                # a kernel before 5.6, or a seccomp profile that allows process_vm_writev only
                log.warning("shmslots: pidfd_getfd refused (%s): writing by process_vm_writev", exc)
                self.no_getfd = True
                return -1
            if exc.errno == errno.EBADF:
                raise TransferError(f"{self._file(region)} is not open in the peer") from None
            raise

    def device_mapping(self, region: Region, gpu: str) -> int:
        """This process's address of the GPU `region`, its allocation opened once in the
        context of our GPU `gpu`, which copies into it (a peer in this very process: the
        region's own address, as CUDA opens no handle in the process that made it)."""
        assert region.handle is not None
        if self.registry.pid == os.getpid() and self.registry.pidns == _pidns():
            return region.base
        with self.lock:
            got = self.devices.get((region.handle, gpu))
            if got is None:
                drv = cuda_kv.driver()
                if drv is None:
                    raise TransferError(
                        f"peer {self.registry.name!r} registered GPU memory, and this process "
                        "has no CUDA driver"
                    )
                address, size, holder = drv.open(gpu, region.handle, region.device or "")
                got = _DeviceMapping(holder, address, size)
                self.devices[(region.handle, gpu)] = got
        if region.offset + region.length > got.size:
            raise TransferError(f"GPU region at {region.base:#x} lies past its allocation's end")
        return got.address + region.offset

    def _file(self, region: Region) -> str:
        if region.shm is not None:
            return repr(region.shm)
        return f"memfd {region.memfd} of {self.registry.name!r}"

    def unlisted(self) -> list[mmap.mmap | _DeviceMapping]:
        """The mappings of files and GPU allocations the registry, as last read, no longer
        lists, taken out (for the caller to close: no transfer may be using this peer)."""
        regions = self.registry.table[0]
        listed = {(r.shm or r.memfd, r.inode) for r in regions if r.mapped}
        handles = {r.handle for r in regions}
        doomed: list[mmap.mmap | _DeviceMapping] = [
            self.maps.pop(k)[0] for k in [k for k in self.maps if k not in listed]
        ]
        return doomed + [
            self.devices.pop(k) for k in [k for k in self.devices if k[0] not in handles]
        ]

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        _close_all([mm for mm, _ in self.maps.values()] + list(self.devices.values()))
        self.maps.clear()
        self.devices.clear()
        self.registry.close()


def _still_alive(reg: PeerRegistry, grace_s: float = 0.2) -> bool:
    """Whether the peer lives, once a write into it failed: a dying process loses its address
    space before its descriptors (and so its lock), so wait a moment before saying it lives."""
    deadline = time.monotonic() + grace_s
    while reg.alive():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.005)
    return False


def _access_refusal(pid: int, err: int) -> str:
    scope = _ptrace_scope()
    return (
        f"cannot write the memory of pid {pid} ({os.strerror(err)}): that needs the same user "
        f"and ptrace access (Yama ptrace_scope is {'absent' if scope is None else scope}; with 1 "
        "the receiving engine allows "
        "its peers by PR_SET_PTRACER, with 2 or 3 only /dev/shm regions can be written)"
    )


class _iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.argtypes = [
    ctypes.c_int, ctypes.POINTER(_iovec), ctypes.c_ulong,
    ctypes.POINTER(_iovec), ctypes.c_ulong, ctypes.c_ulong,
]  # fmt: skip
_libc.process_vm_writev.restype = ctypes.c_ssize_t
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
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # what a peer's mapping needs: no SIGBUS
SYS_PIDFD_GETFD = 438  # one number on every architecture but alpha, since Linux 5.6


def _getfd(pidfd: int, fd: int) -> int:
    """A descriptor of this process for the peer's descriptor `fd` (pidfd_getfd)."""
    got = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(got)


def _ptrace_scope() -> int | None:
    """Yama's ptrace_scope, or None where there is no Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = -1


def allow_peers() -> None:
    """With Yama's ptrace_scope 1, let processes of this user write this one's registered
    memory (PR_SET_PTRACER_ANY); with 0 (or no Yama) there is nothing to do."""
    if _ptrace_scope() == 1:
        _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)


class SameHostEngine:
    """Mooncake's `TransferEngine` surface as SGLang's manager calls it, for one host.

    `name` names the registry segment (one per engine; `session_port` is the number SGLang
    reads after the session id's last ':' to spread sessions over its queues)."""

    def __init__(self, name: str, session_port: int = 0) -> None:
        if not name.startswith(PREFIX):
            raise InvalidArgument(f"a same-host engine's registry name starts with {PREFIX!r}")
        allow_peers()
        sweep()
        self.registry = Registry(name)
        self.session_port = session_port
        self._own: tuple[list[Region], list[int]] = ([], [])  # swapped whole, as a peer's
        self._parts: dict[int, list[Region]] = {}  # a registered base: its published parts
        self._threads: ThreadPoolExecutor | None = None  # made by the first parallel copy
        self._peers: dict[str, _Peer] = {}
        # SGLang's manager transfers from several threads at once (its queues, and executor
        # futures per layer): a peer is closed only by its last user, and close() waits
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._lingering: list[_Peer] = []  # peers whose transfers outlived close()
        self._stop = threading.Event()  # ends the pruner (started with the first peer)
        self._pruner: threading.Thread | None = None
        _engines.add(self)
        self.refused = 0  # transfers refused for bad input (outside registered memory)
        self.failed = 0  # transfers that found their peer gone

    # -- Mooncake's calls ---------------------------------------------------------------
    def get_session_id(self) -> str:
        return f"{self.registry.name}#{self.registry.inode}:{self.session_port}"

    def batch_register(self, ptrs: Sequence[int], lens: Sequence[int]) -> int:
        """Publish the ranges (anonymous ones moved onto memfds first: the module's
        docstring says how and why); a range overlapping one registered is refused, and a
        refused call publishes nothing of itself."""
        new = [_classify(int(p), int(n)) for p, n in zip(ptrs, lens, strict=True) if n]
        with self._lock:
            regions = sorted(self._own[0] + [r for r, _ in new], key=lambda r: r.base)
            for a, b in itertools.pairwise(regions):
                if a.end > b.base:
                    raise TransferError(f"region at {b.base:#x} overlaps one registered before")
            parts = dict(self._parts)
            try:
                for region, movable in new:
                    parts[region.base] = self._share(region) if movable else [region]
                regions = sorted(itertools.chain(*parts.values()), key=lambda r: r.base)
                self.registry.publish(regions)
            except BaseException:
                _unshare(p for base, p in parts.items() if base not in self._parts)
                raise
            self._parts = parts
            self._own = (regions, [r.base for r in regions])
        return 0

    @staticmethod
    def _share(region: Region) -> list[Region]:
        try:
            return share(region)
        except OSError as exc:  # the range stays as it was: written by process_vm_writev
            log.warning(
                "shmslots: %d bytes at %#x stay private: %s", region.length, region.base, exc
            )
            return [region]

    def register(self, ptr: int, length: int) -> int:
        return self.batch_register([ptr], [length])

    def batch_deregister(self, ptrs: Sequence[int]) -> int:
        """Withdraw the ranges registered at `ptrs`; a moved range goes back onto private
        pages, its bytes kept."""
        with self._lock:
            gone = [r for p in ptrs for r in self._parts.pop(int(p), [])]
            regions = sorted(itertools.chain(*self._parts.values()), key=lambda r: r.base)
            self.registry.publish(regions)
            self._own = (regions, [r.base for r in regions])
        _unshare([gone])
        return 0

    def send_probe(self, session: str) -> int:
        """0 while the peer's engine lives, -1 otherwise (and for anything malformed)."""
        try:
            peer = self._acquire(session)
        except TransferError:
            return -1
        try:
            if peer.registry.alive():
                return 0
            self._drop(session, peer)
            return -1
        finally:
            self._release(peer)

    def batch_transfer_sync(
        self, session: str, sources: Sequence[int], targets: Sequence[int], lengths: Sequence[int]
    ) -> int:
        """Mooncake's contract: 0 when every byte landed, -1 otherwise (logged by SGLang)."""
        try:
            self.transfer(session, sources, targets, lengths)
        except PeerGone:
            self.failed += 1
            return -1
        except ShmSlotsError as exc:
            log.warning("shmslots same-host transfer refused: %s", exc)
            self.refused += 1
            return -1
        except Exception:  # SGLang's transfer worker dies on an exception: fail the room
            log.exception("shmslots same-host transfer failed")
            self.refused += 1
            return -1
        return 0

    # -- the engine itself --------------------------------------------------------------
    def transfer(
        self, session: str, sources: Sequence[int], targets: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Write each `lengths[i]` bytes at `sources[i]` (registered here) to `targets[i]`
        (registered by the peer).  Every block is checked before the first is written."""
        if not len(sources) == len(targets) == len(lengths):
            raise InvalidArgument("sources, targets and lengths must be as many")
        peer = self._acquire(session)
        try:
            self._transfer(session, peer, sources, targets, lengths)
        finally:
            self._release(peer)

    def _transfer(
        self,
        session: str,
        peer: _Peer,
        sources: Sequence[int],
        targets: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        reg = peer.registry
        if not reg.alive():
            self._drop(session, peer)
            raise PeerGone(f"the peer of session {session!r} is dead")
        with peer.lock:
            reg.refresh()
        plan = _plan(self._own, reg.table, reg.name, sources, targets, lengths)
        try:
            self._run(self._jobs(peer, plan))
        except (OSError, cuda_kv.DeviceError) as exc:
            alive = _still_alive(reg)
            self._drop(session, peer)
            kind = TransferError if alive else PeerGone
            raise kind(f"write into {reg.name!r} failed: {exc}") from None
        if not reg.alive():  # it died meanwhile: its shared pages or GPU memory took the bytes
            self._drop(session, peer)
            raise PeerGone(f"the peer of session {session!r} died during the transfer")

    @staticmethod
    def _jobs(peer: _Peer, plan: _Plan) -> list[Callable[[], None]]:
        """The plan's copies as jobs: host blocks into the peer's mapped files by memmove
        and into its anonymous memory by process_vm_writev, split over the copy threads;
        GPU blocks one job per source GPU, on a stream of it (cuda_kv)."""
        regions = plan.regions
        jobs: list[Callable[[], None]] = []
        for route, gpu in enumerate(plan.routes):
            mine = plan.route == route
            src, dst, n, held = plan.src[mine], plan.dst[mine], plan.n[mine], plan.region[mine]
            used = np.unique(held)
            delta = np.zeros(len(regions), dtype=np.int64)  # target address - region's base
            if gpu is not None:
                for i in used.tolist():
                    delta[i] = peer.device_mapping(regions[i], gpu) - regions[i].base
                drv = cuda_kv.driver()
                assert drv is not None  # device_mapping opened the targets through it
                jobs.append(functools.partial(drv.copy, gpu, src, dst + delta[held], n))
                continue
            files = np.zeros(len(regions), dtype=bool)
            for i in used.tolist():
                at = peer.mapping(regions[i]) if regions[i].mapped else None
                if at:
                    files[i], delta[i] = True, at - regions[i].base
            into = files[held]
            target = dst + delta[held]
            copies = _triples(src[into], target[into], n[into])
            writes = _triples(src[~into], dst[~into], n[~into])
            jobs += [functools.partial(_copy, part) for part in _split(copies, COPY_THREADS)]
            jobs += [functools.partial(peer.write, part) for part in _split(writes, COPY_THREADS)]
        return jobs

    def _run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run `jobs`, all but the first on the engine's copy threads, and return (or raise
        the first failure) only once every one has ended: no write may land after."""
        futures: list[Future[None]] = []
        failure: BaseException | None = None
        try:
            if len(jobs) > 1:
                with self._lock:
                    if self._threads is None:
                        self._threads = ThreadPoolExecutor(
                            max(1, COPY_THREADS - 1), "shmslots-copy"
                        )
                    threads = self._threads
                for job in jobs[1:]:  # each kept as made: close() may refuse the next
                    futures.append(threads.submit(job))
            if jobs:
                jobs[0]()
        except BaseException as exc:
            failure = exc
        wait(futures)
        for future in futures:
            failure = failure or future.exception()
        if failure is not None:
            raise failure

    def _acquire(self, session: str) -> _Peer:
        """The session's peer, opened on first use, with one more user.  A new session
        first lets go of dead peers: a restarted decode's old mappings (its GPU memory
        above all, which its new process may be allocating again) go before the new ones."""
        doomed: list[_Peer | mmap.mmap | _DeviceMapping] = []
        try:
            with self._lock:
                if self._closed:
                    raise TransferError("this same-host engine is closed")
                peer = self._peers.get(session)
                if peer is None:
                    doomed = self._prune()
                    name, inode = parse_session(session)
                    peer = _Peer(PeerRegistry(name, inode))
                    self._peers[session] = peer
                    if self._pruner is None:
                        self._pruner = threading.Thread(
                            target=_prune_every,
                            args=(weakref.ref(self), self._stop),
                            name="shmslots-prune",
                            daemon=True,
                        )
                        self._pruner.start()
                peer.users += 1
                return peer
        finally:
            _close_all(doomed)

    def prune(self) -> None:
        """Let go of idle peers whose engine died, and of mappings a live peer no longer
        registers: each holds its file's or GPU allocation's memory.  (A restarted decode is
        a new session, and SGLang probes only failed ones: nothing else would drop the old
        one.)  The pruner thread calls it every PRUNE_EVERY_S."""
        with self._lock:
            doomed = [] if self._closed else self._prune()
        _close_all(doomed)

    def _prune(self) -> list[_Peer | mmap.mmap | _DeviceMapping]:
        """What `prune` lets go of, taken out under the engine's lock (no transfer uses
        these peers) for the caller to close outside it."""
        doomed: list[_Peer | mmap.mmap | _DeviceMapping] = []
        for session, peer in list(self._peers.items()):
            if peer.users:
                continue
            try:
                if peer.registry.alive():
                    with contextlib.suppress(TransferError):  # malformed: the list as last read
                        peer.registry.refresh()
                    doomed += peer.unlisted()
                    continue
            except Exception:  # one peer's trouble must not stop the others', or new sessions
                log.exception("shmslots: pruning %r failed", peer.registry.name)
                continue
            del self._peers[session]
            doomed.append(peer)
        return doomed

    def _release(self, peer: _Peer) -> None:
        with self._lock:
            peer.users -= 1
            last = peer.dropped and peer.users == 0
            if last:
                self._idle.notify_all()
            done = last and self._lingering and not any(p.users for p in self._lingering)
        if last:
            peer.close()
        if done:  # the transfers that outlived close() have ended: peers may see it gone
            self.registry.close()

    def _drop(self, session: str, peer: _Peer) -> None:
        """Take a dead or failed peer out of the table; its last user closes it (a mapping is
        never unmapped under another thread's copy)."""
        with self._lock:
            if self._peers.get(session) is peer:
                del self._peers[session]
            peer.dropped = True

    def close(self, wait_s: float = 10.0) -> None:
        """Refuse new transfers, wait (up to `wait_s`) for those running, let go of every
        peer, then remove the registry, so peers see this engine gone only once none of its
        writes can still land."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            pruner = self._pruner
            self.registry.publish([])  # peers start no more writes here
            peers, self._peers = list(self._peers.values()), {}
            for peer in peers:
                peer.dropped = True
            self._idle.wait_for(lambda: all(p.users == 0 for p in peers), timeout=wait_s)
            idle = [p for p in peers if p.users == 0]
            self._lingering = [p for p in peers if p.users]
        for peer in idle:  # a transfer still running past wait_s closes its own peer
            peer.close()
        if not self._lingering:
            self.registry.close()
        else:  # peers must not see this engine gone while a write of it may land
            log.warning("shmslots: a transfer outlived close(); its end unlocks the registry")
        if self._threads is not None:  # a copy still running ends on its own, joined by its call
            self._threads.shutdown(wait=False)
        if pruner is not None and pruner is not threading.current_thread():
            pruner.join(PRUNE_EVERY_S + 5)  # it may be unmapping: not left running at exit
        parts, self._parts = self._parts, {}
        _unshare(parts.values())

    def __enter__(self) -> SameHostEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_session(session: str) -> tuple[str, int]:
    """(registry name, inode) of a session id `<name>#<inode>:<port>`."""
    head = str(session).rsplit(":", 1)[0]
    name, sep, inode = head.rpartition("#")
    try:
        if sep and inode.isdigit() and name.startswith(PREFIX):
            return validate_name(name), int(inode)
    except InvalidArgument:
        pass
    raise TransferError(f"{session!r} is not a same-host engine session")


def _unshare(groups: Iterable[list[Region]], punch: bool = True) -> None:
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
    maps = _mappings()
    for region in moved:
        for start, end, perms, _, inode, path in maps:
            lo, hi = max(start, region.base), min(end, region.end)
            ours = inode == region.inode and path.startswith("/memfd:shmslots-pd")
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


PRUNE_EVERY_S = 1.0  # how often the pruner looks for dead peers and unlisted mappings


def _prune_every(engine: weakref.ref[SameHostEngine], stop: threading.Event) -> None:
    """The pruner: an idle prefill lets go of a dead decode's memory too (within a second),
    not only at its next transfer."""
    while not stop.wait(PRUNE_EVERY_S):
        alive = engine()
        if alive is None:
            return
        try:
            alive.prune()
        except Exception:  # logged, and pruning goes on
            log.exception("shmslots: pruning failed")
        del alive


def _close_all(doomed: Iterable[_Peer | mmap.mmap | _DeviceMapping]) -> None:
    """Close peers and mappings, outside the engine's lock (freeing a pool's pages takes a
    while); a failure is logged, never raised (a device mapping that will not close leaves
    its peer's memory mapped here)."""
    for closable in doomed:
        try:
            closable.close()
        except BufferError:  # a view still exported: the mapping goes with it
            pass
        except Exception:  # never raised into a transfer that has taken its peer
            log.exception("shmslots: closing %r failed", closable)


COPY_THREADS = min(4, len(os.sched_getaffinity(0)))  # one copy thread saturates no host
PARALLEL_BYTES = 4 << 20  # a call moving less goes on its caller's thread alone


def _copy(blocks: list[tuple[int, int, int]]) -> None:
    """(source, target, length) blocks, both addresses of this process."""
    for src, dst, n in blocks:
        ctypes.memmove(dst, src, n)


def _split(blocks: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """`blocks` cut into up to `parts` runs of about equal bytes (cut at 4 KiB multiples),
    in order; [] for none, and one run for a call too small to be worth threads."""
    total = sum(n for _, _, n in blocks)
    if not blocks or parts < 2 or total < PARALLEL_BYTES:
        return [blocks] if blocks else []
    share = -(-total // parts // 4096) * 4096  # ceil(total / parts), up to 4 KiB
    runs: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for src, dst, n in blocks:
        while n:
            k = min(n, room)
            runs[-1].append((src, dst, k))
            src, dst, n, room = src + k, dst + k, n - k, room - k
            if not room:
                runs.append([])
                room = share
    return [run for run in runs if run]


@dataclass(frozen=True)
class _Plan:
    """A transfer's blocks, every one checked: per block its source, its target (the peer's
    address), its length, the index of the peer's region holding the target, and its route,
    an index into `routes`: the GPU (UUID) whose stream copies it, or None, host to host."""

    src: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    region: np.ndarray
    route: np.ndarray
    routes: list[str | None]
    regions: list[Region]  # the peer's, as read for this plan


ADDRESS_LIMIT = 1 << 62  # a block at or past it is planned alone (Python's ints, no wrap)
ADDRESS_END = 1 << 63  # registered bases and lengths lie below it (`_parse_regions`)


def _plan(
    own: tuple[list[Region], list[int]],
    theirs: tuple[list[Region], list[int]],
    peer: str,
    sources: Sequence[int],
    targets: Sequence[int],
    lengths: Sequence[int],
) -> _Plan:
    """Every block of a transfer checked against both sides' regions before any is written:
    TransferError for the first block that is not wholly inside registered memory on each
    side, or that crosses between host and GPU memory (`_route`).  The blocks that one region
    holds on each side (SGLang's, always) are placed by array lookups and routed once per
    pair of regions; any other, across adjacent regions or odd, goes through `_cover` alone
    (the same rule, block by block)."""
    arrays = [_int64(a) for a in (sources, targets, lengths)]
    if any(a is None for a in arrays):  # each block is then read as a Python int below
        sources, targets, lengths = list(sources), list(targets), list(lengths)
        arrays = [np.full(len(sources), -1, dtype=np.int64)] * 3
    src, dst, n = (a for a in arrays if a is not None)
    plain = (src >= 0) & (dst >= 0) & (n > 0) & (src < ADDRESS_LIMIT) & (dst < ADDRESS_LIMIT)
    plain &= n < ADDRESS_LIMIT
    mine, their = _holder(own, src, n, plain), _holder(theirs, dst, n, plain)
    whole = plain & (mine >= 0) & (their >= 0)
    routes: list[str | None] = []
    pairs = (mine * (len(theirs[0]) + 1) + their)[whole]
    _, first, which = np.unique(pairs, return_index=True, return_inverse=True)
    codes = []
    for k in np.flatnonzero(whole)[first].tolist():  # the first block of each pair
        held, into = own[0][mine[k]], theirs[0][their[k]]
        codes.append(_index(routes, _route([held], [into], int(src[k]), int(dst[k]), int(n[k]))))
    route = np.array(codes, dtype=np.int64)[which.reshape(-1)]
    extra: list[list[int]] = [[], [], [], [], [], []]  # src, dst, n, region, route, block
    for k in np.flatnonzero(~whole & (n != 0)).tolist():
        s, d, length = int(sources[k]), int(targets[k]), int(lengths[k])
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
            [own[0][i] for _, _, i in held], [theirs[0][i] for _, _, i in pieces], s, d, length
        )
        code = _index(routes, gpu)
        for a, k2, i in pieces:
            for column, value in zip(extra, (s + (a - d), a, k2, i, code, k), strict=True):
                column.append(value)
    more = [np.array(column, dtype=np.int64) for column in extra]
    # every placed block or piece keeps its call's order: where targets overlap, the
    # later block lands last, as it did block by block (cuda_kv keeps that order too)
    order = np.argsort(np.concatenate([np.flatnonzero(whole), more[5]]), kind="stable")
    return _Plan(
        np.concatenate([src[whole], more[0]])[order],
        np.concatenate([dst[whole], more[1]])[order],
        np.concatenate([n[whole], more[2]])[order],
        np.concatenate([their[whole], more[3]])[order],
        np.concatenate([route, more[4]])[order],
        routes,
        theirs[0],
    )


def _int64(values: Sequence[int]) -> np.ndarray | None:
    """`values` as a flat int64 array where they are integers (uint64 past 2**63 wraps
    negative: such a block is planned alone), else None (floats, bools, anything odd: read
    one by one as Python ints, as always)."""
    try:
        array = np.asarray(values)
    except Exception:
        return None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        return None
    return array.astype(np.int64)


def _triples(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> list[tuple[int, int, int]]:
    return list(zip(src.tolist(), dst.tolist(), n.tolist(), strict=True))


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


def _holder(
    table: tuple[list[Region], list[int]], address: np.ndarray, n: np.ndarray, plain: np.ndarray
) -> np.ndarray:
    """Per block, the index in `table` of the one region that holds all its `n` bytes at
    `address`, or -1 (none does, or the block is not `plain`)."""
    regions, bases = table
    if not regions or not len(address):
        return np.full(len(address), -1, dtype=np.int64)
    ends = np.array([min(r.end, ADDRESS_END - 1) for r in regions], dtype=np.int64)
    i = np.searchsorted(np.array(bases, dtype=np.int64), address, side="right") - 1
    inside = plain & (i >= 0) & (address + np.where(plain, n, 0) <= ends[np.maximum(i, 0)])
    return np.where(inside, i, -1)


def _cover(
    table: tuple[list[Region], list[int]], address: int, length: int
) -> list[tuple[int, int, int]]:
    """The (address, length, region's index) pieces of `length` bytes at `address` over
    adjacent regions of `table` (a moved range is published as up to three), or [] where any
    byte lies outside them."""
    regions, bases = table
    i = bisect.bisect_right(bases, address) - 1
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
