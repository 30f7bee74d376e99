"""Tables whose every participant died: told apart from live ones, and removed by name.

A creator killed with SIGKILL (or SIGTERM without a handler) leaves its table's name in
/dev/shm.  Whether a table is orphaned is the registry's answer (each participant holds a
kernel lock on its entry, released when it dies), never a guess from pid numbers.  Removal
unlinks only the object that was looked at: one made under the same name since has another
inode and is left alone.
"""

from __future__ import annotations

import os

from .errors import IncompatibleTable, ShmSlotsError, TableNotFound, TableNotReady
from .participants import close_gate, release_gate
from .segment import SHM_DIR, Segment, unlink
from .snapshot import TableView


def describe(name: str) -> str:
    """Who uses table `name`, for an error message: its live participants, a process still
    creating or attaching to it, or that it is orphaned and how to remove it."""
    try:
        segment = Segment.open(name)
    except ShmSlotsError as exc:
        return f"it cannot be read ({exc}); `shmslots unlink --force {name}` removes it"
    try:
        if not close_gate(segment.fd):
            return "a process is creating it or attaching to it"
        release_gate(segment.fd)
        try:
            alive = TableView(segment).live_participants()
        except ShmSlotsError as exc:
            return f"it cannot be read ({exc}); `shmslots unlink --force {name}` removes it"
    finally:
        segment.close()
    if alive:
        who = ", ".join(f"pid {p.pid} ({p.role})" for p in alive[:3])
        return f"{len(alive)} live participant(s) use it: {who}"
    return (
        f"it is orphaned: no participant is alive; `shmslots unlink {name}` removes it, "
        "or create(..., replace_orphaned=True) replaces it"
    )


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
