"""A same-host engine's registry: the `/dev/shm/<name>` segment that says what peers may
write into, and whether its owner lives.

- a header: magic, format, a sequence number (odd while the owner rewrites it), the owner's
  pid, start time and pid namespace, the length of the region list, and the number of the
  owner's descriptor that holds the liveness lock;
- the region list (JSON): every range registered to be written (none, for an engine that
  only sends), and for a range mapped shared from a file
  (a shmslots table's columns in `/dev/shm`, or a sealed memfd) how to map that file: its
  name or its descriptor number in the owner, its inode and the range's offset in it.

The owner holds an OFD write lock on the registry's first byte for its whole life, so a peer
learns that it died (or was stopped by SIGKILL) from the kernel, at once, never from a pid
number.  Whatever the header says of its owner is the owner's word; before a peer writes a
process's memory by its pid, the kernel's `/proc/<pid>/fdinfo` must show that process's
descriptor holding this very lock (`holds_lock`): a registry cannot name a process that
does not hold its lock's open file.  A registry of this very process is read from memory,
never from its file, which any process of this user may rewrite.
A session id names the registry *and* its inode (`<name>#<inode>:<port>`), so a restarted
peer, which makes a new registry under the same name, is another session: every mapping of
the old one is dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import json
import os
import struct
import time
import weakref
from collections.abc import Iterator, Sequence

from ..._core import fence, load_acquire, store_release
from ...errors import InvalidArgument, ShmSlotsError, TableExists
from ...participants import _lock_request, process_start_ticks, split_stat, stat_fields
from ...segment import SHM_DIR, Segment, unlink, validate_name
from .errors import PeerGone, TransferError
from .regions import EMPTY, Region, RegionTable

MAGIC = b"SHMSLPD1"
FORMAT = 5
REGISTRY_BYTES = 256 * 1024
# magic, format, flags, seq, pid, start ticks, pid-namespace inode, owner uid, payload length,
# the owner's descriptor of the liveness lock
_HEADER = struct.Struct("<8sIIQQQQIII")
SEQ_AT = 16
PAYLOAD_AT = 64
MAX_REGIONS = 4096
# The owner's lock: on a byte no table locks (participants lock their entry's index, below
# GATE = 2^40, and GATE), so that a table linked under a registry's name, its participants'
# locks held, shows none of them here.  The owner also holds byte 0, format 4's lock, so
# that engines of that format on this host see this registry live and never sweep it.
LIVENESS_BYTE = 1 << 41
FORMAT_4_LIVENESS_BYTE = 0


@functools.cache
def this_pidns() -> int:
    """The inode of this process's pid namespace: pids are compared only within one.  A
    process's own never changes (a child made after `unshare` may be in another: forgotten
    at fork)."""
    return os.stat("/proc/self/ns/pid").st_ino


os.register_at_fork(after_in_child=this_pidns.cache_clear)


PREFIX = "shmslots-pd-"
SWEEP_AGE_S = 10.0  # a registry with no owner yet, younger than this, is still being made


@contextlib.contextmanager
def _removals() -> Iterator[None]:
    """Held while a registry found dead is removed, or one is made: one process at a time
    on this host, so that a registry made under a dead one's name between the look and the
    unlink is never the one removed.  An flock on /dev/shm itself: nothing left behind, and
    released by the kernel if its holder dies."""
    fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def sweep() -> list[str]:
    """Remove this user's registries whose owners died (SIGKILL leaves them): those unlocked
    and either published or older than SWEEP_AGE_S.  Returns the names removed."""
    with _removals():
        return _sweep()


def _sweep() -> list[str]:
    removed = []
    for entry in os.scandir(SHM_DIR):
        if not entry.name.startswith(PREFIX):
            continue
        try:
            reg = PeerRegistry(entry.name, None)
        except ShmSlotsError:
            continue
        try:
            if reg.locked():  # its owner lives, whatever its format
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
        # the lock is taken on the file made here, by its descriptor, never looked up by name
        lock_fd = os.open(f"/proc/self/fd/{self.segment.fd}", os.O_RDWR)
        self.ownership = Ownership(self.segment, lock_fd, self.inode)
        _owned.add(self.ownership)
        # ended by close() or the registry's collection; at exit its engine ends it, once
        # none of its writes can still land (engine.py: `_retire_at_exit`)
        self._end = weakref.finalize(self, self.ownership.end)
        self._end.atexit = False
        try:
            for byte in (LIVENESS_BYTE, FORMAT_4_LIVENESS_BYTE):
                request = _lock_request(fcntl.F_WRLCK, byte)
                fcntl.fcntl(self.ownership.lock_fd, fcntl.F_OFD_SETLK, request)
        except BaseException:
            self.close()
            raise
        pid = os.getpid()
        self._seq = 0
        self._identity = (pid, process_start_ticks(pid), this_pidns(), os.geteuid())
        self._lock_fd = self.ownership.lock_fd
        self.published: RegionTable = EMPTY  # what the file says, as this process knows it
        self.publish([])
        _mine[self.inode] = self

    @staticmethod
    def _create(name: str) -> Segment:
        """A new registry; one left under the name by a dead owner is removed first."""
        with _removals():
            return Registry._replace(name)

    @staticmethod
    def _replace(name: str) -> Segment:
        try:
            return Segment.create(name, REGISTRY_BYTES)
        except TableExists:
            try:  # refuses another user's object: never removed here
                old = PeerRegistry(name, None)
            except PeerGone as exc:
                raise TransferError(f"the name of registry {name!r} is taken: {exc}") from None
            try:
                if old.locked():
                    raise TransferError(f"registry {name!r} belongs to a live engine") from None
                if old.named():
                    unlink(name)  # a dead engine's, left by SIGKILL
            finally:
                old.close()
            return Segment.create(name, REGISTRY_BYTES)

    def publish(self, regions: Sequence[Region]) -> None:
        """Rewrite the region list under the sequence number: odd while writing, and stored
        alone (one atomic word, never inside a bulk write of the header) before and after.
        Everything that could fail is made first: only copies run while it is odd, and it
        is even again whatever they meet."""
        payload = json.dumps(
            [
                [r.base, r.length, r.shm, r.inode, r.offset, r.memfd, r.device, r.handle]
                for r in regions
            ]
        ).encode()
        if len(payload) > REGISTRY_BYTES - PAYLOAD_AT or len(regions) > MAX_REGIONS:
            raise TransferError(f"{len(regions)} regions do not fit in a registry")
        table = RegionTable.of(regions)
        pid, start, ns, uid = self._identity
        header = _HEADER.pack(MAGIC, FORMAT, 0, 0, pid, start, ns, uid, len(payload), self._lock_fd)
        mm = self.segment.mm
        self._seq += 1
        try:
            store_release(mm, SEQ_AT, self._seq)
            fence()  # no store below is seen before the odd number (release orders only before)
            mm[:SEQ_AT] = header[:SEQ_AT]
            mm[SEQ_AT + 8 : _HEADER.size] = header[SEQ_AT + 8 :]
            mm[PAYLOAD_AT : PAYLOAD_AT + len(payload)] = payload
            self.published = table  # before the sequence number: see `_take`
        finally:
            self._seq += 1
            store_release(mm, SEQ_AT, self._seq)
            fence()  # the list is out before the caller's next load (a deregistration's moves)

    @property
    def seq(self) -> int:
        return self._seq

    def close(self) -> None:
        if self._end.detach():  # a finalizer does nothing once the one at exit has run
            self.ownership.end()


class Ownership:
    """What ends with a registry: its name and its owner's liveness lock."""

    def __init__(self, segment: Segment, lock_fd: int, inode: int) -> None:
        self.segment = segment
        self.lock_fd = lock_fd
        self.inode = inode

    def end(self) -> None:
        """Unlink first, then let go of the lock: a peer sees the owner gone either way."""
        if self.lock_fd < 0:
            return
        try:
            if self.named():
                with contextlib.suppress(ShmSlotsError):
                    self.segment.unlink()
            self.segment.close()
        finally:  # run once: the lock goes whatever the unlink met
            os.close(self.lock_fd)
            self.lock_fd = -1

    def named(self) -> bool:
        """Whether the registry's name still refers to its file, not to another's."""
        return _names(self.segment.name, self.inode)


def _names(name: str, inode: int) -> bool:
    """Whether `name` in /dev/shm is the file of that inode."""
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_ino == inode
    except OSError:
        return False


_owned: weakref.WeakSet[Ownership] = weakref.WeakSet()
_mine: weakref.WeakValueDictionary[int, Registry] = weakref.WeakValueDictionary()  # by inode


def _close_locks_in_child() -> None:
    """A child made by fork() shares the liveness lock's open file description: its copy is
    closed, so that the lock goes when the engine's own process dies, not when all children
    do (the child's engines are its parent's, not its own, and its exit removes none)."""
    for owned in list(_owned):
        if owned.lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(owned.lock_fd)
            owned.lock_fd = -1


os.register_at_fork(after_in_child=_close_locks_in_child)


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
        # swapped whole: transfers on other threads read it unlocked
        self.table: RegionTable = EMPTY
        self.pid = self.start_ticks = self.pidns = self.lock_fd = 0
        self.own = False  # a registry of this very process, read from memory (`refresh`)
        # the first owner's /proc stat, kept open (`exiting` reads it with one pread): its
        # reads fail once that process is reaped, whoever has its pid number next
        self._stat_pid, self._stat_fd = 0, -1

    def named(self) -> bool:
        """Whether its name still refers to this registry (not removed, nor made anew)."""
        return _names(self.name, self.inode)

    def alive(self) -> bool:
        """Whether the registry's owner still holds its liveness lock."""
        return self._held(LIVENESS_BYTE, 1)

    def locked(self) -> bool:
        """Whether any process holds a lock on the registry: its owner lives, whatever the
        format it was made in (what a sweep must never remove)."""
        return self._held(0, 0)

    def _held(self, index: int, length: int) -> bool:
        """Whether any process holds a lock on `length` bytes at `index` (0: to the end)."""
        if self.segment.fd < 0:
            return False
        request = _lock_request(fcntl.F_WRLCK, index, length)
        reply = fcntl.fcntl(self.segment.fd, fcntl.F_OFD_GETLK, request)
        return bool(struct.unpack("hh", reply[:4])[0] != fcntl.F_UNLCK)

    def owner_gone(self) -> bool:
        """Whether the registry's owner (its pid and start time, as last read) no longer runs
        user code: gone, its pid reused, or every thread of it exiting.  A process killed by
        SIGKILL tears down its address space before its descriptors close, which takes tens
        of ms with large shared mappings; its lock goes only after.  False where the owner
        lives in another pid namespace (the lock then says it)."""
        if not self.pid or self.pidns != this_pidns():
            return False
        tasks = f"/proc/{self.pid}/task"
        try:
            seen = set(os.listdir(tasks))
            if _start_ticks(self.pid) != self.start_ticks:
                return True
            for tid in seen:
                if not _exiting(f"{tasks}/{tid}/stat"):
                    return False
            # a thread made after the listing: the listing again (an exiting thread makes
            # none; one reaped since is gone from it, and was exiting)
            return set(os.listdir(tasks)) <= seen
        except (FileNotFoundError, ProcessLookupError):
            return True  # reaped: the pid is no longer anyone's
        except OSError:
            return False  # not known (out of descriptors, say): alive until known otherwise

    def lives(self) -> bool:
        """Its owner holds the lock and has not begun to exit: the one test of a peer's
        life before, during and after a transfer."""
        return self.alive() and not self.exiting()

    def exiting(self) -> bool:
        """`owner_gone`, at the cost of one read where the owner is well: its leader's stat
        (start time, exit flag), and the whole look only once the leader exits (a leader
        may end before the process's other threads)."""
        if not self.pid or self.own or self.pidns != this_pidns():
            return False
        try:
            fields = self._leader_stat()
            started, flags = int(fields[START_FIELD]), int(fields[FLAGS_FIELD])
        except (FileNotFoundError, ProcessLookupError):
            return True  # reaped
        except (OSError, ValueError, IndexError):
            return False  # not known (no descriptors left, say): alive until known otherwise
        if started != self.start_ticks:
            return True
        return bool(flags & PF_EXITING) and self.owner_gone()

    def exited(self) -> bool:
        """Whether the owner has exited whole: reaped, or its leader a zombie with no other
        thread left.  Only then are its descriptors all closed, a GPU driver's among them,
        whose release ends the copies it had queued; `owner_gone` (begun to exit) comes
        before that, and so may the registry's lock (closed in the same batch).  False
        where the owner lives in another pid namespace."""
        if not self.pid or self.pidns != this_pidns():
            return False
        try:
            fields = self._leader_stat()
            if int(fields[START_FIELD]) != self.start_ticks:
                return True
            if fields[0] not in (b"Z", b"X"):
                return False
            # a zombie leader: its other threads exit too (none is made now), then leave
            return os.listdir(f"/proc/{self.pid}/task") == [str(self.pid)]
        except (FileNotFoundError, ProcessLookupError):
            return True  # reaped
        except (OSError, ValueError, IndexError):
            return False  # not known: not exited until known

    def _leader_stat(self) -> list[bytes]:
        """The owner's leader thread's stat fields: through the descriptor kept open for
        its first owner, else read afresh (an owner not the first: its registry rewritten)."""
        if self.pid == self._stat_pid:
            return split_stat(os.pread(self._stat_fd, 4096, 0))
        return stat_fields(f"/proc/{self.pid}/stat")

    def refresh(self) -> bool:
        """Re-read the region list if the owner changed it; True if it did (one thread at a
        time: the engine calls it under its peer's lock).  A copy read
        while the owner rewrites it is read again, yielding, for up to REREAD_S.  A registry
        of this very process (one it still owns: not a forked child's copy) is read from
        memory: its file could be rewritten by any process of this user."""
        own = _mine.get(self.inode)
        if own is not None and own.ownership.lock_fd >= 0:
            return self._take(own)
        mm = self.segment.mm
        give_up = time.monotonic() + REREAD_S
        while True:
            seq = load_acquire(mm, SEQ_AT)
            if seq == self._seq:
                return False
            if not seq % 2:
                magic, fmt, _, _, pid, start, ns, _, size, lock_fd = _HEADER.unpack_from(mm, 0)
                payload = bytes(
                    mm[PAYLOAD_AT : PAYLOAD_AT + min(size, REGISTRY_BYTES - PAYLOAD_AT)]
                )
                fence()  # every load of the copy done before the re-check
                if load_acquire(mm, SEQ_AT) == seq:  # a whole copy: what it says stands
                    if magic != MAGIC or fmt != FORMAT:
                        raise TransferError(f"{self.name!r} is not a same-host engine registry")
                    self.table = parse_regions(self.name, payload)
                    self.pid, self.start_ticks, self.pidns = pid, start, ns
                    self.lock_fd = lock_fd
                    if self._stat_fd < 0 and ns == this_pidns():  # its first owner's
                        with contextlib.suppress(OSError):  # gone: `exiting` reads afresh
                            self._stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
                            self._stat_pid = pid
                    self._seq = seq
                    return True
            if time.monotonic() > give_up:
                raise TransferError(f"registry {self.name!r} is being rewritten without end")
            time.sleep(0)

    def _take(self, own: Registry) -> bool:
        """What this process published in `own`, if new.  `publish` sets the list before the
        sequence number: a list newer than the number read is read again next time."""
        seq = own.seq
        if seq == self._seq:
            return False
        self.table = own.published
        self.pid, self.start_ticks, self.pidns, _ = own._identity
        self.lock_fd, self.own, self._seq = own._lock_fd, True, seq
        return True

    @property
    def seq(self) -> int:
        """The sequence number of the list last read (read from memory, perhaps one its
        owner was publishing then: a later list then reads as changed, which is safe)."""
        return self._seq

    def close(self) -> None:
        self.segment.close()
        if self._stat_fd >= 0:
            os.close(self._stat_fd)
            self._stat_fd, self._stat_pid = -1, 0


REREAD_S = 0.1  # how long a registry being rewritten is read again before giving up


def holds_lock(pid: int, fd: int, inode: int) -> bool:
    """Whether process `pid`'s descriptor `fd` is the registry file of `inode` and holds its
    liveness lock, by the kernel's own account (`/proc/<pid>/fdinfo`, readable for a process
    of this user): only one descriptor can hold that write lock, so this ties the pid a
    registry names to the process that owns the registry (or shares that lock's open file
    with it, as only the owner can arrange).  PermissionError where this process may not
    look (another user's, a process made undumpable, a /proc mounted with hidepid)."""
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            info = f.read()
    except PermissionError:
        raise
    except OSError:
        return False
    if st.st_ino != inode or st.st_dev != os.stat(SHM_DIR).st_dev:
        return False
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{inode}"
    lock = ["OFDLCK", "ADVISORY", "WRITE", "-1", file, str(LIVENESS_BYTE), str(LIVENESS_BYTE)]
    return any(line.split()[2:] == lock for line in info.splitlines() if line.startswith("lock:"))


PF_EXITING = 0x4  # include/linux/sched.h: set as a thread enters do_exit
FLAGS_FIELD, START_FIELD = 6, 19  # field 9 (flags) and 22 (start time), as `split_stat` counts


def _start_ticks(pid: int) -> int:
    """`pid`'s start time (field 22 of its stat); FileNotFoundError once it is reaped, and
    any other OSError as it came (not a sign of death)."""
    return int(stat_fields(f"/proc/{pid}/stat")[START_FIELD])


def _exiting(stat_path: str) -> bool:
    """Whether the thread of this /proc stat file has begun to exit (its flags, field 9)."""
    try:
        return bool(int(stat_fields(stat_path)[FLAGS_FIELD]) & PF_EXITING)
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: released between open and read
        return True  # reaped since the listing: it exited (not a sign the process did)


def parse_regions(name: str, payload: bytes) -> RegionTable:
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
    table = RegionTable.of(regions)  # sorted by base
    for a, b in itertools.pairwise(table.regions):
        if a.end > b.base:
            raise TransferError(f"registry {name!r} holds overlapping regions")
    return table


def _hex(value: object, size: int) -> bool:
    """Whether `value` is `size` bytes written in lowercase hex."""
    return isinstance(value, str) and len(value) == 2 * size and set(value) <= HEX_DIGITS


HEX_DIGITS = set("0123456789abcdef")


def session_id(registry: Registry, port: int) -> str:
    """The session id peers reach `registry` by: its name and inode, and the number SGLang
    reads after the last ':' to spread sessions over its queues."""
    return f"{registry.name}#{registry.inode}:{port}"


def parse_session(session: str) -> tuple[str, int]:
    """(registry name, inode) of a session id `<name>#<inode>:<port>`."""
    head = str(session).rsplit(":", 1)[0]
    name, sep, inode = head.rpartition("#")
    try:
        if (
            sep
            and inode.isascii()
            and inode.isdigit()
            and len(inode) <= 20
            and name.startswith(PREFIX)
        ):
            return validate_name(name), int(inode)
    except InvalidArgument:
        pass
    raise TransferError(f"{session!r} is not a same-host engine session")
