"""The bytes of a ref field, read as a description of the tensor they refer to.

csrc/refcodec.c holds the format (an arena ref is a fixed binary record; a CUDA ref wraps
its msgpack IPC description); this is its face for the CLI, which shows what a row's ref
points to without loading torch, and for opening CUDA refs (refs.py).
"""

from __future__ import annotations

from typing import Any

import msgpack

from ._core import REF_REFUSALS, parse_ref
from .errors import CorruptTable
from .schema import DTYPE_CODES, DTYPE_SIZES, contiguous_strides

_DTYPES = list(DTYPE_CODES)  # by the index a ref stores
_MAX_DIMS = 8
_REFUSED = {
    REF_REFUSALS["MALFORMED"]: "is no valid ref (never written, or overwritten)",
    REF_REFUSALS["NOT_OURS"]: "refers to another table's arena",
    REF_REFUSALS["DTYPE"]: "holds another dtype than its field",
    REF_REFUSALS["SIZE"]: "is not as many bytes as its shape",
    REF_REFUSALS["OUTSIDE"]: "points outside the arena",
}


def decode(raw: bytes) -> dict[str, Any]:
    """Parse a ref from row bytes; anything malformed is CorruptTable."""
    try:
        parsed = parse_ref(raw)
    except ValueError as exc:
        raise CorruptTable(str(exc)) from None
    if len(parsed) == 2:
        return _cuda(parsed[1])
    _, dtype, offset, nbytes, shape, table = parsed
    if dtype >= len(_DTYPES):
        raise CorruptTable(f"ref of dtype number {dtype}, which no field has")
    return {
        "b": "shm",
        "arena": table,
        "off": offset,
        "n": nbytes,
        "dtype": _DTYPES[dtype],
        "shape": list(shape),
        "stride": list(contiguous_strides(shape)),  # contiguous in the arena
    }


def refusal(code: int, name: str) -> CorruptTable:
    """The error for a refusal code of RowCodec.open_ref."""
    return CorruptTable(f"ref of {name!r} {_REFUSED[code]}")


def _cuda(payload: bytes) -> dict[str, Any]:
    try:
        d = msgpack.unpackb(payload, raw=False, max_array_len=64)
    except Exception as exc:
        raise CorruptTable(f"CUDA ref is not valid msgpack: {exc}") from None
    if not _well_formed(d):
        raise CorruptTable(f"malformed ref {d!r}")
    result: dict[str, Any] = d
    return result


def _well_formed(d: object) -> bool:
    """A CUDA ref's description: shape and dtype, exact types (a bool is no size)."""
    if type(d) is not dict or d.get("b") != "cuda":
        return False
    dtype, shape = d.get("dtype"), d.get("shape")
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        return False
    if type(shape) is not list or len(shape) > _MAX_DIMS:
        return False
    return all(type(size) is int and size >= 0 for size in shape)
