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
from .schema import DTYPE_CODES, DTYPE_SIZES, Field, contiguous_strides

_DTYPES = list(DTYPE_CODES)  # by the index a ref stores
_MAX_DIMS = 8
_REFUSED = {
    REF_REFUSALS["MALFORMED"]: "is no valid ref (never written, or overwritten)",
    REF_REFUSALS["NOT_OURS"]: "refers to another table's arena",
    REF_REFUSALS["DTYPE"]: "holds another dtype than its field",
    REF_REFUSALS["SIZE"]: "is not as many bytes as its shape",
    REF_REFUSALS["OUTSIDE"]: "points outside the arena",
    REF_REFUSALS["SHAPE"]: "is not of its field's shape",
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


# Every key opening a CUDA ref reads (cuda_ipc.open_tensor, refs.Refs.open), by its exact type
_CUDA_KEYS: dict[str, type] = {
    "pid": int, "uuid": str, "handle": bytes, "size": int, "soff": int, "event": bytes,
    "sync": bool, "off": int, "shape": list, "stride": list, "dtype": str,
}  # fmt: skip


def _well_formed(d: object) -> bool:
    """A CUDA ref's description: every key opening reads, of its exact type (a bool is no
    size), sizes and offsets not negative, as many strides as dimensions."""
    if type(d) is not dict or d.get("b") != "cuda":
        return False
    if any(type(d.get(key)) is not kind for key, kind in _CUDA_KEYS.items()):
        return False
    if d["dtype"] not in DTYPE_SIZES or min(d["size"], d["soff"], d["off"], d["pid"]) < 0:
        return False
    shape, stride = d["shape"], d["stride"]
    if len(shape) > _MAX_DIMS or len(stride) != len(shape):
        return False
    return all(type(size) is int and size >= 0 for size in shape + stride)


def check_fits(d: dict[str, Any], field: Field, name: str) -> None:
    """A CUDA ref must be of its field's dtype and shape (rank, and every fixed size), as an
    arena ref must (csrc/refcodec.c): CorruptTable otherwise."""
    shape = d["shape"]
    if not (d["dtype"] == field.dtype and field.accepts_shape(tuple(shape))):
        raise CorruptTable(
            f"CUDA ref of {name!r} is {d['dtype']}{shape}, its field is "
            f"{field.dtype}{list(field.shape)}"
        )
