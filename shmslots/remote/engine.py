"""What `shmslots.remote` asks of a transfer engine, and the rules every engine shares.

The grant, writer and server code speak only to `Engine`; `mooncake.py` and `nixl.py` are
the two files that touch a real engine, each behind its own import, so that a missing wheel
or system library is reported in one place.  An engine moves bytes by address into a
peer's registered memory and carries short named messages (the commits) behind them;
which rows, which slots and when a slot may be reused are never its business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
        self.dropped = 0  # notifies under a name nobody listens for: any peer can send them
        self._inbox: dict[str, list[str]] = {}  # name listened for -> messages not yet read

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
        accounting is the truth.  A write that fails (EngineError), timed out included,
        may still land whole later: an engine cannot recall bytes it handed to the network.
        """
        if not len(sources) == len(targets) == len(lengths):
            raise InvalidArgument("sources, targets and lengths must be as many")
        if notify is not None and len(notify[1]) > MAX_NOTIFY:
            raise InvalidArgument(f"notify of {len(notify[1])} bytes exceeds {MAX_NOTIFY}")
        if notify is not None and "\0" in notify[0]:
            raise InvalidArgument("a notify's name cannot hold a NUL")
        self._transfer(session, list(sources), list(targets), list(lengths), notify)

    def listen(self, name: str) -> None:
        """Keep the messages that arrive under `name` from now on, for `notifies(name)`;
        those under names nobody listens for are dropped and counted (`dropped`)."""
        self._inbox.setdefault(name, [])

    def notifies(self, name: str) -> list[str]:
        """Messages received under `name` (listened for) since the last call."""
        for got, message in self._received():
            kept = self._inbox.get(got)
            if kept is None:
                self.dropped += 1
            else:
                kept.append(message)
        messages = self._inbox.get(name, [])
        if name in self._inbox:
            self._inbox[name] = []
        return messages

    def close(self) -> None:  # noqa: B027 - an engine with nothing to stop keeps this one
        """Stop the engine where it can be stopped (then a peer's later write fails at the
        peer; Mooncake's cannot: it stops when collected).  Idempotent."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
