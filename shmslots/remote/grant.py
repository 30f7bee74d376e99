"""What the owner hands a remote writer: where to write one row, and as which generation."""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass
from typing import Any

import msgpack

from ..errors import ShmSlotsError

_U64 = 2**64
_U32 = 2**32
_BOUNDS = (_U64, _U64, _U32, _U32, _U64, _U64, _U64)  # address .. nonce
COMMIT = "shmslots-commit"  # the notify name commits travel under: "key;key;..."
_KEY = re.compile(r"([0-9]{1,10}):([0-9]{1,10}):([0-9a-f]{16})", re.ASCII)


class GrantError(ShmSlotsError, ValueError):
    """A grant that cannot be decoded or does not fit the writer's schema."""


@dataclass(frozen=True)
class Grant:
    """One reserved row, as the remote writer must address it.

    `address` is the landing cell in the owner's memory (as mapped there),
    not the table row: the owner copies the cell into the row at commit.
    `nonce` is random per grant: a commit must name it, so a stray or
    guessed commit cannot use up a grant it did not write.
    """

    session: str  # the owner's engine, "host:port"
    address: int
    length: int
    slot: int
    generation: int
    tag: int
    fingerprint: int  # RowSchema.fingerprint of the owner's table
    nonce: int

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
            and len(parts) == 8
            and isinstance(parts[0], str)
            and all(
                type(p) is int and 0 <= p < bound
                for p, bound in zip(parts[1:], _BOUNDS, strict=True)
            )
        ):
            raise GrantError(
                "grant is not [session, address, length, slot, generation, tag, fingerprint, "
                "nonce] with each number in range"
            )
        return cls(*parts)

    @property
    def commit_key(self) -> str:
        """How a commit names this grant: "slot:generation:nonce"."""
        return f"{self.slot}:{self.generation}:{self.nonce:016x}"


def parse_commit_key(key: str) -> tuple[int, int, int] | None:
    """(slot, generation, nonce) of a well-formed commit key, else None."""
    match = _KEY.fullmatch(key)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3], 16)
