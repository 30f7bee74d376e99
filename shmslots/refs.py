"""Ref fields: tensors that stay out of the row, kept alive until the slot moves on.

A CPU tensor is copied once into arena pages (csrc/arena.c) owned by the write
slot's (slot, generation); a CUDA tensor stays where it is and travels as a
CUDA IPC description (cuda_ipc.py).  Either way the row holds a small
msgpack ref, and the producer keeps what the ref points to — the
pages, or a reference to the CUDA tensor and its IPC share — until it sees
the slot's generation advance (release, abort or reclaim), or the ref is
overwritten before publish; then it lets go, releasing the share.  Readers
open shm refs as zero-copy views of the arena.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import torch
from torch.utils.dlpack import from_dlpack

from . import cuda_ipc
from ._core import REF_REFUSALS, Arena, arena_ref, cuda_ref, mapped
from .errors import CorruptTable, SchemaError, SlotsExhausted
from .ownership import Ownership
from .ref_codec import check_fits, decode
from .ref_codec import refusal as ref_refusal
from .rows import PLAIN, RULES, UNPINNED, Rows, refusal
from .schema import DTYPE_INDEX, Field

_IS_CUDA = REF_REFUSALS["IS_CUDA"]


@dataclass(eq=False)  # one pin is one ref: compared by identity, never by tensors
class Pin:
    """What one handed-out ref keeps alive in the producer."""

    slot: int
    generation: int
    name: str
    offset: int | None = None  # arena block
    nbytes: int = 0
    tensor: torch.Tensor | None = None  # a CUDA tensor kept referenced
    release: Callable[[], object] | None = None  # of its IPC share (runs once)


class RefStore:
    def __init__(self, own: Ownership, arena: Arena | None, mm: mmap.mmap, table: str) -> None:
        self._own = own
        self._arena = arena
        self._mm = mm
        self._pin = memoryview(mm)  # held by every tensor opened here (see _core.mapped)
        self._table = table
        self._pins: list[Pin] = []  # CUDA ones: the arena keeps its blocks' book itself
        self.ipc = cuda_ipc.IpcLedger(cuda_ipc.CudaIpc())  # every share and its one release

    # -- producer side ---------------------------------------------------------------
    def drop_mapping(self) -> None:
        """The table is closing: let go of the mapping; tensors opened here still hold it."""
        self._pin = UNPINNED

    def pin(self, slot: int, generation: int, f: Field, tensor: torch.Tensor) -> tuple[bytes, Pin]:
        """Encode `tensor` for the row of (slot, generation) and keep it alive."""
        if self.ipc.takes(tensor):
            pin = Pin(slot, generation, f.name, tensor=tensor)
            description, pin.release = self.ipc.share(pin, tensor)
            item = cuda_ref(msgpack.packb(description))
        else:
            shape = tuple(tensor.shape)
            pin = self._arena_pin(slot, generation, f, math.prod(shape) * tensor.dtype.itemsize)
            assert pin.offset is not None
            code = RULES.copy_into(self._mm, pin.offset, pin.nbytes, tensor, f.torch_dtype, f.shape)
            if code != PLAIN:  # resized by another thread since it was admitted (rows.admit)
                self._let_go(pin)
                raise SchemaError(refusal(f, tensor, code))
            item = self._arena_ref(pin, f, shape)
        return self._kept(f, pin, item), pin

    def loan(
        self, slot: int, generation: int, f: Field, shape: tuple[int, ...]
    ) -> tuple[bytes, Pin]:
        """Arena pages of (slot, generation) for a tensor of `shape` that the producer fills
        in place (no copy): its ref and its pin (`loaned` makes the tensor)."""
        pin = self._arena_pin(slot, generation, f, math.prod(shape) * f.itemsize)
        return self._kept(f, pin, self._arena_ref(pin, f, shape)), pin

    def loaned(self, pin: Pin, f: Field, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor over a loan's pages."""
        assert pin.offset is not None
        return mapped(self._pin, pin.offset, f.torch_dtype, shape)

    def _arena_ref(self, pin: Pin, f: Field, shape: tuple[int, ...]) -> bytes:
        assert pin.offset is not None  # an arena pin
        return arena_ref(DTYPE_INDEX[f.dtype], pin.offset, pin.nbytes, shape, self._table)

    def _kept(self, f: Field, pin: Pin, item: bytes) -> bytes:
        """The ref's bytes for the row, with the pin kept; over budget, let go and refused."""
        if len(item) > f.budget:
            self._let_go(pin)
            raise SchemaError(
                f"field {f.name!r}: ref of {len(item)} bytes exceeds its {f.budget}-byte budget"
            )
        if pin.offset is None:  # an arena block is in the arena's own book
            self._pins.append(pin)
        return item

    def _arena_pin(self, slot: int, generation: int, f: Field, nbytes: int) -> Pin:
        """`nbytes` of arena pages, lent to (slot, generation) in the arena's book."""
        name = f.name
        arena = self._arena
        if arena is None:
            raise SchemaError(
                f"field {name!r}: CPU tensors need an arena (create the table with arena_bytes=)"
            )
        self._own.layout.check_slot(slot)  # a handle made in Python may name any number
        whole = arena.pages * arena.page_size
        if nbytes > whole:
            raise SchemaError(
                f"field {name!r}: {nbytes} bytes exceed the whole arena ({whole} bytes)"
            )
        offset = arena.loan(nbytes, slot, generation)
        if offset is None:
            self.collect()
            offset = arena.loan(nbytes, slot, generation)
        if offset is None:
            pages, blocks = arena.usage()
            raise SlotsExhausted(
                f"arena has no {nbytes} contiguous free bytes for field {name!r}",
                {"arena_pages_used": pages, "arena_blocks": blocks, "arena_pages": arena.pages},
            )
        return Pin(slot, generation, name, offset=offset, nbytes=nbytes)

    def unpin(self, pin: Pin) -> None:
        """Let go of a pin now (a ref overwritten before publish)."""
        self._let_go(pin)
        if pin in self._pins:
            self._pins.remove(pin)

    def _let_go(self, pin: Pin) -> None:
        """An arena block goes back to the arena at once, to no warm start (it may be a loan
        still referenced, reported); a CUDA tensor's share is released."""
        if pin.offset is not None and self._arena is not None:
            self._arena.unpin(pin.offset, pin.slot, pin.generation)
        if pin.release is not None:
            pin.release()  # before the tensor goes: its block is then free at once
        pin.tensor = None

    def collect_own(self) -> int:
        """Drop this process's pins whose slot generation advanced: the arena's blocks in one
        compiled call, the CUDA tensors here; cheap, O(pins)."""
        dropped = self._arena.collect_own() if self._arena is not None else 0
        if not self._pins:
            return dropped
        keep = []
        for pin in self._pins:
            if self._own.generation(pin.slot) == pin.generation:
                keep.append(pin)
            else:
                self._let_go(pin)
        dropped += len(self._pins) - len(keep)
        self._pins = keep
        return dropped

    def collect(self) -> int:
        """collect_own, plus arena pages orphaned by any process (a dead producer's)."""
        dropped = self.collect_own()
        if self._arena is not None:
            dropped += self._arena.collect()
        return dropped

    def pinned(self) -> tuple[int, int]:
        """(refs, bytes) this process keeps alive."""
        refs, size = self._arena.pinned() if self._arena is not None else (0, 0)
        for pin in self._pins:
            if pin.tensor is not None:
                size += pin.tensor.numel() * pin.tensor.element_size()
        return refs + len(self._pins), size

    # -- reader side --------------------------------------------------------------------
    @property
    def place(self) -> tuple[int, int, str]:
        """Where this table's arena refs may point: [lo, hi) of the segment, and its name."""
        arena = self._arena
        lo = self._own.layout.arena
        return lo, lo + (arena.pages * arena.page_size if arena is not None else 0), self._table

    def open(self, rows: Rows, slot: int, generation: int, name: str) -> torch.Tensor:
        """The tensor a row's ref refers to (zero copy for the arena): what may be opened is
        the compiled rule's (csrc/refcodec.c); here CUDA refs are opened, refusals worded."""
        got = rows.open_ref(slot, name, self.place)
        if isinstance(got, torch.Tensor):
            return got
        if got != _IS_CUDA:
            raise ref_refusal(got, name)
        d = decode(rows.field_bytes(slot, name))
        check_fits(d, rows.schema.slots[name].field, name)
        if d["pid"] == os.getpid():  # opening in the producer: the local tensor
            for pin in self._pins:  # CUDA pins only: an arena block is in the arena's book
                if (pin.slot, pin.generation, pin.name) == (slot, generation, name):
                    assert pin.tensor is not None  # released only once collected
                    return alias(pin.tensor)
            # a process cannot open its own CUDA IPC handle: a ref naming this process that
            # this table did not lend (an arena row's bytes rewritten, say) is forged
            raise CorruptTable(f"CUDA ref of {name!r} names this process, which lent none")
        return alias(self.ipc.open(d))


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory under a storage of its own, which keeps `tensor` alive.

    Tensors opened from one producer allocation share one storage in this
    process (torch caches IPC mappings), and so would their use counts: each
    opened ref's leak check would count the others' views.
    """
    return from_dlpack(tensor.detach())  # dlpack refuses tensors that require grad
