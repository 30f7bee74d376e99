"""Typed row schema: fields, their dtypes and shapes, and where they sit in a row.

The schema is stored in the segment as msgpack, so any process (and the CLI)
can decode rows knowing only the table's name.  This module does not import
torch: the CLI reads schemas with it, and must start without loading torch.
"""

from __future__ import annotations

import math
import reprlib
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from .errors import SchemaError

if TYPE_CHECKING:
    import torch

# Every dtype a field may have (the names are torch's, torch.<name>), as the struct code
# of one element: bfloat16's is its raw bits (the top half of a float32).
DTYPE_CODES: dict[str, str] = {
    "int32": "i",
    "int64": "q",
    "float32": "f",
    "float16": "e",
    "bfloat16": "H",
    "uint8": "B",
    "uint64": "Q",  # SGLang's bootstrap rooms and KV checksums
    "int8": "b",
    "int16": "h",
    "bool": "?",
}
DTYPE_SIZES: dict[str, int] = {name: struct.calcsize("<" + c) for name, c in DTYPE_CODES.items()}
# A dtype as a ref's bytes store it (csrc/refcodec.c): its place above, so that order is
# part of the table format.
DTYPE_INDEX: dict[str, int] = {name: i for i, name in enumerate(DTYPE_CODES)}

# A field's item (its bytes for one slot) is padded to a multiple of this: every slot's
# item starts on its own cache line, and a small field takes at least 64 bytes a row, as
# SGLang pads its metadata buffers for RDMA.
ITEM_ALIGN = 64
MAX_DIMS = 4
MAX_ROW_SIZE = 64 * 1024 * 1024
MAX_ELEMENTS = MAX_ROW_SIZE  # per field: 64 Mi elements
MAX_FIELDS = 64
MAX_NAME = 64
DEFAULT_REF_BUDGET = 512
MIN_REF_BUDGET = 64
MAX_REF_BUDGET = 4096


def dtype_name(dtype: object) -> str | None:
    """The name of a torch dtype (`torch.float32` -> "float32"), a string as it is, else None.

    torch is looked up in sys.modules, never imported: a caller holding a torch dtype has
    imported torch already.
    """
    if isinstance(dtype, str):
        return dtype
    torch_module = sys.modules.get("torch")
    if torch_module is not None and isinstance(dtype, torch_module.dtype):
        return str(dtype).removeprefix("torch.")
    return None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous tensor of `shape`."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


@dataclass(frozen=True, init=False)
class Field:
    """One named tensor in every row.

    kind="inline": a fixed-shape tensor stored in the row itself.
    kind="ref": a tensor that stays in the producer's memory (CUDA) or in
    the table's arena (CPU); the row stores a reference to it (its CUDA IPC or
    arena description), at most `budget` bytes. A ref field's shape may have
    one variable dimension (None).
    `dtype` is a name ("bfloat16") or a torch dtype (torch.bfloat16); it is
    kept as the name.
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    kind: str
    budget: int

    def __init__(
        self,
        name: str,
        dtype: str | torch.dtype,
        shape: tuple[int | None, ...] = (),
        kind: str = "inline",
        budget: int = DEFAULT_REF_BUDGET,
    ) -> None:
        given = dtype_name(dtype)
        for attr, value in (
            ("name", name),
            ("dtype", dtype if given is None else given),
            ("shape", shape),
            ("kind", kind),
            ("budget", budget),
        ):
            object.__setattr__(self, attr, value)
        self._check()

    def _check(self) -> None:
        if not all(isinstance(x, str) for x in (self.name, self.dtype, self.kind)):
            raise SchemaError(
                f"field name and kind must be strings, dtype a string or a torch dtype: {self!r}"
            )
        if not self.name.isidentifier():
            raise SchemaError(f"field name {self.name!r} must be a Python identifier")
        if len(self.name) > MAX_NAME:
            raise SchemaError(f"field name {self.name!r} is longer than {MAX_NAME}")
        if self.dtype not in DTYPE_SIZES:
            raise SchemaError(
                f"field {self.name!r}: dtype {self.dtype!r} not one of {sorted(DTYPE_SIZES)}"
            )
        if self.kind == "handle":  # ref fields' old name: say what it is called now
            raise SchemaError(f"field {self.name!r}: kind 'handle' is now called 'ref'")
        if self.kind not in ("inline", "ref"):
            raise SchemaError(f"field {self.name!r}: kind must be 'inline' or 'ref'")
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else None
        free = 1 if self.kind == "ref" else 0
        if (
            shape is None
            or len(shape) > MAX_DIMS
            or not all(_is_dim(d) or d is None for d in shape)
            or sum(d is None for d in shape) > free
        ):
            what = "positive ints" + (" and at most one None" if free else "")
            raise SchemaError(
                f"field {self.name!r}: shape {self.shape!r} must be up to {MAX_DIMS} {what}"
            )
        elements = math.prod(d or 1 for d in shape)
        if elements > MAX_ELEMENTS:
            raise SchemaError(
                f"field {self.name!r}: shape {self.shape!r} has {elements:,} elements; "
                f"a field has at most {MAX_ELEMENTS:,} (64 Mi)"
            )
        if self.kind == "ref" and not (
            _is_dim(self.budget) and MIN_REF_BUDGET <= self.budget <= MAX_REF_BUDGET
        ):
            raise SchemaError(
                f"field {self.name!r}: ref budget must be {MIN_REF_BUDGET}..{MAX_REF_BUDGET} bytes"
            )
        object.__setattr__(self, "shape", shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this field (imports torch: only tensor code asks for it)."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def is_ref(self) -> bool:
        return self.kind == "ref"

    @property
    def nbytes(self) -> int:
        """Bytes the field takes in the row."""
        if self.is_ref:
            return self.budget
        return math.prod(d or 1 for d in self.shape) * self.itemsize

    @property
    def item_len(self) -> int:
        """Bytes the field takes a row in its column: nbytes padded to ITEM_ALIGN."""
        return _round_up(self.nbytes, ITEM_ALIGN)

    @property
    def fixed_shape(self) -> tuple[int, ...]:
        """The shape of an inline field (no variable dimension)."""
        return tuple(d or 1 for d in self.shape)

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True)
        )


def _is_dim(d: object) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d > 0


@dataclass(frozen=True)
class FieldSlot:
    """Where a field lives: its own column, one item per slot.

    In a table of N slots the column starts `N * before` bytes into the columns region
    (layout.py), and slot i's item is at `column + item_len * i`: the addressing rule
    transfer engines use for SGLang's metadata buffers.
    """

    field: Field
    before: int  # item bytes of the fields ahead of this one (one slot's worth)
    item_len: int  # the field's bytes padded to ITEM_ALIGN: the column's stride


class RowSchema:
    """An ordered set of fields, each stored as a column of fixed-size items.

    A row is a slot's item in every column; `row_size` is its bytes over all columns.
    The row's seal (generation, checksum) is kept beside the slot's state (layout.py).
    """

    def __init__(self, fields: list[Field] | tuple[Field, ...]) -> None:
        if not fields:
            raise SchemaError("a schema needs at least one field")
        if len(fields) > MAX_FIELDS:
            raise SchemaError(f"a schema has at most {MAX_FIELDS} fields, got {len(fields)}")
        if not all(isinstance(f, Field) for f in fields):
            raise SchemaError("fields must be shmslots.Field instances")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise SchemaError(f"duplicate field names in {names}")
        self.fields = tuple(fields)
        before = 0
        slots: dict[str, FieldSlot] = {}
        for f in self.fields:
            slots[f.name] = FieldSlot(f, before, f.item_len)
            before += f.item_len
        self.row_size = before
        self.has_refs = any(f.is_ref for f in self.fields)
        if self.row_size > MAX_ROW_SIZE:
            raise SchemaError(f"row of {self.row_size} bytes exceeds the {MAX_ROW_SIZE} limit")
        self.slots = slots

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSchema) and self.fields == other.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        return f"RowSchema({list(self.fields)!r})"

    def encode(self) -> bytes:
        blob: bytes = msgpack.packb(
            {
                "v": 1,
                "fields": [[f.name, f.dtype, list(f.shape), f.kind, f.budget] for f in self.fields],
            }
        )
        return blob

    @classmethod
    def decode(cls, blob: bytes) -> RowSchema:
        """Parse a stored schema; anything malformed is a SchemaError, never a crash."""
        try:
            doc: Any = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_bin_len=0)
        except Exception as exc:
            raise SchemaError(f"schema blob is not valid msgpack: {exc}") from None
        if (
            not isinstance(doc, dict)
            or doc.get("v") != 1
            or not isinstance(doc.get("fields"), list)
        ):
            raise SchemaError("schema blob has no version-1 field list")
        if len(doc["fields"]) > MAX_FIELDS:
            raise SchemaError(f"schema lists {len(doc['fields'])} fields, at most {MAX_FIELDS}")
        fields = []
        for entry in doc["fields"]:
            if not (
                isinstance(entry, list)
                and len(entry) == 5
                and all(isinstance(x, str) for x in (entry[0], entry[1], entry[3]))
                and isinstance(entry[2], list)
                and isinstance(entry[4], int)
            ):
                raise SchemaError(
                    f"schema entry {reprlib.repr(entry)} is not [name, dtype, shape, kind, budget]"
                )
            fields.append(Field(entry[0], entry[1], tuple(entry[2]), entry[3], entry[4]))
        return cls(fields)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align
