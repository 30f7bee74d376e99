"""The bytes of a ref field: a length-prefixed msgpack description of the tensor.

Decoding needs no torch, so the CLI can show what a row's ref points to
without loading it; refs.py opens the tensors.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .errors import CorruptTable
from .schema import DTYPE_SIZES

LENGTH = struct.Struct("<H")
_MAX_DIMS = 8


def decode(raw: bytes) -> dict[str, Any]:
    """Parse a ref from row bytes; anything malformed is CorruptTable."""
    (length,) = LENGTH.unpack_from(raw)
    if length == 0 or LENGTH.size + length > len(raw):
        raise CorruptTable("row holds no valid ref (never written, or overwritten)")
    try:
        d = msgpack.unpackb(raw[LENGTH.size : LENGTH.size + length], raw=False, max_array_len=64)
    except Exception as exc:
        raise CorruptTable(f"ref is not valid msgpack: {exc}") from None
    if not _well_formed(d):
        raise CorruptTable(f"malformed ref {d!r}")
    result: dict[str, Any] = d
    return result


def _well_formed(d: object) -> bool:
    """A ref's shape, dtype and, for the arena, place: exact types (a bool is no size)."""
    if type(d) is not dict:
        return False
    dtype, shape = d.get("dtype"), d.get("shape")
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        return False
    if type(shape) is not list or len(shape) > _MAX_DIMS:
        return False
    for size in shape:
        if type(size) is not int or size < 0:
            return False
    kind = d.get("b")
    if kind == "shm":
        off, n = d.get("off"), d.get("n")
        return (
            type(off) is int
            and type(n) is int
            and off >= 0
            and n >= 0
            and (type(d.get("arena")) is str)
        )
    return kind == "cuda"
