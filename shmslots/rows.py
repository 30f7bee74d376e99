"""Row memory: zero-copy field views, checked writes, checksums, leak detection.

Views are built once per slot and reused (making a view costs ~4 µs, more
than a round trip).  Each field of each slot has its own torch storage, so
the storage's use count tells exactly which field still has a view alive —
derived views (slices, `.view()`) included — when the slot is released.
"""

from __future__ import annotations

import mmap
import struct
import sys
import zlib
from typing import Any

import torch

from . import layout as L
from .errors import SchemaError
from .schema import ROW_HEADER_SIZE, Field, FieldSlot, RowSchema

_use_count = torch._C._storage_Use_Count

# struct codes for scalar fast paths; bfloat16 has none and goes through torch.
_SCALAR_CODES = {"int32": "<i", "int64": "<q", "float32": "<f", "float16": "<e", "uint8": "<B"}
_INT_DTYPES = frozenset({"int32", "int64", "uint8"})
_ROW_HEADER = struct.Struct("<QI")


def reference_counts(t: torch.Tensor) -> tuple[int, int]:
    """(Python references to `t`, tensors sharing its storage) — both rise with any view."""
    return sys.getrefcount(t), _use_count(t.untyped_storage()._cdata)


class WatchedTensors:
    """Tensors handed out to callers, with the reference counts they have at rest."""

    __slots__ = ("_baseline", "tensors")

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        # Same expression shape as in leaked(), so temporaries count the same.
        self._baseline = {n: reference_counts(tensors[n]) for n in tensors}

    def leaked(self, names: set[str]) -> list[str]:
        """Names among `names` whose tensor something outside still references."""
        leaked = []
        for n in names:
            refs, uses = reference_counts(self.tensors[n])
            base_refs, base_uses = self._baseline[n]
            if refs > base_refs or uses > base_uses:
                leaked.append(n)
        return sorted(leaked)


class Rows:
    def __init__(self, mm: mmap.mmap, lay: L.Layout, schema: RowSchema) -> None:
        self._mm = mm
        self._mv = memoryview(mm)
        self._layout = lay
        self.schema = schema
        self._views: list[WatchedTensors | None] = [None] * lay.slots
        self._payload = (ROW_HEADER_SIZE, schema.row_size)

    def views(self, slot: int) -> WatchedTensors:
        cached = self._views[slot]
        if cached is None:
            base = self._layout.row(slot)
            cached = self._views[slot] = WatchedTensors(
                {
                    name: self._field_view(base, fs)
                    for name, fs in self.schema.slots.items()
                    if not fs.field.is_handle
                }
            )
        return cached

    def _field_view(self, row: int, fs: FieldSlot) -> torch.Tensor:
        """A tensor over one field with a storage of its own (no intermediate kept alive)."""
        f = fs.field
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=f.nbytes, offset=row + fs.offset)
        return raw.view(f.torch_dtype).view(f.fixed_shape)

    def prepare(self, values: dict[str, Any]) -> list[tuple[str, Any]]:
        """Check every value against the schema before any byte is written."""
        plan: list[tuple[str, Any]] = []
        for name, value in values.items():
            fs = self.schema.slots.get(name)
            if fs is None:
                raise SchemaError(f"no field {name!r}; fields are {list(self.schema.slots)}")
            f = fs.field
            if isinstance(value, torch.Tensor):
                if value.dtype != f.torch_dtype:
                    raise SchemaError(f"field {name!r} is {f.dtype}, got a {value.dtype} tensor")
                if f.is_handle:
                    _check_handle_tensor(f, value)
                elif tuple(value.shape) != f.shape:
                    raise SchemaError(
                        f"field {name!r} has shape {f.shape}, got {tuple(value.shape)}"
                    )
                plan.append((name, value))
            elif f.shape == () and not f.is_handle and _is_scalar_for(f.dtype, value):
                code = _SCALAR_CODES.get(f.dtype)
                if code is None:
                    plan.append((name, torch.tensor(value, dtype=f.torch_dtype)))
                    continue
                try:
                    plan.append((name, struct.pack(code, value)))
                except (struct.error, OverflowError):
                    raise SchemaError(
                        f"value {value!r} does not fit field {name!r} ({f.dtype})"
                    ) from None
            else:
                raise SchemaError(
                    f"field {name!r} takes a {f.dtype} tensor of shape {f.shape}"
                    + (" or a Python number" if f.shape == () else "")
                    + f", got {type(value).__name__}"
                )
        return plan

    def write(self, slot: int, plan: list[tuple[str, Any]]) -> None:
        """Copy a checked plan in; handle fields must already be encoded to bytes."""
        views = self.views(slot).tensors
        base = self._layout.row(slot)
        for name, value in plan:
            if isinstance(value, bytes):
                off = base + self.schema.slots[name].offset
                self._mv[off : off + len(value)] = value
            else:
                views[name].copy_(value)

    def field_bytes(self, slot: int, name: str) -> bytes:
        """A copy of the field's bytes in the row (handles are decoded from these)."""
        fs = self.schema.slots[name]
        off = self._layout.row(slot) + fs.offset
        return bytes(self._mv[off : off + fs.field.nbytes])

    def checksum(self, slot: int) -> int:
        base = self._layout.row(slot)
        start, end = self._payload
        return zlib.crc32(self._mv[base + start : base + end])

    def seal(self, slot: int, generation: int) -> None:
        """Record the generation and payload checksum a row is published with."""
        _ROW_HEADER.pack_into(self._mv, self._layout.row(slot), generation, self.checksum(slot))

    def sealed(self, slot: int) -> tuple[int, int]:
        """(generation, checksum) stored in the row header."""
        gen, crc = _ROW_HEADER.unpack_from(self._mv, self._layout.row(slot))
        return gen, crc

    def close(self) -> list[str]:
        """Drop the cached views; returns 'slot N field F' for each still referenced."""
        leaked = []
        for slot, views in enumerate(self._views):
            if views is not None:
                leaked += [f"slot {slot} field {n}" for n in views.leaked(set(views.tensors))]
        self._views = [None] * self._layout.slots
        self._mv.release()
        return leaked


def _check_handle_tensor(f: Field, value: torch.Tensor) -> None:
    if not f.accepts_shape(tuple(value.shape)):
        raise SchemaError(f"field {f.name!r} has shape {f.shape}, got {tuple(value.shape)}")
    if not value.is_contiguous():
        raise SchemaError(f"field {f.name!r}: handle tensors must be contiguous")
    if value.device.type not in ("cpu", "cuda"):
        raise SchemaError(f"field {f.name!r}: tensors on {value.device} cannot be shared")


def _is_scalar_for(dtype: str, value: object) -> bool:
    if isinstance(value, bool):
        return False
    if dtype in _INT_DTYPES:
        return isinstance(value, int)
    return isinstance(value, (int, float))
