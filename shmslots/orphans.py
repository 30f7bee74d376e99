"""Tables whose every participant died: told apart from live ones, and removed by name.

A creator killed with SIGKILL (or SIGTERM without a handler) leaves its table's name in
/dev/shm.  Whether a table is orphaned is the registry's answer (each participant holds a
kernel lock on its entry, released when it dies), never a guess from pid numbers.  Removal
unlinks only the object that was looked at: one made under the same name since has another
inode and is left alone.
"""

from __future__ import annotations

import os
import stat

from .errors import (
    IncompatibleTable,
    ShmSlotsError,
    TableNotFound,
    TableNotReady,
    TablePermissionError,
)
from .layout import MAGIC
from .participants import close_gate, release_gate
from .segment import SHM_DIR, Segment, open_shm_file, unlink
from .snapshot import TableView


def describe(name: str) -> str:
    """Who uses table `name`, for an error message: its live participants, a process still
    creating or attaching to it, or that it is orphaned and how to remove it."""
    try:
        segment = Segment.open(name)
    except ShmSlotsError as exc:
        return _unreadable(name, exc)
    try:
        if not close_gate(segment.fd):
            return "a process is creating it or attaching to it"
        release_gate(segment.fd)
        try:
            alive = TableView(segment).live_participants()
        except ShmSlotsError as exc:
            return _unreadable(name, exc)
    finally:
        segment.close()
    if alive:
        who = ", ".join(f"pid {p.pid} ({p.role})" for p in alive[:3])
        return f"{len(alive)} live participant(s) use it: {who}"
    return (
        f"it is orphaned: no participant is alive; `shmslots unlink {name}` removes it, "
        "or create(..., replace_orphaned=True) replaces it"
    )


def _unreadable(name: str, exc: ShmSlotsError) -> str:
    if force_removes(name, exc):
        return f"it cannot be read ({exc}); `shmslots unlink --force {name}` removes it"
    return f"it cannot be read ({exc})"


def force_removes(name: str, exc: ShmSlotsError) -> bool:
    """Whether `shmslots unlink --force` removes `name`, which `exc` said is no table to
    open: ours only, a table of our magic or one its creator never finished (no magic yet,
    nobody registered); never another program's segment, a FIFO, a link or another user's."""
    return isinstance(exc, TableNotReady) or has_magic(name) is True


def has_magic(name: str) -> bool | None:
    """Whether /dev/shm/NAME is a regular file that starts with the table magic; None if it
    cannot be read."""
    try:
        fd = open_shm_file(name, os.O_RDONLY)  # never waits on a FIFO
    except TablePermissionError:
        return None
    except (ShmSlotsError, OSError):
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(MAGIC), 0) == MAGIC
    finally:
        os.close(fd)


def remove_if_orphaned(name: str) -> bool:
    """Unlink table `name` if no participant of it is alive; whether it did.  Under the
    table's gate (participants.GATE), taken exclusively: a process creating or attaching to
    it holds the gate until it is registered, so it is never taken for dead; and of two
    replacers only the first acts.  One that cannot be read (a creator that died making it)
    is left to `shmslots unlink --force`."""
    try:
        segment = Segment.open(name)
    except (TableNotFound, TableNotReady, IncompatibleTable):  # a FIFO or a link, say
        return False
    try:
        if not close_gate(segment.fd):
            return False
        try:
            return _unlink_if_orphaned(segment)
        finally:
            release_gate(segment.fd)
    finally:
        segment.close()


def _unlink_if_orphaned(segment: Segment) -> bool:
    try:
        if TableView(segment).live_participants():
            return False
    except ShmSlotsError:
        return False
    try:  # only the object looked at: the name may have been given to another since
        st = os.stat(f"{SHM_DIR}/{segment.name}")
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != segment.identity:
        return False
    try:
        unlink(segment.name)
    except TableNotFound:
        return False
    return True
