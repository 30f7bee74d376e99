"""Row memory: zero-copy field views, checked writes, checksums, leak detection.

Views are built once per slot and reused (making a view costs ~4 µs, more
than a round trip).  Each field of each slot has its own torch storage, so
the storage's use count tells exactly which field still has a view alive —
derived views (slices, `.view()`) included — when the slot is released.
"""

from __future__ import annotations

import math
import mmap
import reprlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ._core import (
    NUMBER_WRITES,
    REASONS,
    SCALARS,
    AtomicView,
    RowCodec,
    Rules,
    WatchedTensors,
    mapped,
    row_hash,
)
from .errors import SchemaError
from .layout import SEAL, SEAL_ENTRY
from .schema import DTYPE_CODES, DTYPE_INDEX, Field, RowSchema
from .segment import address_of

# The checks on a tensor before its bytes are copied into shared memory, in one place
# (csrc/rowcodec.c): every path asks them, the compiled write included; this file words them.
RULES = Rules(torch.Tensor)
# Reason codes of RULES.check, as csrc/rowcodec.c exports them.  0: the bytes may be copied as
# they are.  Positive, bits: acceptable once torch has made a plain copy (also NEGATED,
# SUBCLASS).  Negative: refused.
PLAIN = REASONS["PLAIN"]
_STRIDED, _ON_GPU = REASONS["STRIDED"], REASONS["ON_GPU"]
_NOT_TENSOR, _DTYPE, _SHAPE = REASONS["NOT_TENSOR"], REASONS["DTYPE"], REASONS["SHAPE"]
_DEVICE, _NO_STORAGE = REASONS["DEVICE"], REASONS["NO_STORAGE"]
_SHORT_STORAGE, _TOO_BIG = REASONS["SHORT_STORAGE"], REASONS["TOO_BIG"]
# struct codes for scalar fast paths; bfloat16's code is raw bits, so it goes through torch.
_SCALAR_CODES = {name: "<" + c for name, c in DTYPE_CODES.items() if name != "bfloat16"}
_INT_DTYPES = frozenset(name for name in DTYPE_CODES if name.startswith(("int", "uint")))


UNPINNED = memoryview(b"")  # what a closed pin is replaced by


class RowRegion(Protocol):
    """Where a buffer's columns and seals lie: a table's `Layout`, or a `ColumnBlock`."""

    @property
    def slots(self) -> int: ...
    @property
    def seals(self) -> int: ...
    def column(self, before: int) -> int: ...
    def seal(self, slot: int) -> int: ...


@dataclass(frozen=True)
class ColumnBlock:
    """Columns and seals of `slots` rows in a private buffer (a remote writer's staging)."""

    slots: int
    row_size: int

    @property
    def seals(self) -> int:
        return self.slots * self.row_size

    def column(self, before: int) -> int:
        return self.slots * before

    def seal(self, slot: int) -> int:
        return self.seals + slot * SEAL_ENTRY

    @property
    def size(self) -> int:
        return self.seals + self.slots * SEAL_ENTRY


class Rows:
    """The rows of one buffer, one column per field; a table's and a remote writer's are
    packed by the same code."""

    def __init__(
        self, mm: mmap.mmap, lay: RowRegion, schema: RowSchema, atomics: AtomicView | None = None
    ) -> None:
        self._mm = mm
        self._mv = memoryview(mm)
        self._pin = memoryview(mm)  # held by every view made here (see _core.mapped)
        self._layout = lay
        self.schema = schema
        # name -> (column, item_len): slot i's item of the field is at column + item_len * i
        self._items = {
            name: (lay.column(fs.before), fs.item_len) for name, fs in schema.slots.items()
        }
        # name -> (field, packer for a Python number or None): built once, since property
        # lookups per field and write add up on the hot path
        self._specs = {name: _spec(fs.field) for name, fs in schema.slots.items()}
        self._views: list[WatchedTensors | None] = [None] * lay.slots
        # Compiled plain-case writes and the checksum; None on a read-only mapping (no
        # atomics: a mapping nobody writes through).
        self._codec = (
            RowCodec(mm, lay.seals, lay.slots, _codec_specs(schema, self._items), RULES)
            if atomics is not None
            else None
        )

    def item(self, slot: int, name: str) -> int:
        """Where field `name` of `slot` starts in the buffer."""
        column, item_len = self._items[name]
        return column + item_len * slot

    def zero_mask(self, names: tuple[str, ...]) -> int:
        """The fields `names` as the compiled core zeroes them (bit i: field i): inline
        fields only, since a ref field's zeroed item would name no block."""
        fields = list(self.schema.slots)
        mask = 0
        for name in names:
            fs = self.schema.slots.get(name) if type(name) is str else None
            if fs is None or fs.field.is_ref:
                raise SchemaError(f"{name!r} is not an inline field of this table, to be zeroed")
            mask |= 1 << fields.index(name)
        return mask

    def buffer_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(ptrs, data_lens, item_lens) of every column in this process, in field order:
        what SGLang's MetadataBuffers.get_buf_infos() gives a transfer engine."""
        address, slots = address_of(self._mm), self._layout.slots
        ptrs, data_lens, item_lens = [], [], []
        for column, item_len in self._items.values():
            ptrs.append(address + column)
            data_lens.append(item_len * slots)
            item_lens.append(item_len)
        return ptrs, data_lens, item_lens

    def views(self, slot: int) -> WatchedTensors:
        cached = self._views[slot]
        if cached is None:
            cached = self._views[slot] = WatchedTensors(
                {
                    name: mapped(
                        self._pin, self.item(slot, name), fs.field.torch_dtype, fs.field.fixed_shape
                    )
                    for name, fs in self.schema.slots.items()
                    if not fs.field.is_ref
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
            f, scalar = spec
            if scalar is not None and _is_scalar_for(f.dtype, value):
                try:
                    plan.append((name, scalar(value)))
                except (struct.error, OverflowError, RuntimeError):
                    raise SchemaError(
                        f"value {value!r} does not fit field {name!r} ({f.dtype})"
                    ) from None
            else:
                plan.append((name, admit(f, value)))
        return plan

    def write_plain(self, slot: int, values: dict[str, Any]) -> bool:
        """Write values in one compiled call if all are the plain case (see csrc/rowcodec.c);
        False, with nothing written, sends the caller to prepare() and write()."""
        return self._codec is not None and self._codec.write(slot, values)

    def write(self, slot: int, plan: list[tuple[str, Any]]) -> None:
        """Copy a checked plan in; ref fields must already be encoded to bytes."""
        for name, value in plan:
            off = self.item(slot, name)
            if type(value) is bytes:
                self._mv[off : off + len(value)] = value
            else:  # admitted by prepare(); asked again, since another thread may resize it
                f = self._specs[name][0]
                code = RULES.copy_into(self._mm, off, f.nbytes, value, f.torch_dtype, f.shape)
                if code != PLAIN:
                    raise SchemaError(refusal(f, value, code))

    def open_ref(self, slot: int, name: str, place: tuple[int, int, str]) -> torch.Tensor | int:
        """Ref field `name` of `slot` as a tensor over the arena at `place` (RefStore.place),
        or why not (a REF_REFUSALS code: IS_CUDA for a CUDA ref)."""
        codec = self._codec
        assert codec is not None  # refs are opened through a table's own rows
        got = codec.open_ref(slot, name, *place)
        assert got is not None, f"{name!r} is not a ref field"
        return got

    def field_bytes(self, slot: int, name: str) -> bytes:
        """A copy of the field's bytes in the row (refs are decoded from these)."""
        off = self.item(slot, name)
        return bytes(self._mv[off : off + self.schema.slots[name].field.nbytes])

    def checksum(self, slot: int) -> int:
        # No comprehension in this function: one would make `self` and `slot` closure
        # cells, built on every call (Python 3.11: ~35 ns, half of what a verify pays here).
        codec = self._codec
        if codec is not None:
            return codec.checksum(slot)
        return self._checksum_from_items(slot)

    def _checksum_from_items(self, slot: int) -> int:
        """checksum() on a read-only mapping (no codec): row_hash over the slot's items."""
        items = []
        for name, fs in self.schema.slots.items():
            at = self.item(slot, name)
            items.append(self._mv[at : at + fs.field.nbytes])
        return row_hash(items)

    def seal(self, slot: int, generation: int) -> None:
        """Record the generation and checksum a row is published with."""
        if self._codec is None:
            raise ValueError("rows of a read-only mapping cannot be sealed")
        self._codec.seal(slot, generation)

    def sealed(self, slot: int) -> tuple[int, int]:
        """(generation, checksum) stored in the row's seal."""
        gen, crc = SEAL.unpack_from(self._mv, self._layout.seal(slot))
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
        self._pin = UNPINNED  # dropped, not released: views still alive keep the mapping
        return leaked


# how RowCodec reads a field of one element as a number, and writes one of shape () from
# one (the rest it reads only), as csrc/rowcodec.c exports them
_CODEC_ITEMS = {name: kind for name, kind in SCALARS.items() if name != "ref"}
_CODEC_SCALARS = {name: _CODEC_ITEMS[name] for name in NUMBER_WRITES}
_CODEC_REF = SCALARS["ref"]


def _codec_specs(
    schema: RowSchema, items: dict[str, tuple[int, int]]
) -> tuple[tuple[str, int, int, int, int, int, torch.dtype, int, tuple[int | None, ...]], ...]:
    """(name, column, item_len, nbytes, write kind, read kind, dtype, its index as refs store
    it, shape) per field, for RowCodec (a ref field's shape as declared, None where free).

    Only shape () is written from a Python number; any field of one element reads as one.
    """
    specs = []
    for name, fs in schema.slots.items():
        f = fs.field
        if f.is_ref:
            kind = item = _CODEC_REF
        else:
            kind = _CODEC_SCALARS.get(f.dtype, 0) if f.shape == () else 0
            item = _CODEC_ITEMS.get(f.dtype, 0) if math.prod(f.fixed_shape) == 1 else 0
        column, item_len = items[name]
        specs.append(
            (
                name, column, item_len, f.nbytes, kind, item, f.torch_dtype,
                DTYPE_INDEX[f.dtype], f.shape if f.is_ref else f.fixed_shape,
            )
        )  # fmt: skip
    return tuple(specs)


def _spec(f: Field) -> tuple[Field, Callable[[Any], Any] | None]:
    return f, _packer(f) if f.shape == () and not f.is_ref else None


def _packer(f: Field) -> Callable[[Any], Any]:
    """How one Python number becomes an element of field `f`, refusing one that does not
    fit (struct.error, OverflowError or RuntimeError): struct packing, or torch for
    bfloat16, which has no struct code."""
    code = _SCALAR_CODES.get(f.dtype)
    if code is not None:
        return struct.Struct(code).pack

    def to_bfloat16(value: Any, dtype: torch.dtype = f.torch_dtype) -> Any:
        return torch.tensor(value, dtype=dtype)

    return to_bfloat16


def admit(f: Field, value: Any) -> torch.Tensor:
    """The tensor whose bytes go into field `f` for `value`: the value itself, or the plain
    copy torch makes of it (strided, negated, a subclass, an inline field's CUDA tensor).

    Whether it passes is RULES.check's to say; a refusal raises SchemaError.  A ref field's
    CUDA tensor stays on its GPU, and a ref field's tensor must be contiguous.
    """
    keep = _ON_GPU if f.is_ref else PLAIN
    code = RULES.check(value, f.torch_dtype, f.shape)
    if code < 0 or (f.is_ref and code & _STRIDED):
        raise SchemaError(refusal(f, value, code))
    if code & ~keep:
        value = _plain_copy(f, value, f.shape, keep)
    tensor: torch.Tensor = value
    return tensor


def _plain_copy(
    f: Field, value: torch.Tensor, shape: tuple[int | None, ...], keep: int, what: str = ""
) -> torch.Tensor:
    """The plain copy torch makes of `value`, which RULES admitted with codes beyond `keep`
    (_ON_GPU: a ref field's CUDA tensor stays on its GPU), checked again; with no autograd, and
    neither a subclass nor a mode answering in place of the tensor."""
    try:
        with torch.no_grad(), torch._C.DisableTorchFunction():
            plain = torch.empty(
                tuple(value.shape), dtype=value.dtype, device=value.device if keep else "cpu"
            )
            plain.copy_(value)
    except Exception as exc:  # a subclass with no data to give (a fake tensor), or refusing
        raise SchemaError(
            f"{what}field {f.name!r}: torch could not copy the {type(value).__name__} it was "
            f"given ({exc})"
        ) from exc
    code = RULES.check(plain, f.torch_dtype, shape)
    if code & ~keep:
        raise SchemaError(what + refusal(f, value, code))
    return plain


def admit_batch(f: Field, values: object, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """A plain CPU tensor of `shape` (n, *field shape) for `values`, a batch of field `f`:
    a tensor of the field's dtype, or (nested) lists of the Python numbers write() takes
    for one element of it, each checked to fit as write() checks it.

    Everything is checked before torch touches the values (a tensor whose storage no longer
    holds its elements must never be copied: torch would read past it), and the copy is
    admit()'s.
    """
    want = f"{what}: field {f.name!r} takes {_a_tensor_of(f)} shape {shape}"
    if isinstance(values, (list, tuple)):
        values = _numbers(f, values, shape, want)
    elif not isinstance(values, torch.Tensor):
        raise SchemaError(f"{want}, or a list of numbers; got {reprlib.repr(values)}")
    code = RULES.check(values, f.torch_dtype, shape)
    if code in (_DTYPE, _SHAPE):
        with torch._C.DisableTorchFunction():  # the tensor's own dtype and shape
            got = f"a {values.dtype} tensor of shape {tuple(values.shape)}"
        raise SchemaError(f"{want}, got {got}")
    if code < 0:
        raise SchemaError(f"{what}: {refusal(f, values, code)}")
    return values if code == PLAIN else _plain_copy(f, values, shape, PLAIN, f"{what}: ")


def _numbers(
    f: Field, values: list[Any] | tuple[Any, ...], shape: tuple[int, ...], want: str
) -> torch.Tensor:
    """The tensor of (nested) lists of numbers, each one of a kind write() takes for the
    field's dtype and fitting it as write() checks (its `_packer`)."""
    pack = _packer(f)
    level: list[Any] = [values]
    for depth in range(len(shape) + 1):
        below: list[Any] = []
        for x in level:
            if depth < len(shape):
                if not isinstance(x, (list, tuple)) or len(x) != shape[depth]:
                    raise SchemaError(f"{want}, got lists of another shape")
                below.extend(x)
            elif not _is_scalar_for(f.dtype, x):
                raise SchemaError(f"{want}, or numbers for it; got {type(x).__name__} {x!r}")
            else:
                try:
                    pack(x)
                except (struct.error, OverflowError, RuntimeError):
                    raise SchemaError(f"{want}; {x!r} does not fit {f.dtype}") from None
        level = below
    return torch.tensor(values, dtype=f.torch_dtype).reshape(shape)  # (0, ...) included


def _a_tensor_of(f: Field) -> str:
    """'an int64 tensor of', 'a float32 tensor of': how refusals name what a field takes."""
    return f"{'an' if f.dtype.startswith('int') else 'a'} {f.dtype} tensor of"


def refusal(f: Field, value: Any, code: int) -> str:
    """Why RULES refused `value` for field `f` (a reason code other than PLAIN)."""
    with torch._C.DisableTorchFunction():  # the tensor's own dtype, shape, device
        return _refusal(f, value, code)


def _refusal(f: Field, value: Any, code: int) -> str:
    name = f.name
    if code == _NOT_TENSOR:
        number = ""
        if f.shape == () and not f.is_ref:
            number = " or a Python bool" if f.dtype == "bool" else " or a Python number"
        return (
            f"field {name!r} takes {_a_tensor_of(f)} shape {f.shape}{number}, "
            f"got {type(value).__name__}"
        )
    if code == _DTYPE:
        return f"field {name!r} is {f.dtype}, got a {value.dtype} tensor"
    if code == _SHAPE:
        return f"field {name!r} has shape {f.shape}, got {tuple(value.shape)}"
    if code == _DEVICE:
        return f"field {name!r}: tensors on {value.device} cannot be shared"
    if code == _NO_STORAGE:
        return f"field {name!r}: the tensor has no storage to copy from (sparse, nested, ...)"
    if code == _SHORT_STORAGE:  # torch itself would read past it
        return (
            f"field {name!r}: the tensor's storage no longer holds its elements (freed or resized)"
        )
    if code == _TOO_BIG:
        return f"field {name!r}: a tensor of shape {tuple(value.shape)} has too many bytes"
    if f.is_ref and code & _STRIDED:
        return f"field {name!r}: ref fields' tensors must be contiguous"
    return f"field {name!r}: torch made no plain copy of the tensor (a dispatch mode?)"


def check_out(what: str, f: Field, out: object, shape: tuple[int, ...]) -> None:
    """Why `out` cannot take `shape` of the field's values (SchemaError), if it cannot.

    The rules are RULES', which every copy into or out of a row follows (RowCodec.gather
    asks them before it copies a byte); this only words their answer for an out tensor.
    """
    code = RULES.check(out, f.torch_dtype, shape)
    if code == PLAIN:
        return
    if not isinstance(out, torch.Tensor):
        raise SchemaError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    with torch._C.DisableTorchFunction():  # the tensor's own dtype, shape, device
        if code == _DTYPE:
            why = f"out is {out.dtype}, field {f.name!r} is {f.dtype}"
        elif code == _SHAPE:
            why = f"out has shape {tuple(out.shape)}, needs {shape}"
        elif code in (_NO_STORAGE, _SHORT_STORAGE):
            why = "out's storage no longer holds its elements (freed or resized)"
        elif code == _DEVICE or (code > 0 and code & _ON_GPU):
            why = f"out must be a CPU tensor, got one on {out.device}"
        elif code == _TOO_BIG:
            why = f"out of shape {shape} has too many bytes"
        else:
            why = (
                "out must be a plain, contiguous torch.Tensor of its own storage (not lazily "
                "negated or cloned, no subclass)"
            )
    raise SchemaError(f"{what}: {why}")


def _is_scalar_for(dtype: str, value: object) -> bool:
    if dtype == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if dtype in _INT_DTYPES:
        return isinstance(value, int)
    return isinstance(value, (int, float))
