"""Row memory: zero-copy field views, checked writes, checksums, leak detection.

Views are built once per slot and reused (making a view costs ~4 µs, more
than a round trip).  Each field of each slot has its own torch storage, so
the storage's use count tells exactly which field still has a view alive —
derived views (slices, `.view()`) included — when the slot is released.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ._atomic import AtomicView
from ._leases import WatchedTensors
from ._rowcodec import RowCodec, row_hash
from .errors import SchemaError
from .schema import ROW_HEADER_SIZE, Field, RowSchema

# Tensor methods are called through the class: a tensor has a __dict__, and a method set on
# one must not vouch for it.
_Tensor = torch.Tensor
# struct codes for scalar fast paths; bfloat16 has none and goes through torch.
_SCALAR_CODES = {"int32": "<i", "int64": "<q", "float32": "<f", "float16": "<e", "uint8": "<B"}
_INT_DTYPES = frozenset({"int32", "int64", "uint8"})
_ROW_HEADER = struct.Struct("<QI")


def mapped_tensor(
    buffer: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over bytes of a mapping, with a storage of its own and no base tensor.

    Its own storage, so the storage's use count tells whether a slice of it is alive;
    no base, because a base tensor would be a second way to the memory that no count sees.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:  # nothing to map (frombuffer refuses an empty span)
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    tensor: torch.Tensor = torch.empty(0, dtype=dtype).set_(
        raw.untyped_storage(), 0, shape, contiguous_strides(shape)
    )
    return tensor


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous tensor of `shape`."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


class RowRegion(Protocol):
    """Where rows lie in a buffer: a table's `Layout`, or a `RowBlock`."""

    @property
    def rows(self) -> int: ...
    @property
    def row_size(self) -> int: ...
    @property
    def slots(self) -> int: ...
    def row(self, slot: int) -> int: ...


@dataclass(frozen=True)
class RowBlock:
    """Rows packed back to back in a private buffer (a remote writer's staging cells)."""

    rows: int
    row_size: int
    slots: int

    def row(self, slot: int) -> int:
        return self.rows + slot * self.row_size


class Rows:
    """The rows of one buffer; a table's and a remote writer's are packed by the same code."""

    def __init__(
        self, mm: mmap.mmap, lay: RowRegion, schema: RowSchema, atomics: AtomicView | None = None
    ) -> None:
        self._mm = mm
        self._mv = memoryview(mm)
        self._atomics = atomics  # None for a read-only mapping: no writes
        self._layout = lay
        self.schema = schema
        self._offsets = {name: fs.offset for name, fs in schema.slots.items()}
        self._nbytes = {name: fs.field.nbytes for name, fs in schema.slots.items()}
        # name -> (field, torch dtype, packer for a Python number or None, is a handle):
        # built once, since property lookups per field and write add up on the hot path
        self._specs = {name: _spec(fs.field) for name, fs in schema.slots.items()}
        self._views: list[WatchedTensors | None] = [None] * lay.slots
        self._payload = (ROW_HEADER_SIZE, schema.row_size)
        # Compiled plain-case writes and the checksum; None on a read-only mapping.
        self._codec = (
            RowCodec(mm, lay.rows, lay.row_size, lay.slots, ROW_HEADER_SIZE, _codec_specs(schema),
                     torch.Tensor, torch._C._is_torch_function_mode_enabled, torch.UntypedStorage)
            if atomics is not None
            else None
        )  # fmt: skip

    def views(self, slot: int) -> WatchedTensors:
        cached = self._views[slot]
        if cached is None:
            base = self._layout.row(slot)
            cached = self._views[slot] = WatchedTensors(
                {
                    name: mapped_tensor(
                        self._mm, base + fs.offset, fs.field.torch_dtype, fs.field.fixed_shape
                    )
                    for name, fs in self.schema.slots.items()
                    if not fs.field.is_handle
                }
            )
        return cached

    def forget_views(self, slot: int) -> None:
        """Make the slot's views afresh next time: one was kept past its lease, or moved."""
        self._views[slot] = None

    def prepare(self, values: dict[str, Any]) -> list[tuple[str, Any]]:
        """Check every value against the schema before any byte is written."""
        plan: list[tuple[str, Any]] = []
        specs = self._specs
        for name, value in values.items():
            spec = specs.get(name)
            if spec is None:
                raise SchemaError(f"no field {name!r}; fields are {list(self.schema.slots)}")
            f, dtype, scalar, is_handle = spec
            if isinstance(value, torch.Tensor):
                if value.dtype is not dtype:
                    raise SchemaError(f"field {name!r} is {f.dtype}, got a {value.dtype} tensor")
                if is_handle:
                    _check_handle_tensor(f, value)
                elif value.shape != f.shape:
                    raise SchemaError(
                        f"field {name!r} has shape {f.shape}, got {tuple(value.shape)}"
                    )
                if not _storage_holds(value):  # torch itself would read unmapped memory
                    raise SchemaError(
                        f"field {name!r}: the tensor's storage no longer holds its elements "
                        "(freed or resized)"
                    )
                plan.append((name, value))
            elif scalar is not None and _is_scalar_for(f.dtype, value):
                try:
                    plan.append((name, scalar(value)))
                except (struct.error, OverflowError, RuntimeError):
                    raise SchemaError(
                        f"value {value!r} does not fit field {name!r} ({f.dtype})"
                    ) from None
            else:
                raise SchemaError(
                    f"field {name!r} takes {'an' if f.dtype[0] == 'i' else 'a'} {f.dtype} "
                    f"tensor of shape {f.shape}"
                    + (" or a Python number" if scalar is not None else "")
                    + f", got {type(value).__name__}"
                )
        return plan

    def write_plain(self, slot: int, values: dict[str, Any]) -> bool:
        """Write values in one compiled call if all are the plain case (see _rowcodec.c);
        False, with nothing written, sends the caller to prepare() and write()."""
        return self._codec is not None and self._codec.write(slot, values)

    def write(self, slot: int, plan: list[tuple[str, Any]]) -> None:
        """Copy a checked plan in; handle fields must already be encoded to bytes."""
        base = self._layout.rows + slot * self._layout.row_size
        offsets = self._offsets
        copy_in = self._atomics.copy_in if self._atomics is not None else None
        for name, value in plan:
            off = base + offsets[name]
            if type(value) is bytes:
                self._mv[off : off + len(value)] = value
            elif (
                copy_in is not None
                and value.is_cpu
                and _Tensor.is_contiguous(value)  # the class's methods: not ones set on value
                and not _Tensor.is_neg(value)
                and (data := _Tensor.data_ptr(value))
                and value.nbytes == self._nbytes[name]  # as checked, unless resized since
            ):
                copy_in(off, data, value.nbytes)  # a memcpy, no torch dispatch
            else:
                self.views(slot).tensors[name].copy_(value)

    def fill(self, slot: int, packed: memoryview) -> None:
        """Copy a whole row packed elsewhere (header included) over this slot's row."""
        base = self._layout.row(slot)
        self._mv[base : base + self._layout.row_size] = packed

    def field_bytes(self, slot: int, name: str) -> bytes:
        """A copy of the field's bytes in the row (handles are decoded from these)."""
        fs = self.schema.slots[name]
        off = self._layout.row(slot) + fs.offset
        return bytes(self._mv[off : off + fs.field.nbytes])

    def checksum(self, slot: int) -> int:
        if self._codec is not None:
            return self._codec.checksum(slot)
        base = self._layout.row(slot)
        start, end = self._payload
        return row_hash(self._mv[base + start : base + end])

    def seal(self, slot: int, generation: int) -> None:
        """Record the generation and payload checksum a row is published with."""
        if self._codec is None:
            raise ValueError("rows of a read-only mapping cannot be sealed")
        self._codec.seal(slot, generation)

    def sealed(self, slot: int) -> tuple[int, int]:
        """(generation, checksum) stored in the row header."""
        gen, crc = _ROW_HEADER.unpack_from(self._mv, self._layout.row(slot))
        return gen, crc

    def close(self) -> list[str]:
        """Drop the cached views; returns 'slot N field F' for each still referenced."""
        leaked = []
        for slot, views in enumerate(self._views):
            if views is not None:
                leaked += [f"slot {slot} field {n}" for n in views.leaked(views.tensors)]
        self._views = [None] * self._layout.slots
        if self._codec is not None:
            self._codec.release()
        self._mv.release()
        return leaked


_CODEC_SCALARS = {"int64": 1, "int32": 2, "uint8": 3, "float32": 4}  # enum scalar in the C file
_CODEC_HANDLE = 5
_CODEC_ITEMS = {**_CODEC_SCALARS, "float16": 6, "bfloat16": 7}  # read as a number only


def _codec_specs(
    schema: RowSchema,
) -> tuple[tuple[str, int, int, int, int, torch.dtype, tuple[int, ...]], ...]:
    """(name, offset, nbytes, write kind, read kind, dtype, shape) per field, for RowCodec.

    Only shape () is written from a Python number; any field of one element reads as one.
    """
    specs = []
    for name, fs in schema.slots.items():
        f = fs.field
        if f.is_handle:
            kind = item = _CODEC_HANDLE
        else:
            kind = _CODEC_SCALARS.get(f.dtype, 0) if f.shape == () else 0
            item = _CODEC_ITEMS.get(f.dtype, 0) if math.prod(f.fixed_shape) == 1 else 0
        specs.append((name, fs.offset, f.nbytes, kind, item, f.torch_dtype, f.fixed_shape))
    return tuple(specs)


def _spec(f: Field) -> tuple[Field, torch.dtype, Callable[[Any], Any] | None, bool]:
    scalar: Callable[[Any], Any] | None = None
    if f.shape == () and not f.is_handle:
        code = _SCALAR_CODES.get(f.dtype)
        if code is not None:
            scalar = struct.Struct(code).pack
        else:  # bfloat16 has no struct code

            def scalar(value: Any, dtype: torch.dtype = f.torch_dtype) -> Any:
                return torch.tensor(value, dtype=dtype)

    return f, f.torch_dtype, scalar, f.is_handle


def _storage_holds(value: torch.Tensor) -> bool:
    """Whether every element lies inside the tensor's storage (false once it is freed)."""
    if _Tensor.numel(value) == 0 or value.is_meta:
        return True
    strides = _Tensor.stride(value)
    span = 1 + sum((n - 1) * st for n, st in zip(value.shape, strides, strict=True))
    end = (_Tensor.storage_offset(value) + span) * _Tensor.element_size(value)
    return end <= _Tensor.untyped_storage(value).nbytes()


def check_out(what: str, f: Field, out: object, shape: tuple[int, ...]) -> None:
    """Why `out` cannot take `shape` of the field's values (SchemaError), if it cannot.

    These are the checks RowCodec.gather makes before it copies a byte, in words.
    """
    if not isinstance(out, torch.Tensor):
        raise SchemaError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != f.torch_dtype:
        raise SchemaError(f"{what}: out is {out.dtype}, field {f.name!r} is {f.dtype}")
    if tuple(out.shape) != shape:
        raise SchemaError(f"{what}: out has shape {tuple(out.shape)}, needs {shape}")
    if out.device.type != "cpu":
        raise SchemaError(f"{what}: out must be a CPU tensor, got one on {out.device}")
    if not _Tensor.is_contiguous(out) or _Tensor.is_neg(out):
        raise SchemaError(f"{what}: out must be contiguous (and not a lazily negated view)")
    if not _storage_holds(out):
        raise SchemaError(f"{what}: out's storage no longer holds its elements (freed or resized)")


def _check_handle_tensor(f: Field, value: torch.Tensor) -> None:
    if not f.accepts_shape(tuple(value.shape)):
        raise SchemaError(f"field {f.name!r} has shape {f.shape}, got {tuple(value.shape)}")
    if not _Tensor.is_contiguous(value):
        raise SchemaError(f"field {f.name!r}: handle tensors must be contiguous")
    if value.device.type not in ("cpu", "cuda"):
        raise SchemaError(f"field {f.name!r}: tensors on {value.device} cannot be shared")


def _is_scalar_for(dtype: str, value: object) -> bool:
    if isinstance(value, bool):
        return False
    if dtype in _INT_DTYPES:
        return isinstance(value, int)
    return isinstance(value, (int, float))
