"""What an engine keeps of one peer session, and the ways its bytes go into the peer:

- into a file region: by `memmove` into this process's own mapping of that file, mapped
  once: a `/dev/shm` file by its name, a memfd by opening the peer's descriptor through
  `/proc/<pid>/fd` (a new open file: a copy of the peer's own would carry its locks); either
  is checked to be the inode the peer registered, a regular file owned by this user (a
  `/dev/shm` one in `/dev/shm`), and a memfd to be sealed against shrinking;
- into any other (anonymous) region: by `process_vm_writev`, up to IOV_MAX blocks of a call
  in one system call.  The pid comes from the registry, and is written to only once
  the kernel says that process holds the registry's lock (`holds_lock`: a registry cannot
  name a process but its owner; one of this very process is read from memory, not from its
  file, which any process of this user may rewrite); a pidfd of it, opened before that check and
  confirmed by the start time after it, says before each call that the peer has not been
  reaped, so its pid number is not yet anyone else's (what remains is the microseconds
  between that check and the call, in which the peer would have to die, be reaped and have
  its number handed to another process of this user);
- into a GPU region (CUDA memory, registered by IPC handle, never moved): through the peer's
  allocation, opened here once by its handle (cuda_kv).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import signal
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ...errors import ShmSlotsError, TableNotFound
from ...participants import process_start_ticks
from ...segment import SHM_DIR, open_shm_file
from .. import cuda_kv
from .errors import PeerGone, TransferError
from .memfd import SEALS, FileMapping, fork_guard
from .regions import Region
from .registry import PeerRegistry, holds_lock, this_pidns

log = logging.getLogger(__name__)


class _iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.argtypes = [
    ctypes.c_int, ctypes.POINTER(_iovec), ctypes.c_ulong,
    ctypes.POINTER(_iovec), ctypes.c_ulong, ctypes.c_ulong,
]  # fmt: skip
_libc.process_vm_writev.restype = ctypes.c_ssize_t
# a peer's memfd, opened through /proc: never waiting (were it swapped for a FIFO), no tty
_REOPEN = os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass
class DeviceMapping:
    """A peer's CUDA allocation opened here by its IPC handle."""

    device: str
    address: int
    size: int

    def close(self) -> None:
        drv = cuda_kv.driver()
        if drv is not None:  # opened through it: it is there
            drv.close(self.device, self.address)


class Peer:
    """What this engine keeps of one peer session: its registry, and the ways into it."""

    def __init__(self, registry: PeerRegistry) -> None:
        self.registry = registry
        self.pidfd = -1
        self.pid = self._start = 0  # the owner's, as the kernel vouched for it (the pidfd's)
        self.maps: dict[tuple[str | int, int], FileMapping] = {}
        self.devices: dict[tuple[str, str], DeviceMapping] = {}  # by (IPC handle, our GPU)
        self.no_reopen = False  # its memfds cannot be opened here: they go as anonymous memory
        self.lock = threading.Lock()  # opening: the registry's re-read, mappings, the pidfd
        self.users = 0  # transfers and probes using it now (the engine's lock guards this)
        self.dropped = False  # out of the engine's table: closed by its last user

    def write(self, blocks: list[tuple[int, int, int]]) -> None:
        """(source, target, length) blocks into the peer's anonymous memory, by
        process_vm_writev, IOV_MAX blocks a call.  The pid is the one the registry lock
        vouched for when the pidfd was opened, and the pidfd says, just before each call,
        that this process has not been reaped, so its pid number is not yet anyone else's."""
        self._pidfd()
        pid = self.pid
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
        """A pidfd of the registry's owner, opened once: see `_open_pidfd`."""
        with self.lock:
            return self._open_pidfd()

    def _open_pidfd(self) -> int:
        """A pidfd of the process holding the registry's lock, the pid the registry names:
        opened, then that process is seen to hold the lock and to have the start time the
        registry gives (so the pidfd is the owner's, not a later holder's of the number).
        A registry naming a process that does not hold its lock is refused: forged, or its
        owner's pid rewritten since (the pid is vouched for once, and kept)."""
        reg = self.registry
        if self.pidfd >= 0:
            if (reg.pid, reg.start_ticks) != (self.pid, self._start):
                raise TransferError(f"registry {reg.name!r} now names another owner process")
            return self.pidfd
        if reg.pidns != this_pidns():
            raise TransferError(
                f"peer {reg.name!r} runs in another pid namespace: only its /dev/shm "
                "regions can be written from here"
            )
        pid, start = reg.pid, reg.start_ticks
        if pid == os.getpid() and not reg.own:
            # this process may share a peer's lock's open file (passed to it, or copied by
            # pidfd_getfd), and then /proc says it holds that lock: no check can vouch for it
            raise TransferError(
                f"registry {reg.name!r} names this very process (pid {pid}) and is not one of "
                "its own: a registry may name only its owner's memory"
            )
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise PeerGone(f"peer {reg.name!r} died") from None
        try:
            if not reg.alive() or process_start_ticks(pid) != start:
                raise PeerGone(f"peer {reg.name!r} died")
            try:
                held = holds_lock(pid, reg.lock_fd, reg.inode)
            except PermissionError as exc:
                raise TransferError(
                    f"cannot see whether pid {pid} owns registry {reg.name!r} ({exc}): that "
                    "needs the same user, a dumpable process and its /proc entries visible"
                ) from None
            if not held:
                raise TransferError(
                    f"registry {reg.name!r} names pid {pid}, which does not hold its lock: "
                    "a registry may name only its own process's memory"
                )
        except BaseException:
            os.close(fd)
            raise
        self.pidfd, self.pid, self._start = fd, pid, start
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
            with fork_guard:  # a child forked now would keep the descriptor or the mapping
                got = self._map_file(region)
            if got is None:
                return None
            got.populate()
            self.maps[key] = got
        if region.offset + region.length > got.size:
            raise TransferError(f"region of {self._file(region)} lies past its end")
        return got.address + region.offset

    def _map_file(self, region: Region) -> FileMapping | None:
        """`region`'s whole file mapped, checked first (None: see `mapping`); neither the
        mapping nor a descriptor is a forked child's (`FileMapping`), so a decode's memory
        is not kept alive by a prefill's child that lives on, whatever its threads held."""
        fd = self._open_file(region)
        if fd < 0:
            return None
        try:
            st = os.fstat(fd)
            if st.st_ino != region.inode:
                raise PeerGone(f"{self._file(region)} is no longer the file the peer registered")
            if st.st_uid != os.geteuid():
                raise TransferError(f"{self._file(region)} belongs to uid {st.st_uid}")
            if not stat.S_ISREG(st.st_mode) or (
                region.shm is not None and st.st_dev != os.stat(SHM_DIR).st_dev
            ):
                raise TransferError(f"{self._file(region)} is not a shared-memory file")
            if region.memfd >= 0 and _seals(fd) & SEALS != SEALS:
                raise TransferError(
                    f"{self._file(region)} may shrink under this mapping (not sealed)"
                )
            if region.offset + region.length > st.st_size:
                raise TransferError(f"region of {self._file(region)} lies past its end")
            return FileMapping(fd, st.st_size)
        finally:
            os.close(fd)

    def _open_file(self, region: Region) -> int:
        """A descriptor of `region`'s file, opened anew here (an open file of its own, which
        carries none of the peer's locks), or -1 where the peer's memfds cannot be opened."""
        if region.shm is not None:
            try:
                return open_shm_file(region.shm, os.O_RDWR)
            except TableNotFound:
                raise PeerGone(f"{self._file(region)} is gone") from None
            except ShmSlotsError as exc:
                raise TransferError(f"{self._file(region)}: {exc}") from None
        if self.no_reopen:
            return -1
        pidfd = self._open_pidfd()
        try:  # the peer's descriptor, by its number, through /proc: opened, not duplicated
            fd = os.open(f"/proc/{self.pid}/fd/{region.memfd}", _REOPEN)
        except FileNotFoundError:
            raise TransferError(f"{self._file(region)} is not open in the peer") from None
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES):  # hidepid, an undumpable peer
                log.warning("shmslots: a peer's memfd cannot be opened (%s): writing by "
                            "process_vm_writev", exc)  # fmt: skip
                self.no_reopen = True
                return -1
            raise TransferError(f"{self._file(region)} cannot be opened ({exc.strerror})") from None
        try:
            # the pid was still the peer's at the open: its pidfd says it has not been reaped
            signal.pidfd_send_signal(pidfd, 0)
        except ProcessLookupError:
            os.close(fd)
            raise PeerGone(f"peer {self.registry.name!r} died") from None
        return fd

    def device_mapping(self, region: Region, gpu: str) -> int:
        """This process's address of the GPU `region`, its allocation opened once in the
        context of our GPU `gpu`, which copies into it (a peer in this very process: the
        region's own address, as CUDA opens no handle in the process that made it)."""
        assert region.handle is not None
        if self.registry.own:  # this process's: its list read from memory, not the file
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
                got = DeviceMapping(holder, address, size)
                self.devices[(region.handle, gpu)] = got
        if region.offset + region.length > got.size:
            raise TransferError(f"GPU region at {region.base:#x} lies past its allocation's end")
        return got.address + region.offset

    def _file(self, region: Region) -> str:
        if region.shm is not None:
            return repr(region.shm)
        return f"memfd {region.memfd} of {self.registry.name!r}"

    def unlisted(self) -> list[FileMapping | DeviceMapping]:
        """The mappings of files and GPU allocations the registry, as last read, no longer
        lists, taken out (for the caller to close: no transfer may be using this peer)."""
        regions = self.registry.table.regions
        listed = {(r.shm or r.memfd, r.inode) for r in regions if r.mapped}
        handles = {r.handle for r in regions}
        doomed: list[FileMapping | DeviceMapping] = [
            self.maps.pop(k) for k in [k for k in self.maps if k not in listed]
        ]
        return doomed + [
            self.devices.pop(k) for k in [k for k in self.devices if k[0] not in handles]
        ]

    def close(self) -> None:
        """Let go of the peer: its mappings, pidfd and registry."""
        close_all(list(self.maps.values()))
        close_all(list(self.devices.values()))
        self.maps.clear()
        self.devices.clear()
        self._close_handles()

    def close_in_child(self) -> None:
        """In a child made by fork(): let go of its copies of the pidfd and the registry.
        The file mappings were not inherited (`FileMapping`: forgotten, never unmapped),
        and the GPU mappings are the parent's (a forked child may not call CUDA)."""
        self.maps.clear()
        self.devices.clear()
        self._close_handles()

    def _close_handles(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self.registry.close()


def _seals(fd: int) -> int:
    """The file's seals; none for a file that cannot be sealed (not a memfd)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return 0


def _access_refusal(pid: int, err: int) -> str:
    scope = _ptrace_scope()
    return (
        f"cannot write the memory of pid {pid} ({os.strerror(err)}): that needs the same user "
        f"and ptrace access (Yama ptrace_scope is {'absent' if scope is None else scope}; with 1 "
        "the receiving engine allows "
        "its peers by PR_SET_PTRACER, with 2 or 3 only /dev/shm regions can be written)"
    )


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


def close_all(doomed: Iterable[Peer | FileMapping | DeviceMapping]) -> None:
    """Close peers and mappings, outside the engine's lock (freeing a pool's pages takes a
    while); a failure is logged, never raised (a device mapping that will not close leaves
    its peer's memory mapped here)."""
    for closable in doomed:
        try:
            closable.close()
        except Exception:  # never raised into a transfer that has taken its peer
            log.exception("shmslots: closing %r failed", closable)
