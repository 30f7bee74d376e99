"""The one file that touches the Mooncake Transfer Engine.

Everything else in `shmslots.remote` speaks to `Engine`, so the engine's
API (and its import failure, which needs Debian's libibverbs1 even for TCP)
is handled in one place.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from typing import Any

from ..errors import ShmSlotsError

COMMIT = "shmslots-commit"  # notify name: the message lists the rows just written


class RemoteUnavailable(ShmSlotsError, ImportError):
    """The Mooncake Transfer Engine cannot be imported or started here."""


class RemoteWriteError(ShmSlotsError):
    """The engine refused or failed a transfer (peer gone, address not registered)."""


def _mooncake() -> Any:
    # glog reads this when the library loads: keep warnings and errors, not its INFO chatter
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake import engine
    except ImportError as exc:
        raise RemoteUnavailable(
            f"the Mooncake Transfer Engine cannot be imported ({exc}); install "
            "`pip install shmslots[remote]` and Debian's libibverbs1 (needed even for TCP)"
        ) from exc
    return engine


def address_of(mm: mmap.mmap) -> int:
    """Base address of a mapping (the temporary export is gone before this returns)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class Engine:
    """One transfer engine, reachable by peers as `session` ("host:port").

    P2PHANDSHAKE mode needs no metadata server: peers exchange buffer lists
    directly, and the receiving side refuses a write outside its registered
    buffers.
    """

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        mc = _mooncake()
        self._mc = mc
        self._engine = mc.TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise RemoteUnavailable(f"transfer engine failed to start on {host} over {protocol}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, address: int, length: int) -> None:
        if self._engine.register_memory(address, length) != 0:
            raise RemoteUnavailable(f"cannot register {length} bytes at {address:#x}")

    def unregister(self, address: int) -> None:
        self._engine.unregister_memory(address)

    def write(
        self,
        session: str,
        sources: Sequence[int],
        targets: Sequence[int],
        lengths: Sequence[int],
        notify: str | None,
    ) -> None:
        """Write local buffers to the peer's addresses; `notify` reaches it afterwards."""
        if notify is None:
            rc = self._engine.batch_transfer_sync_write(
                session, list(sources), list(targets), list(lengths)
            )
        else:
            rc = self._engine.batch_transfer_sync(
                session,
                list(sources),
                list(targets),
                list(lengths),
                self._mc.TransferOpcode.Write,
                self._mc.TransferNotify(COMMIT, notify),
            )
        if rc != 0:
            raise RemoteWriteError(
                f"transfer of {len(sources)} row(s) to {session} failed (engine status {rc})"
            )

    def commits(self) -> list[str]:
        """Commit messages received since the last call (other notifies are dropped)."""
        return [n.msg for n in self._engine.get_notifies() if n.name == COMMIT]
