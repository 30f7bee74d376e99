"""The participant registry: who is attached, and whether they are still alive.

Each participant holds an OFD (open-file-description) write lock on one byte
of the segment, the byte numbered by its registry index.  The kernel drops the
lock when the process dies, however it dies, so liveness never trusts a pid
number: a dead owner whose pid was reused is still seen dead.  The pid and the
process start time are recorded for people (the CLI), not for decisions.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import time
from dataclasses import dataclass

from . import layout as L
from ._core import AtomicView
from .errors import RegistryFull, TableNotReady

FREE = 0
ACTIVE = 1

_FLOCK = struct.Struct("hhqqixxxx")  # struct flock on Linux x86-64/aarch64: 32 bytes


def _lock_request(kind: int, index: int, length: int = 1) -> bytes:
    """A struct flock for `length` bytes at `index` (0: to the end of any file)."""
    return _FLOCK.pack(kind, os.SEEK_SET, index, length, 0)


# A lock byte past every registry entry's: held shared by a process between opening a table
# (or creating it) and holding its own registry entry, when nothing else shows it is there.
# Whoever replaces an orphaned table first takes it exclusively (orphans.py).
GATE = 1 << 40


def hold_gate(fd: int, name: str, deadline: float) -> None:
    """Say a participant is being made on this table, waiting out a replacer that holds the
    gate until `deadline` (monotonic s) and no longer: a stopped holder (SIGSTOP, a debugger,
    a frozen cgroup) keeps its lock, and no caller's bound is to be ignored for it."""
    while True:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_RDLCK, GATE))
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            raise TableNotReady(
                f"{name!r} is being replaced or checked by another process that holds its gate "
                f"({gate_holder(fd)}); it has not let go in time"
            )
        time.sleep(0.002)


def gate_holder(fd: int) -> str:
    """Who holds the gate: "pid N (exclusive)" for a replacer, "(shared)" for a creator or
    attacher at work, "nobody" when it is free.  fcntl's F_OFD_GETLK gives no pid and many
    kernels show OFD locks as pid -1 in /proc/locks, so the holders are found by the
    descriptors of this file that processes readable here have open, and the locks
    /proc/PID/fdinfo lists on each (an error path and `shmslots ls` only)."""
    path = os.readlink(f"/proc/self/fd/{fd}")
    inode = f":{os.fstat(fd).st_ino} {GATE} "
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for other in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{other}") != path:
                    continue
                with open(f"/proc/{pid}/fdinfo/{other}") as f:
                    for line in f:
                        if line.startswith("lock:") and "OFDLCK" in line and inode in line:
                            kind = "exclusive" if "WRITE" in line else "shared"
                            holders.append(f"pid {pid} ({kind})")
    return ", ".join(dict.fromkeys(holders)) or "nobody"


def release_gate(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_UNLCK, GATE))


def close_gate(fd: int) -> bool:
    """The gate exclusively, or False: a participant is being made, or another replacer."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_WRLCK, GATE))
    except OSError:
        return False
    return True


def stat_fields(path: str) -> list[bytes]:
    """The fields of a /proc stat file from the third (state) on; OSError as it came."""
    with open(path, "rb") as f:
        return split_stat(f.read())


def split_stat(stat: bytes) -> list[bytes]:
    """The fields of a /proc stat file's text from the third (state) on.  The command name
    before them may hold spaces and parentheses: split after the last ')'."""
    return stat[stat.rindex(b")") + 2 :].split()


def process_start_ticks(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (0 if it is gone)."""
    try:
        return int(stat_fields(f"/proc/{pid}/stat")[19])
    except OSError:
        return 0


@dataclass(frozen=True)
class Participant:
    index: int
    pid: int
    start_ticks: int
    attach_ns: int
    last_seen_ns: int
    role: str
    name: str
    alive: bool


class RegistryReader:
    """Reads registry entries and tests their locks; needs only a read-only mapping."""

    def __init__(self, mm: memoryview, lay: L.Layout, fd: int) -> None:
        self._mv = mm
        self._layout = lay
        self._fd = fd

    @property
    def fd(self) -> int:
        """The open file description this participant's liveness locks live on."""
        return self._fd

    def lock_is_held(self, index: int) -> bool:
        """Whether another open file description holds entry `index`'s lock."""
        reply = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _lock_request(fcntl.F_WRLCK, index))
        kind: int = _FLOCK.unpack(reply)[0]
        return kind != fcntl.F_UNLCK

    def is_active(self, index: int) -> bool:
        (state,) = struct.unpack_from("<Q", self._mv, self._layout.registry_entry(index))
        return bool(state == ACTIVE)

    def dead_entries(self, own_index: int) -> list[int]:
        """ACTIVE entries whose holder is gone (a lock nobody holds)."""
        return [
            i
            for i in range(self._layout.registry_capacity)
            if i != own_index and self.is_active(i) and not self.lock_is_held(i)
        ]

    def describe(self, index: int, own_index: int) -> Participant:
        base = self._layout.registry_entry(index)
        (pid,) = struct.unpack_from("<I", self._mv, base + L.REG_PID)
        start, attach, seen = struct.unpack_from("<QQQ", self._mv, base + L.REG_START_TICKS)
        role = bytes(self._mv[base + L.REG_ROLE : base + L.REG_ROLE + L.ROLE_LEN])
        name = bytes(self._mv[base + L.REG_NAME : base + L.REG_NAME + L.NAME_LEN])
        alive = index == own_index or self.lock_is_held(index)
        return Participant(index, pid, start, attach, seen, _text(role), _text(name), alive)

    def participants(self, own_index: int = -1) -> list[Participant]:
        return [
            self.describe(i, own_index)
            for i in range(self._layout.registry_capacity)
            if self.is_active(i)
        ]


class Registry(RegistryReader):
    """Registry entries plus the byte locks that prove their holders alive."""

    def __init__(self, atomics: AtomicView, mm: memoryview, lay: L.Layout, fd: int) -> None:
        super().__init__(mm, lay, fd)
        self._a = atomics

    def try_lock(self, index: int) -> bool:
        """Take the liveness lock of entry `index` without waiting."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_WRLCK, index))
        except OSError:
            return False
        return True

    def register(self, role: str, name: str, stamp: int | None = None) -> tuple[int, bool]:
        """Lock a free entry and fill it; returns (index, previous holder died there).

        The lock is taken before the entry is marked ACTIVE, so an ACTIVE
        entry whose lock nobody holds is always a dead participant.
        """
        for index in range(self._layout.registry_capacity):
            if not self.try_lock(index):
                continue
            died_here = self.is_active(index)
            self._fill(index, role, name, stamp)
            return index, died_here
        raise RegistryFull(
            f"all {self._layout.registry_capacity} participant entries are held by live "
            "processes; close unused tables or create the table with more participants"
        )

    def _fill(self, index: int, role: str, name: str, stamp: int | None) -> None:
        """`stamp`: the attach time to record (the creator's is the header's created_ns, so
        that its entry is known by identity, not by pid number)."""
        base = self._layout.registry_entry(index)
        pid = os.getpid()
        now = time.time_ns()
        struct.pack_into("<I", self._mv, base + L.REG_PID, pid)
        struct.pack_into("<Q", self._mv, base + L.REG_START_TICKS, process_start_ticks(pid))
        struct.pack_into(
            "<QQ", self._mv, base + L.REG_ATTACH_NS, now if stamp is None else stamp, now
        )
        struct.pack_into(f"{L.ROLE_LEN}s", self._mv, base + L.REG_ROLE, _fit(role, L.ROLE_LEN))
        struct.pack_into(f"{L.NAME_LEN}s", self._mv, base + L.REG_NAME, _fit(name, L.NAME_LEN))
        self._a.store(base + L.REG_STATE, ACTIVE)

    def touch(self, index: int) -> None:
        self._a.store(self._layout.registry_entry(index) + L.REG_LAST_SEEN_NS, time.time_ns())


def _fit(text: str, size: int) -> bytes:
    raw = text.encode("utf-8")[:size]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")
