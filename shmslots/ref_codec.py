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
    ok = isinstance(d, dict) and d.get("b") in ("shm", "cuda")
    ok = ok and d.get("dtype") in DTYPE_SIZES and _is_shape(d.get("shape"))
    if ok and d["b"] == "shm":
        ok = all(isinstance(d.get(k), int) and d[k] >= 0 for k in ("off", "n"))
        ok = ok and isinstance(d.get("arena"), str)
    if not ok:
        raise CorruptTable(f"malformed ref {d!r}")
    result: dict[str, Any] = d
    return result


def _is_shape(shape: object) -> bool:
    return (
        isinstance(shape, list)
        and len(shape) <= _MAX_DIMS
        and all(isinstance(x, int) and x >= 0 for x in shape)
    )
