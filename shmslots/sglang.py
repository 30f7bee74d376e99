"""SGLang's disaggregation metadata buffers, backed by one shmslots table.

Follows SGLang 0.5.23, `sglang/srt/disaggregation/utils.py`: `MetadataBuffers` (its fields,
their order, dtypes and item lengths; `get_buf_infos`, `get_buf`, `set_buf`, `clear_slot`,
`bootstrap_room`) and `ReqToMetadataIdxAllocator` (`alloc`, `free`, `available_size`).  It
imports nothing of SGLang.  The buffers are a table in the column layout, so the transfer
engines write `ptrs[i] + item_lens[i] * index` into it exactly as into SGLang's own tensors.

What changes is who may reuse an index, and when.  SGLang frees an index right after the
transfer is committed (`pop_transferred`), while the request keeps the draft state it read
from the row until `process_prebuilt` consumes it; a later transfer into the reused index
corrupts it.  Here the index is a slot the request owns:

- `alloc()` reserves a slot; `get_buf(idx)` commits the transfer in place (sealed, no copy)
  and returns zero-copy views of the row, held by a lease;
- `free(idx)` after commit does not hand the slot back (the request still owns it; counted
  in `deferred_frees`); before commit it aborts the reservation;
- the slot goes back when the draft state has been consumed — `release(idx)`, or
  `release_consumed(reqs)` after `process_prebuilt`, the one call SGLang lacks — or when the
  request is aborted (`abort(idx)`, `abort_request(req)`), at once if it was committed;
- an aborted reservation may still receive a late write from a slow engine: it is kept in a
  `Quarantine` for `late_write_window_s` (as SGLang's deferred release waits for the prefill
  side) so the late bytes never land in a reused slot's row.

A double free, a release of an index that is not allocated, or an index out of range raises
instead of corrupting the free list.  One decode scheduler (one thread) drives an allocator.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import (
    IncompatibleTable,
    InvalidSlot,
    OwnershipError,
    SchemaError,
    SlotsExhausted,
    TableClosed,
)
from .leases import Lease, Reservation
from .quarantine import Quarantine
from .schema import ITEM_ALIGN, Field
from .table import SlotTable

SGLANG_VERSION = "0.5.23"
ROOM = "bootstrap_room"
_names = itertools.count()


def metadata_fields(
    hidden_size: int,
    hidden_states_dtype: torch.dtype | str,
    max_top_logprobs_num: int = 128,
    *,
    kv_checksum: bool = False,
) -> tuple[Field, ...]:
    """SGLang's metadata fields, in get_buf_infos() order: one per buffer, shape per slot."""
    fields = [
        Field("output_ids", "int32", (16,)),  # [0]: the first output token
        Field("cached_tokens", "int32", (16,)),  # [0..6]: cached, device, host, storage, mm
        Field("output_token_logprobs_val", "float32", (16,)),
        Field("output_token_logprobs_idx", "int32", (16,)),
        Field("output_top_logprobs_val", "float32", (max_top_logprobs_num,)),
        Field("output_top_logprobs_idx", "int32", (max_top_logprobs_num,)),
        Field("output_topk_p", "float32", (16,)),
        Field("output_topk_index", "int64", (16,)),
        Field("output_hidden_states", hidden_states_dtype, (hidden_size,)),
        Field(ROOM, "uint64", (8,)),
    ]
    if kv_checksum:
        fields.append(Field("kv_checksum", "uint64", (8,)))
    for f in fields:  # an engine copies the prefill side's item length: ours must be equal
        if f.nbytes % ITEM_ALIGN:
            raise SchemaError(
                f"{f.name}: {f.nbytes} bytes a row is not a multiple of {ITEM_ALIGN}; SGLang's "
                "transfer engines need equal item lengths on both sides"
            )
    return tuple(fields)


class _Req(Protocol):
    """What the request-level calls read of an SGLang `Req`."""

    metadata_buffer_index: int


class _RoomColumn:
    """`bootstrap_room` as SGLang's gate reads it (`bootstrap_room[idx, 0]`), by copy: a
    0-d uint64 tensor for `[idx, j]`, an (8,) one for `[idx]`.  Nothing of it points into the
    mapping, so it stays safe to hold after the buffers close."""

    def __init__(self, buffers: MetadataBuffers) -> None:
        self._buffers = buffers

    def __getitem__(self, key: int | tuple[int, int]) -> torch.Tensor:
        idx, j = key if isinstance(key, tuple) else (key, None)
        buffers = self._buffers
        buffers._check_index(idx)
        address, _ = buffers._item(idx, ROOM)
        if j is not None and not (type(j) is int and 0 <= j < 8):
            raise InvalidSlot(f"bootstrap_room has 8 words a row, not {j!r}")
        raw = ctypes.string_at(address, 64)
        words = torch.tensor(struct.unpack("<8Q", raw), dtype=torch.uint64)
        return words if j is None else words[j].clone()

    def __repr__(self) -> str:
        return f"<bootstrap_room of {self._buffers.size} slots>"


def _exact(f: Field, value: Any) -> torch.Tensor:
    """`value`'s leading elements for field `f`, converted exactly, or SchemaError."""
    try:
        if isinstance(value, torch.Tensor):
            src = value.detach().to("cpu").reshape(-1)
            converted = src.to(f.torch_dtype)
            exact = converted.to(src.dtype).equal(src)
        else:
            items = [value] if isinstance(value, (int, float, bool)) else list(value)
            converted = torch.tensor(items, dtype=f.torch_dtype)
            exact = converted.tolist() == items
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise SchemaError(f"{f.name}: {value!r} is not {f.dtype} values ({exc})") from None
    if not exact:
        raise SchemaError(f"{f.name}: {value!r} does not convert exactly to {f.dtype}")
    if converted.numel() > f.fixed_shape[0]:
        raise SchemaError(f"{f.name}: {converted.numel()} values for {f.fixed_shape[0]}")
    return converted.contiguous()


class MetadataBuffers:
    """SGLang's `MetadataBuffers`, one slot per index, in a shmslots table.

    The decode side makes it (`MetadataBuffers(size, hidden_size, dtype)`, which creates the
    table, named `table_name` or uniquely); a prefill side on the same machine attaches to it
    by name (`MetadataBuffers.attach(name)`) and fills slots with `set_buf(req)`, by address.
    """

    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: torch.dtype | str,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: object | None = None,
        *,
        kv_checksum: bool = False,
        table_name: str | None = None,
    ) -> None:
        if custom_mem_pool is not None:
            raise SchemaError("custom_mem_pool: shmslots buffers live in shared CPU memory")
        fields = metadata_fields(
            hidden_size, hidden_states_dtype, max_top_logprobs_num, kv_checksum=kv_checksum
        )
        name = table_name or f"sglang-metadata-{os.getpid()}-{next(_names)}"
        # a dead decode side's rows are dropped: no other reader would ever take them
        self._bind(SlotTable.create(name, fields, slots=size, on_consumer_death="drop"))

    def _bind(self, table: SlotTable) -> None:
        self.table = table
        self._allocator: ReqToMetadataIdxAllocator | None = None  # the decode side's
        self._names = list(table.schema.slots)
        self._infos = table.buffer_infos()
        ptrs, _, item_lens = self._infos
        # name -> (this process's address of its slot-0 item, item length)
        self._columns = dict(zip(self._names, zip(ptrs, item_lens, strict=True), strict=True))
        self.bootstrap_room = _RoomColumn(self)

    @classmethod
    def attach(cls, name: str, role: str = "prefill") -> MetadataBuffers:
        """The buffers of the table `name`, for a prefill side on the same machine.  A table
        that is not a MetadataBuffers' (other fields, or rows redelivered on a consumer's
        death) is refused."""
        table = SlotTable.attach(name, role)
        try:
            fields = table.schema.slots
            hidden = fields.get("output_hidden_states")
            top = fields.get("output_top_logprobs_val")
            want = (
                metadata_fields(
                    hidden.field.fixed_shape[0],
                    hidden.field.dtype,
                    top.field.fixed_shape[0],
                    kv_checksum="kv_checksum" in fields,
                )
                if hidden is not None and top is not None
                else None
            )
            if want != table.schema.fields or not table.drop_on_consumer_death:
                raise IncompatibleTable(f"table {name!r} is not SGLang metadata buffers")
            buffers = cls.__new__(cls)
            buffers._bind(table)
            return buffers
        except BaseException:
            table.close()
            raise

    @property
    def size(self) -> int:
        return self.table.slots

    def __enter__(self) -> MetadataBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(ptrs, data_lens, item_lens) in field order, as SGLang's."""
        self._check_open()
        ptrs, data_lens, item_lens = self._infos
        return list(ptrs), list(data_lens), list(item_lens)

    def set_buf(self, req: Any) -> None:
        """Fill slot `req.metadata_buffer_index` from an SGLang request, by address, as the
        prefill side does (only what the request has; the rest is left as it was)."""
        values: dict[str, Any] = {"output_ids": [req.output_ids[0]]}
        values["cached_tokens"] = [
            getattr(req, attr, 0) or 0
            for attr in (
                "cached_tokens",
                "cached_tokens_device",
                "cached_tokens_host",
                "cached_tokens_storage",
            )
        ]
        if getattr(req, "return_logprob", False):
            for name in ("output_token_logprobs_val", "output_token_logprobs_idx"):
                got = getattr(req, name, None)
                if got:
                    values[name] = [got[0]]
            for name in ("output_top_logprobs_val", "output_top_logprobs_idx"):
                got = getattr(req, name, None)
                if got:
                    values[name] = list(got[0])
        if getattr(req, "hidden_states_tensor", None) is not None:
            values["output_topk_p"] = req.output_topk_p
            values["output_topk_index"] = req.output_topk_index
            values["output_hidden_states"] = req.hidden_states_tensor
        values[ROOM] = [req.bootstrap_room]
        self.write_by_address(req.metadata_buffer_index, values)

    def write_by_address(self, idx: int, values: dict[str, Any]) -> None:
        """Copy leading elements of fields into slot `idx` knowing only its addresses, as a
        transfer engine does: no ownership is checked (the slot's owner commits it).  Every
        value is checked (field, count, an exact conversion to the field's dtype) before the
        first byte is copied."""
        self._check_index(idx)
        fields = self.table.schema.slots
        copies = []
        for name, value in values.items():
            fs = fields.get(name) if isinstance(name, str) else None
            if fs is None:
                raise SchemaError(f"no metadata field {name!r}")
            copies.append((self._item(idx, name)[0], _exact(fs.field, value)))
        for address, src in copies:
            ctypes.memmove(address, src.data_ptr(), src.nbytes)

    def _zero(self, idx: int, names: Iterable[str]) -> None:
        """Zero fields of slot `idx` (checked): the caller owns it and nobody else reads it."""
        self._check_index(idx)
        for name in names:
            address, item_len = self._item(idx, name)
            ctypes.memset(address, 0, item_len)

    def _item(self, idx: int, name: str) -> tuple[int, int]:
        """(address, length) of field `name`'s item in slot `idx` (checked by the caller with
        `_check_index`): SGLang's addressing rule, `ptrs[i] + item_lens[i] * idx`."""
        ptr, item_len = self._columns[name]
        return ptr + item_len * idx, item_len

    def _check_index(self, idx: object) -> None:
        """The buffers are open and `idx` names one of their slots, or an error."""
        self._check_open()
        self.table.layout.check_slot(idx)

    def _check_open(self) -> None:
        if self.table.closed:
            raise TableClosed(f"the metadata buffers of table {self.table.name!r} are closed")

    def get_buf(self, idx: int) -> tuple[torch.Tensor, ...]:
        """Commit the transfer into `idx` and return zero-copy views of its row, in SGLang's
        order (the decode side: see ReqToMetadataIdxAllocator.get_buf)."""
        return self._decode_side().get_buf(idx)

    def clear_slot(self, idx: int) -> None:
        """See ReqToMetadataIdxAllocator.clear_slot."""
        self._decode_side().clear_slot(idx)

    def views(self, lease: Lease) -> tuple[torch.Tensor, ...]:
        """The row's fields as zero-copy views, in SGLang's get_buf() order."""
        return tuple(lease.view(name) for name in self._names)

    def _decode_side(self) -> ReqToMetadataIdxAllocator:
        if self._allocator is None:
            raise OwnershipError(
                "these buffers have no ReqToMetadataIdxAllocator: the decode side makes one "
                "with ReqToMetadataIdxAllocator(size, buffers)"
            )
        return self._allocator

    def close(self) -> None:
        """Hand every slot back and detach; the decode side that made the table unlinks it."""
        if self.table.closed:
            return
        try:
            if self._allocator is not None:
                self._allocator.close()
        finally:
            self.table.close()
            if self.table.created_here:
                self.table.unlink()


@dataclass
class AllocatorStats:
    allocated: int = 0
    committed: int = 0  # get_buf: transfers committed in place
    deferred_frees: int = 0  # free() after commit: the request still owns the slot
    aborted_before_commit: int = 0  # reservations aborted (freed after the quarantine)
    aborted_after_commit: int = 0  # committed rows of aborted requests: released at once
    released: int = 0  # rows consumed and handed back


class ReqToMetadataIdxAllocator:
    """SGLang's allocator of metadata indices, over the slots of `buffers`' table.

    SGLang builds it from a size alone; here it also takes the buffers whose slots it hands
    out (`ReqToMetadataIdxAllocator(size, buffers)`), and answers those buffers' `get_buf`
    and `clear_slot`, which the decode side calls on the buffers, as SGLang does.
    """

    def __init__(
        self, size: int, buffers: MetadataBuffers, *, late_write_window_s: float = 10.0
    ) -> None:
        if size != buffers.size:
            raise SchemaError(f"size {size} is not the buffers' {buffers.size} slots")
        if buffers._allocator is not None:
            raise OwnershipError("these buffers already have their allocator")
        self.size = size
        self.buffers = buffers
        self.table = buffers.table
        self.quarantine = Quarantine(late_write_window_s)
        self.stats = AllocatorStats()
        self._reserved: dict[int, Reservation] = {}  # allocated, not yet committed
        self._held: dict[int, Lease] = {}  # committed, not yet consumed
        self._freed: set[int] = set()  # committed and free()d by SGLang: still ours
        self._tags = itertools.count(1)
        buffers._allocator = self

    def available_size(self) -> int:
        self.quarantine.sweep()
        return self.size - len(self._reserved) - len(self._held) - len(self.quarantine)

    def alloc(self) -> int | None:
        """Reserve a slot for a transfer; None when every slot is taken.  Its row is zeroed
        (ours: nobody else can see it yet), so fields a transfer does not write read as 0
        and SGLang's gate waits for this transfer's room."""
        self.quarantine.sweep()
        try:
            reservation = self.table.reserve(tag=next(self._tags), timeout=0)
        except SlotsExhausted:
            return None
        idx = reservation.slot
        try:
            self.buffers._zero(idx, self.buffers._names)
        except BaseException:
            reservation.end()
            raise
        self._reserved[idx] = reservation
        self.stats.allocated += 1
        return idx

    def get_buf(self, idx: int) -> tuple[torch.Tensor, ...]:
        """Commit the transfer into `idx` in place and return views of the row, in SGLang's
        order; they stay valid until the slot is released or aborted.  (The transfer has
        landed, so a commit that fails frees the slot at once, with no quarantine.)"""
        lease = self._held.get(self._check(idx))
        if lease is None:
            reservation = self._reserved.get(idx)
            if reservation is None:
                raise OwnershipError(f"metadata index {idx} is not allocated")
            with self.table.open_reserved(reservation.slot, reservation.generation) as ws:
                try:  # leaving the block without keep() aborts the write slot
                    lease = ws.written_in_place().keep()
                except BaseException:
                    del self._reserved[idx]
                    raise
            del self._reserved[idx]
            self._held[idx] = lease
            self.stats.committed += 1
        return self.buffers.views(lease)

    def clear_slot(self, idx: int) -> None:
        """SGLang clears the room right after commit; a committed row is the request's until
        it is released (its row is zeroed when the slot is next allocated)."""
        if self._check(idx) in self._reserved:
            self.buffers._zero(idx, [ROOM])

    def free(self, free_index: int) -> None:
        """SGLang's free: after commit the request still owns the slot (counted); before
        commit the reservation is aborted.  A double free raises."""
        idx = self._check(free_index)
        if idx in self._held and idx not in self._freed:
            self._freed.add(idx)
            self.stats.deferred_frees += 1
        elif idx in self._reserved:
            self._abort_reserved(idx)
        else:
            raise OwnershipError(f"double free of metadata index {idx} (it is not allocated)")

    def release(self, idx: int) -> None:
        """The request's draft state was consumed: hand its slot back now.  If that raises
        (views refused in strict mode), the index stays the request's: call again."""
        lease = self._held.get(self._check(idx))
        if lease is None:
            raise OwnershipError(f"metadata index {idx} holds no committed row to release")
        lease.release()
        self._forget(idx)
        self.stats.released += 1

    def abort(self, idx: int) -> None:
        """The request was aborted: a committed row is released at once, a reservation is
        quarantined (its transfer may still land)."""
        lease = self._held.get(self._check(idx))
        if lease is not None:
            lease.abort()
            self._forget(idx)
            self.stats.aborted_after_commit += 1
        elif idx in self._reserved:
            self._abort_reserved(idx)
        else:
            raise OwnershipError(f"metadata index {idx} is not allocated")

    def _forget(self, idx: int) -> None:
        del self._held[idx]
        self._freed.discard(idx)

    def release_consumed(self, reqs: Iterable[_Req]) -> None:
        """After `process_prebuilt`: release each request's slot, and clear its index so no
        later call can reach a slot reused by another request."""
        for req in reqs:
            if req.metadata_buffer_index >= 0:
                self.release(req.metadata_buffer_index)
                req.metadata_buffer_index = -1

    def abort_request(self, req: _Req) -> None:
        """Abort at any stage, once: nothing to do if its slot was already handed back."""
        if req.metadata_buffer_index >= 0:
            self.abort(req.metadata_buffer_index)
            req.metadata_buffer_index = -1

    def _abort_reserved(self, idx: int) -> None:
        self.quarantine.hold(self._reserved[idx])
        del self._reserved[idx]
        self.stats.aborted_before_commit += 1

    def _check(self, idx: object) -> int:
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < self.size:
            raise InvalidSlot(f"metadata index {idx!r} out of range 0..{self.size - 1}")
        return idx

    def close(self) -> None:
        """Hand every slot back (the decode side is stopping); each handle once, so a close
        that raised part-way can be called again."""
        self._freed.clear()
        while self._held:
            self._held.popitem()[1].abort()
        while self._reserved:
            self._reserved.popitem()[1].end()
        self.quarantine.close()


__all__ = [
    "SGLANG_VERSION",
    "AllocatorStats",
    "MetadataBuffers",
    "ReqToMetadataIdxAllocator",
    "metadata_fields",
]
