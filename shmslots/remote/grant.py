"""What the owner hands a remote writer: where each field of one reserved row lies, and as
which generation; and the commit the writer sends back."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import SchemaError, ShmSlotsError
from ..layout import VERSION
from ..schema import MAX_FIELDS, MAX_ROW_SIZE, RowSchema


def require_inline(schema: RowSchema) -> None:
    """A remote writer fills a row's items in place by address; a ref field's tensor lives
    outside the row, where no engine write can put it."""
    if schema.has_refs:
        raise SchemaError("remote writers can fill inline fields only; this schema has ref fields")


def row_format(schema: RowSchema) -> int:
    """64-bit digest of what a writer and the owner must agree on: the row layout, and the
    table format (VERSION), which names the checksum a commit is checked by."""
    blob = schema.encode() + VERSION.to_bytes(4, "little")
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")


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

    `ptrs`, `item_lens` are the owner's `table.buffer_infos()` (each column's address, as
    mapped there, and its stride), and `lengths[i]` field i's own bytes (not the column's
    padding): field i of the row is the `lengths[i]` bytes at `ptrs[i] + item_lens[i] *
    slot`, which the writer writes straight into.  `nonce` is random per grant: a commit
    must name it, so a stray or guessed commit cannot use up a grant it did not write.
    """

    session: str  # the owner's engine (Mooncake: "host:port"; NIXL: its agent's name)
    ptrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    lengths: tuple[int, ...]
    slot: int
    generation: int
    tag: int
    fingerprint: int  # row_format of the owner's table
    nonce: int

    def encode(self) -> bytes:
        blob: bytes = msgpack.packb(
            [self.session, list(self.ptrs), list(self.item_lens), list(self.lengths),
             self.slot, self.generation, self.tag, self.fingerprint, self.nonce]
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
            and len(parts) == 9
            and isinstance(parts[0], str)
            and all(
                type(p) is int and 0 <= p < bound
                for p, bound in zip(parts[4:], _BOUNDS, strict=True)
            )
            and _fields_in_range(parts[1], parts[2], parts[3], parts[4])
        ):
            raise GrantError(
                "grant is not [session, ptrs, item_lens, lengths, slot, generation, tag, "
                f"fingerprint, nonce] with 1..{MAX_FIELDS} fields, each field's bytes within "
                "its item and 64 bits of address space, and each number in range"
            )
        session, ptrs, item_lens, lengths, *numbers = parts
        return cls(session, tuple(ptrs), tuple(item_lens), tuple(lengths), *numbers)

    @property
    def targets(self) -> tuple[int, ...]:
        """Where each field of the row lies in the owner's memory."""
        return tuple(p + n * self.slot for p, n in zip(self.ptrs, self.item_lens, strict=True))

    @property
    def commit_key(self) -> str:
        """How a commit names this grant: "slot:generation:nonce"."""
        return f"{self.slot}:{self.generation}:{self.nonce:016x}"

    def commit(self, checksum: int) -> str:
        """The commit entry for this grant's row, written with `checksum` (its row_hash)."""
        return f"{self.commit_key}:{checksum:08x}"


def _fields_in_range(ptrs: object, item_lens: object, lengths: object, slot: int) -> bool:
    """Per-field columns, strides and byte counts: as many of each, each field's bytes
    inside its item and the row's item inside 64 bits."""
    return (
        isinstance(ptrs, list)
        and isinstance(item_lens, list)
        and isinstance(lengths, list)
        and 1 <= len(ptrs) == len(item_lens) == len(lengths) <= MAX_FIELDS
        and all(
            type(p) is int and type(i) is int and type(n) is int
            and 0 <= n <= i <= MAX_ROW_SIZE and 0 <= p <= _U64 - i * (slot + 1)
            for p, i, n in zip(ptrs, item_lens, lengths, strict=True)
        )
    )  # fmt: skip


def parse_commit(entry: str) -> tuple[str, int] | None:
    """(grant's commit key, checksum) of a well-formed commit entry, else None."""
    match = _ENTRY.fullmatch(entry)
    if match is None:
        return None
    return match[1], int(match[2], 16)
