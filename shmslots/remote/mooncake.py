"""The one file that touches the Mooncake Transfer Engine (its import needs Debian's
libibverbs1, even for TCP)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .engine import Engine, EngineError, RemoteUnavailable


def load() -> Any:
    """Mooncake's engine module; RemoteUnavailable, saying what to install, without it."""
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


class MooncakeEngine(Engine):
    """Mooncake in P2PHANDSHAKE mode: no metadata server, peers exchange buffer lists
    directly, and the receiving side refuses a write outside its registered buffers.

    `protocol` is the engine's transport ("tcp", or "rdma" where there are RDMA devices);
    there is no fallback between them.  A peer needs only the session ("host:port") to
    reach it.  Mooncake gives an engine no close: it stops when the object is collected.
    """

    kind = "mooncake"
    refuses_unregistered = True

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        super().__init__()
        mc = load()
        self._mc = mc
        self._engine = mc.TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise EngineError(f"transfer engine failed to start on {host} over {protocol}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"

    def contact(self) -> bytes:
        return self.session.encode()

    def connect(self, contact: bytes) -> str:
        """The handshake happens on the first write; here the contact is only checked."""
        try:
            session = contact.decode("ascii")
            host, _, port = session.rpartition(":")
            valid = bool(host) and port.isdigit() and 0 < int(port) < 65536
        except (UnicodeDecodeError, AttributeError):
            valid = False
        if not valid:
            raise EngineError(f"not a Mooncake contact (host:port): {contact[:64]!r}")
        return session

    def register(self, address: int, length: int) -> None:
        if self._engine.register_memory(address, length) != 0:
            raise EngineError(f"cannot register {length} bytes at {address:#x}")

    def unregister(self, address: int) -> None:
        if self._engine.unregister_memory(address) != 0:
            raise EngineError(f"cannot unregister the buffer at {address:#x}")

    def _transfer(
        self,
        session: str,
        sources: list[int],
        targets: list[int],
        lengths: list[int],
        notify: tuple[str, str] | None,
    ) -> None:
        """Gives up on a silent peer after about a minute (the engine's own timeout)."""
        if not sources:  # a notify alone rides on one empty entry
            sources, targets, lengths = [0], [0], [0]
        if notify is None:
            rc = self._engine.batch_transfer_sync_write(session, sources, targets, lengths)
        else:
            rc = self._engine.batch_transfer_sync(
                session,
                sources,
                targets,
                lengths,
                self._mc.TransferOpcode.Write,
                self._mc.TransferNotify(*notify),
            )
        if rc != 0:
            raise EngineError(
                f"transfer of {len(sources)} buffer(s) to {session} failed (engine status {rc})"
            )

    def _received(self) -> Iterable[tuple[str, str]]:
        return ((n.name, n.msg) for n in self._engine.get_notifies())
