"""The one file that touches the Mooncake Transfer Engine.

Everything else in `shmslots.remote` speaks to `Engine`, so the engine's
API (and its import failure, which needs Debian's libibverbs1 even for TCP)
is handled in one place.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidArgument, ShmSlotsError
from ..segment import address_of

__all__ = ["Engine", "EngineError", "RemoteUnavailable", "address_of"]

MAX_NOTIFY = 64 * 1024  # Mooncake drops notify messages near 1 MiB without telling the sender


class RemoteUnavailable(ShmSlotsError, ImportError):
    """The Mooncake Transfer Engine cannot be imported here."""


class EngineError(ShmSlotsError):
    """The engine refused or failed an operation (start, registration, transfer)."""


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


class Engine:
    """One transfer engine, reachable by peers as `session` ("host:port").

    P2PHANDSHAKE mode needs no metadata server: peers exchange buffer lists
    directly, and the receiving side refuses a write outside its registered
    buffers.  `protocol` is the engine's transport ("tcp", or "rdma" where
    there are RDMA devices); there is no fallback between them.  Mooncake
    gives an engine no close: it stops when the object is collected.
    """

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        mc = _mooncake()
        self._mc = mc
        self._engine = mc.TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise EngineError(f"transfer engine failed to start on {host} over {protocol}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._inbox: defaultdict[str, list[str]] = defaultdict(list)
        self.served_by: object | None = None  # the RemoteServer using it, if any

    def register(self, address: int, length: int) -> None:
        if self._engine.register_memory(address, length) != 0:
            raise EngineError(f"cannot register {length} bytes at {address:#x}")

    def unregister(self, address: int) -> None:
        if self._engine.unregister_memory(address) != 0:
            raise EngineError(f"cannot unregister the buffer at {address:#x}")

    def write(
        self,
        session: str,
        sources: Sequence[int],
        targets: Sequence[int],
        lengths: Sequence[int],
        notify: tuple[str, str] | None = None,
    ) -> None:
        """Write local buffers to the peer's addresses, then send it `notify` (name, message).

        Blocks until the transfer is done (the engine gives up on a silent peer
        after about a minute).  The engine does not confirm the notify's
        delivery: the peer's own accounting is the truth.
        """
        if notify is None:
            rc = self._engine.batch_transfer_sync_write(
                session, list(sources), list(targets), list(lengths)
            )
        else:
            name, message = notify
            if len(message) > MAX_NOTIFY:
                raise InvalidArgument(f"notify of {len(message)} bytes exceeds {MAX_NOTIFY}")
            rc = self._engine.batch_transfer_sync(
                session,
                list(sources),
                list(targets),
                list(lengths),
                self._mc.TransferOpcode.Write,
                self._mc.TransferNotify(name, message),
            )
        if rc != 0:
            raise EngineError(
                f"transfer of {len(sources)} buffer(s) to {session} failed (engine status {rc})"
            )

    def notifies(self, name: str) -> list[str]:
        """Messages received under `name` since the last call; others wait for their reader."""
        for notify in self._engine.get_notifies():
            self._inbox[notify.name].append(notify.msg)
        return self._inbox.pop(name, [])
