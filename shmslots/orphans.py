"""Tables whose every participant died: told apart from live ones, and removed by name.

A creator killed with SIGKILL (or SIGTERM without a handler) leaves its table's name in
/dev/shm.  Whether a table is orphaned is the registry's answer (each participant holds a
kernel lock on its entry, released when it dies), never a guess from pid numbers.  Removal
unlinks only the object that was looked at: one made under the same name since has another
inode and is left alone.
"""

from __future__ import annotations

import os

from .errors import ShmSlotsError, TableNotFound
from .segment import SHM_DIR, unlink
from .snapshot import TableView


def describe(name: str) -> str:
    """Who uses table `name`, for an error message: its live participants, or that it is
    orphaned and how to remove it."""
    try:
        with TableView.open(name) as view:
            alive = view.live_participants()
    except ShmSlotsError as exc:
        return f"it cannot be read ({exc}); `shmslots unlink --force {name}` removes it"
    if alive:
        who = ", ".join(f"pid {p.pid} ({p.role})" for p in alive[:3])
        return f"{len(alive)} live participant(s) use it: {who}"
    return (
        f"it is orphaned: no participant is alive; `shmslots unlink {name}` removes it, "
        "or create(..., replace_orphaned=True) replaces it"
    )


def remove_if_orphaned(name: str) -> bool:
    """Unlink table `name` if no participant of it is alive; whether it did.  One that cannot
    be read (a creator that died making it) raises: only `shmslots unlink --force` decides."""
    try:
        with TableView.open(name) as view:
            if view.live_participants():
                return False
            identity = view.identity()
    except TableNotFound:
        return False
    st = os.stat(f"{SHM_DIR}/{name}")
    if (st.st_dev, st.st_ino) != identity:
        return False  # replaced meanwhile: not the table we looked at
    try:
        unlink(name)
    except TableNotFound:
        return False
    return True
