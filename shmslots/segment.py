"""A named POSIX shared-memory object, mapped: create, open, close, unlink.

posix_ipc is used instead of multiprocessing.shared_memory so that Python's
resource_tracker never sees the segment: it can neither unlink a table that
another process created nor warn about one at exit.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import stat

import posix_ipc

from .errors import (
    IncompatibleTable,
    InvalidArgument,
    ShmSlotsError,
    TableExists,
    TableNotFound,
    TableNotReady,
    TablePermissionError,
)
from .units import fmt_bytes

SHM_DIR = "/dev/shm"  # where Linux shows POSIX shared-memory objects, by name
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


class OutOfSharedMemory(ShmSlotsError, MemoryError):
    """/dev/shm has too little space left for the segment."""


def address_of(mm: mmap.mmap) -> int:
    """Where a writable mapping starts in this process (the temporary export is gone before
    this returns, so the mapping can still be closed)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def valid_name(name: object) -> bool:
    """Table names are plain words: no slashes, no path tricks, at most 200 characters."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def validate_name(name: str) -> str:
    """`name`, if a `valid_name`; else InvalidArgument."""
    if not valid_name(name):
        raise InvalidArgument(
            f"table name {name!r} must be 1-200 characters of letters, digits, '_', '.', '-' "
            "and must not start with '.' or '-'"
        )
    return name


def open_shm_file(name: str, flags: int) -> int:
    """A descriptor of /dev/shm/`name` (a validated name), opened as shm_open does, but
    never waiting (O_NONBLOCK: a FIFO) and never through a symlink.  What the name is (none,
    not ours to open, not a file) fails as a ShmSlotsError; this process's own trouble (no
    descriptors left) as the OSError it is."""
    try:
        return os.open(
            os.path.join(SHM_DIR, name),
            flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
        )
    except FileNotFoundError:
        raise TableNotFound(f"no table named {name!r}") from None
    except PermissionError as exc:
        raise TablePermissionError(f"cannot open {name!r}: {exc.strerror}") from None
    except OSError as exc:
        if exc.errno not in _NOT_A_FILE:
            raise  # out of descriptors or memory, say: this process's trouble, not the name's
        raise IncompatibleTable(
            f"cannot open {name!r} ({exc.strerror}): not a shmslots table"
        ) from None


# a process's address space on x86-64 and aarch64: an object claiming more is none of ours
ADDRESS_SPACE = 1 << 47

# what opening a name that is no regular file gives: a symlink (O_NOFOLLOW), a socket, a
# directory, a device without its driver, a file leased to another
_NOT_A_FILE = {errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.EWOULDBLOCK}


class Segment:
    """One mapped shared-memory object and the descriptor it was opened with.

    Participants take their liveness locks on a descriptor of their own
    (table.py), so that the one this mapping holds carries no lock."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, created: bool) -> None:
        self.name = name
        self.fd = fd
        self.mm = mm
        self.created = created

    @property
    def size(self) -> int:
        return len(self.mm)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Exclusive create, mode 0600, with all `size` bytes reserved up front.

        Reserving (posix_fallocate) turns "too little /dev/shm" into a clear
        error now instead of a SIGBUS in the middle of a later write.
        """
        validate_name(name)
        try:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            raise TableExists(f"a shared-memory object named {name!r} already exists") from None
        except posix_ipc.PermissionsError as exc:
            raise TablePermissionError(f"cannot create {name!r}: {exc}") from None
        fd = shm.fd
        try:
            os.fchmod(fd, 0o600)  # the umask must not widen or narrow it
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise OutOfSharedMemory(_no_room(name, size, fd, exc.strerror)) from None
                raise
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            posix_ipc.unlink_shared_memory("/" + name)
            raise
        return cls(name, fd, mm, created=True)

    @classmethod
    def open(cls, name: str, *, writable: bool = True) -> Segment:
        """Map the object `name`.  Opened without blocking and without following a link,
        and refused unless a regular file: anyone may put a FIFO (whose open would wait
        for a writer, forever) or a symlink under a name in /dev/shm."""
        validate_name(name)
        fd = open_shm_file(name, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IncompatibleTable(f"{name!r} is not a regular file: not a shmslots table")
            size = st.st_size
            if size == 0:  # created, not sized yet: a creator at work, or one that died there
                raise TableNotReady(f"{name!r} is empty: not a shmslots table (yet)")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            try:
                mm = mmap.mmap(fd, size, access=access)
            except (OSError, OverflowError, ValueError) as exc:
                limits = isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.EAGAIN)
                if limits and size < ADDRESS_SPACE:
                    raise  # this process's limits (RLIMIT_AS, the map count), not the object's
                # A sparse object can claim any size; one too big to map is no table of ours.
                raise IncompatibleTable(
                    f"{name!r} is {size} bytes and cannot be mapped ({exc}): not a shmslots table"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, created=False)

    @property
    def identity(self) -> tuple[int, int]:
        """(device, inode) of the object mapped: one made later under the same name (a
        restart's) has another."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    @property
    def unlinked(self) -> bool:
        """Whether the object's name was removed; the mapping stays usable meanwhile."""
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> bool:
        """Unmap and close; False (and the mapping kept) while it is exported.

        A copy into the mapping that runs on another thread holds an export for the
        copy's length, so it is never unmapped under the copy; the mapping goes once
        its last exporter and reference do.
        """
        try:
            self.mm.close()
        except BufferError:
            return False
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        return True

    def unlink(self) -> None:
        unlink(self.name)


def _no_room(name: str, size: int, fd: int, why: str | None) -> str:
    """What was asked for and what the file system has left, both readable."""
    vfs = os.fstatvfs(fd)
    free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    return (
        f"cannot reserve {fmt_bytes(size)} ({size:,} bytes) for {name!r} in /dev/shm, which has "
        f"{fmt_bytes(free)} free of {fmt_bytes(total)}: {why}"
    )


def unlink(name: str) -> None:
    validate_name(name)
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        raise TableNotFound(f"no table named {name!r}") from None
