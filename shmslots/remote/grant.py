"""What the owner hands a remote writer: where to write one row, and as which generation."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

import msgpack

from ..errors import ShmSlotsError


class GrantError(ShmSlotsError, ValueError):
    """A grant that cannot be decoded or does not fit the writer's schema."""


@dataclass(frozen=True)
class Grant:
    """One reserved row, as the remote writer must address it.

    `address` is the landing cell in the owner's memory (as mapped there),
    not the table row: the owner copies the cell into the row at commit.
    """

    session: str  # the owner's engine, "host:port"
    address: int
    length: int
    slot: int
    generation: int
    tag: int
    fingerprint: int  # RowSchema.fingerprint of the owner's table

    def encode(self) -> bytes:
        blob: bytes = msgpack.packb(astuple(self))
        return blob

    @classmethod
    def decode(cls, blob: bytes) -> Grant:
        try:
            parts: Any = msgpack.unpackb(blob, raw=False)
        except Exception as exc:
            raise GrantError(f"grant is not valid msgpack: {exc}") from None
        if not (
            isinstance(parts, list)
            and len(parts) == 7
            and isinstance(parts[0], str)
            and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts[1:])
        ):
            raise GrantError(
                "grant is not [session, address, length, slot, generation, tag, fingerprint]"
            )
        return cls(*parts)

    @property
    def commit_key(self) -> str:
        return f"{self.slot}:{self.generation}"
