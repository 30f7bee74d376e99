"""The same-host engine's errors: a refusal, and the one that says the peer is gone."""

from __future__ import annotations

from ...errors import ShmSlotsError


class TransferError(ShmSlotsError):
    """A same-host transfer was refused or failed; nothing of it was written after this."""


class PeerGone(TransferError):
    """The peer's registry is gone, replaced (a restart), or its owner is dead."""


class EngineClosed(TransferError):
    """This engine was closed or retired (its process is ending): it starts no transfer."""
