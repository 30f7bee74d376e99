"""What the owner hands a remote writer: where each field of one reserved row lies, and as
which generation; and the commit the writer sends back."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import ShmSlotsError
from ..schema import MAX_FIELDS, MAX_ROW_SIZE

_U64 = 2**64
_U32 = 2**32
_BOUNDS = (_U32, _U32, _U64, _U64, _U64)  # slot, generation, tag, fingerprint, nonce
COMMIT = "shmslots-commit"  # the notify name commits travel under: "entry;entry;..."
# a commit entry: the grant's key "slot:generation:nonce", then the row's checksum
_ENTRY = re.compile(r"([0-9]{1,10}:[0-9]{1,10}:[0-9a-f]{16}):([0-9a-f]{8})", re.ASCII)


class GrantError(ShmSlotsError, ValueError):
    """A grant that cannot be decoded or does not fit the writer's schema."""


@dataclass(frozen=True)
class Grant:
    """One reserved row, as the remote writer must address it.

    `targets[i]` is where field i (in schema order) of the reserved slot lies in the
    owner's table, as mapped there, and `lengths[i]` its bytes (the field's own, not the
    column's padding): the writer writes each field straight into the row.  `nonce` is
    random per grant: a commit must name it, so a stray or guessed commit cannot use up a
    grant it did not write.
    """

    session: str  # the owner's engine, "host:port"
    targets: tuple[int, ...]
    lengths: tuple[int, ...]
    slot: int
    generation: int
    tag: int
    fingerprint: int  # RowSchema.fingerprint of the owner's table
    nonce: int

    def encode(self) -> bytes:
        blob: bytes = msgpack.packb(
            [self.session, list(self.targets), list(self.lengths), self.slot,
             self.generation, self.tag, self.fingerprint, self.nonce]
        )  # fmt: skip
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
            and _fields_in_range(parts[1], parts[2])
            and all(
                type(p) is int and 0 <= p < bound
                for p, bound in zip(parts[3:], _BOUNDS, strict=True)
            )
        ):
            raise GrantError(
                "grant is not [session, targets, lengths, slot, generation, tag, fingerprint, "
                f"nonce] with 1..{MAX_FIELDS} fields, each field's bytes within 64 bits of "
                "address space, and each number in range"
            )
        session, targets, lengths, *numbers = parts
        return cls(session, tuple(targets), tuple(lengths), *numbers)

    @property
    def commit_key(self) -> str:
        """How a commit names this grant: "slot:generation:nonce"."""
        return f"{self.slot}:{self.generation}:{self.nonce:016x}"

    def commit(self, checksum: int) -> str:
        """The commit entry for this grant's row, written with `checksum` (its row_hash)."""
        return f"{self.commit_key}:{checksum:08x}"


def _fields_in_range(targets: object, lengths: object) -> bool:
    """Per-field addresses and byte counts: as many of each, every field inside 64 bits."""
    return (
        isinstance(targets, list)
        and isinstance(lengths, list)
        and 1 <= len(targets) == len(lengths) <= MAX_FIELDS
        and all(
            type(t) is int and type(n) is int and 0 <= n <= MAX_ROW_SIZE and 0 <= t <= _U64 - n
            for t, n in zip(targets, lengths, strict=True)
        )
    )


def parse_commit(entry: str) -> tuple[str, int] | None:
    """(grant's commit key, checksum) of a well-formed commit entry, else None."""
    match = _ENTRY.fullmatch(entry)
    if match is None:
        return None
    return match[1], int(match[2], 16)
