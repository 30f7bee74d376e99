"""What `shmslots.remote` asks of a transfer engine, and the rules every engine shares.

The grant, writer and server code speak only to `Engine`; `mooncake.py` and `nixl.py` are
the two files that touch a real engine, each behind its own import, so that a missing wheel
or system library is reported in one place.  An engine moves bytes by address into a
peer's registered memory and carries short named messages (the commits) behind them;
which rows, which slots and when a slot may be reused are never its business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Sequence

from ..errors import InvalidArgument, ShmSlotsError
from ..segment import address_of

__all__ = ["Engine", "EngineError", "RemoteUnavailable", "address_of"]

MAX_NOTIFY = 64 * 1024  # Mooncake drops notify messages near 1 MiB without telling the sender


class RemoteUnavailable(ShmSlotsError, ImportError):
    """The engine asked for cannot be imported here."""


class EngineError(ShmSlotsError):
    """The engine refused or failed an operation (start, registration, transfer)."""


class Engine(ABC):
    """One transfer engine, reachable by peers as `session`.

    A peer learns how to reach it from `contact()` (sent on any channel, e.g. the grant
    link) and loads that with `connect()` before its first write here.
    """

    kind: str  # "mooncake" or "nixl": what `open_engine` and the grant link call it
    # Whether bytes sent to an unregistered address are refused on the receiving side.  An
    # engine that cannot promise it is closed by the RemoteServer that used it, so that no
    # late write lands in a slot its close frees.
    refuses_unregistered: bool

    def __init__(self) -> None:
        self.session = ""  # set by the engine once it is up
        self.served_by: object | None = None  # the RemoteServer using it, if any
        self._inbox: defaultdict[str, list[str]] = defaultdict(list)

    @abstractmethod
    def contact(self) -> bytes:
        """What a peer needs to write here: pass it to the peer's `connect()` after every
        registration the peer will write into."""

    @abstractmethod
    def connect(self, contact: bytes) -> str:
        """Load a peer's `contact()`; returns the peer's session (what grants name)."""

    @abstractmethod
    def register(self, address: int, length: int) -> None:
        """Let peers write into (and this engine send from) `length` bytes at `address`."""

    @abstractmethod
    def unregister(self, address: int) -> None:
        """End the registration that starts at `address`."""

    def write(
        self,
        session: str,
        sources: Sequence[int],
        targets: Sequence[int],
        lengths: Sequence[int],
        notify: tuple[str, str] | None = None,
    ) -> None:
        """Write local buffers to the peer's addresses, then send it `notify` (name, message).

        Blocks until the transfer is done.  No buffers and a notify sends the message
        alone.  The engine does not confirm the notify's delivery: the peer's own
        accounting is the truth.
        """
        if not len(sources) == len(targets) == len(lengths):
            raise InvalidArgument("sources, targets and lengths must be as many")
        if notify is not None and len(notify[1]) > MAX_NOTIFY:
            raise InvalidArgument(f"notify of {len(notify[1])} bytes exceeds {MAX_NOTIFY}")
        if notify is not None and "\0" in notify[0]:
            raise InvalidArgument("a notify's name cannot hold a NUL")
        self._transfer(session, list(sources), list(targets), list(lengths), notify)

    def notifies(self, name: str) -> list[str]:
        """Messages received under `name` since the last call; others wait for their reader."""
        for got, message in self._received():
            self._inbox[got].append(message)
        return self._inbox.pop(name, [])

    def close(self) -> None:  # noqa: B027 - an engine with nothing to stop keeps this one
        """Stop the engine; a peer's later write fails at the peer.  Idempotent."""

    @abstractmethod
    def _transfer(
        self,
        session: str,
        sources: list[int],
        targets: list[int],
        lengths: list[int],
        notify: tuple[str, str] | None,
    ) -> None: ...

    @abstractmethod
    def _received(self) -> Iterable[tuple[str, str]]:
        """(name, message) of each notify that arrived since the last call."""
