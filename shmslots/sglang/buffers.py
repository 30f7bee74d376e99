"""SGLang 0.5.23's `MetadataBuffers` and `ReqToMetadataIdxAllocator`, over one shmslots table.

Callable exactly as SGLang's scheduler calls them (`ReqToMetadataIdxAllocator(size)` first,
then `MetadataBuffers(size, hidden_size=..., ...)`), with every method and attribute SGLang
uses (the call sites are listed in `shmslots.sglang`).  It imports nothing of SGLang.  The
buffers are a table in the column layout, so a transfer engine writes field i of index s at
`ptrs[i] + item_lens[i] * s`, exactly as into SGLang's own tensors.

What changes is who may reuse an index, and when.  SGLang frees an index right after the
transfer is committed (`pop_transferred`), while the request keeps the draft state it read
from the row until `process_prebuilt` consumes it.  Here an index is a slot its request owns:

- `alloc()` reserves a slot and resets it to "not yet written";
- `get_buf(idx)` commits the transfer in place (sealed, no copy) and returns zero-copy views;
- `free(idx)` after commit does not hand the slot back (counted in `deferred_frees`); before
  commit it aborts the reservation, which is held back for `late_write_window_s` so that a
  late write by address never lands in the next request's row;
- the slot goes back when the request's draft state is consumed (`release_consumed(reqs)`)
  or the request is aborted (`abort_request(req)`), at once.

Requests are found by what SGLang passes: an SGLang `Req`, or a `DecodeRequest` (its `.req`),
bound to its index with `bind(req, idx)` when the index is handed to its transfer.  A call for
a request whose slot was already handed back is a counted no-op: it never reaches the slot's
next owner.  A bound request that is garbage-collected still holding a slot hands it back.

A double free, a release of an index that is not allocated, or an index out of range raises
instead of corrupting the free list.  One decode scheduler (one thread) drives an allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    IncompatibleTable,
    InvalidSlot,
    OwnershipError,
    SchemaError,
    SlotsExhausted,
    TableClosed,
    TableNotFound,
)
from ..leases import Lease, Reservation
from ..quarantine import Quarantine
from ..schema import ITEM_ALIGN, Field
from ..table import SlotTable

SGLANG_VERSION = "0.5.23"
ROOM = "bootstrap_room"
KV_CHECKSUM = "kv_checksum"
DSA_TOPK = "output_dsa_topk_indices"
# SGLang keeps these as numpy arrays for the request's whole life (`sampling_mask_rows`):
# get_buf hands them out as copies, so nothing of the row outlives its slot.
SAMPLING_MASK = (
    "output_token_sampling_mask_len",
    "output_token_sampling_mask_idx",
    "output_token_sampling_logprobs",
)
# get_buf()'s 14 values, in SGLang's order; None stands for a field that is switched off
GET_BUF_ORDER = (
    "output_ids",
    "cached_tokens",
    "output_token_logprobs_val",
    "output_token_logprobs_idx",
    "output_top_logprobs_val",
    "output_top_logprobs_idx",
    *SAMPLING_MASK,
    "output_topk_p",
    "output_topk_index",
    "output_hidden_states",
    DSA_TOPK,
    ROOM,
)
_names = itertools.count()


def sampling_mask_enabled() -> bool:
    """SGLang's `SGLANG_ENABLE_DISAGG_SAMPLING_MASK`, parsed by its `EnvBool` rule."""
    value = os.environ.get("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "false").lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise SchemaError(f'SGLANG_ENABLE_DISAGG_SAMPLING_MASK: "{value}" is not a boolean')


def metadata_fields(
    hidden_size: int,
    hidden_states_dtype: torch.dtype | str,
    max_sampling_mask_tokens: int,
    max_top_logprobs_num: int = 128,
    output_dsa_topk_indices_dim: int = 0,
    *,
    sampling_mask: bool = False,
    kv_checksum: bool = False,
) -> tuple[Field, ...]:
    """SGLang's metadata buffers in `get_buf_infos()` order: one field per buffer, its shape
    one row's.  Every item length must be a multiple of 64 bytes, as the engines need."""
    fields = [
        Field("output_ids", "int32", (16,)),  # [0]: the first output token
        Field("cached_tokens", "int32", (16,)),  # [0..6]: cached, device, host, storage, mm
        Field("output_token_logprobs_val", "float32", (16,)),
        Field("output_token_logprobs_idx", "int32", (16,)),
        Field("output_top_logprobs_val", "float32", (max_top_logprobs_num,)),
        Field("output_top_logprobs_idx", "int32", (max_top_logprobs_num,)),
    ]
    if sampling_mask:
        fields += [
            Field(SAMPLING_MASK[0], "int32", (16,)),
            Field(SAMPLING_MASK[1], "int32", (max_sampling_mask_tokens,)),
            Field(SAMPLING_MASK[2], "float32", (max_sampling_mask_tokens,)),
        ]
    fields += [
        Field("output_topk_p", "float32", (16,)),
        Field("output_topk_index", "int64", (16,)),
        Field("output_hidden_states", hidden_states_dtype, (hidden_size,)),
    ]
    if output_dsa_topk_indices_dim > 0:
        fields.append(Field(DSA_TOPK, "int32", (output_dsa_topk_indices_dim,)))
    fields.append(Field(ROOM, "uint64", (8,)))
    if kv_checksum:
        fields.append(Field(KV_CHECKSUM, "uint64", (8,)))
    for f in fields:  # an engine copies the prefill side's item length: ours must be equal
        if f.nbytes % ITEM_ALIGN:
            raise SchemaError(
                f"{f.name}: {f.nbytes} bytes a row is not a multiple of {ITEM_ALIGN}; SGLang's "
                "transfer engines need equal item lengths on both sides"
            )
    return tuple(fields)


class _RoomColumn:
    """`bootstrap_room` as SGLang's gate reads it (`bootstrap_room[idx, 0].item()`), by copy:
    a 0-d uint64 tensor for `[idx, j]`, an (8,) one for `[idx]`.  Nothing of it points into
    the mapping, so it stays safe to hold after the slot moves on or the buffers close."""

    def __init__(self, buffers: MetadataBuffers) -> None:
        self._buffers = buffers

    def __getitem__(self, key: int | tuple[int, int]) -> torch.Tensor:
        idx, j = key if isinstance(key, tuple) else (key, None)
        if j is not None and not (type(j) is int and 0 <= j < 8):
            raise InvalidSlot(f"bootstrap_room has 8 words a row, not {j!r}")
        words = torch.tensor(self._buffers._words(idx, ROOM), dtype=torch.uint64)
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


# SGLang's scheduler builds the allocator, then the buffers, with nothing to join them: the
# buffers take the allocator of their size built last in their thread and not yet joined.
_unjoined = threading.local()


def unjoined_allocator() -> ReqToMetadataIdxAllocator | None:
    """The allocator built last in this thread that no buffers have joined yet."""
    allocator: ReqToMetadataIdxAllocator | None = getattr(_unjoined, "allocator", None)
    return allocator


class MetadataBuffers:
    """SGLang's `MetadataBuffers`, one slot per index, in a shmslots table.

    The decode side makes it, after its `ReqToMetadataIdxAllocator(size)`; the table is named
    `table_name`, or uniquely.  A prefill side on the same machine may attach to it by name
    (`MetadataBuffers.attach(name)`) and fill slots by address (`set_buf`, `set_kv_checksum`).
    `custom_mem_pool` is accepted and kept (SGLang's is for buffers an NVLink engine reads;
    these rows live in shared CPU memory, registered by address like SGLang's CPU buffers).
    """

    custom_mem_pool: object | None = None

    def __init__(
        self,
        size: int,
        hidden_size: int,
        hidden_states_dtype: torch.dtype | str,
        max_sampling_mask_tokens: int,
        max_top_logprobs_num: int = 128,
        custom_mem_pool: object | None = None,
        output_dsa_topk_indices_dim: int = 0,
        *,
        kv_checksum_enabled: bool = False,
        table_name: str | None = None,
    ) -> None:
        allocator = unjoined_allocator()
        if allocator is None or allocator.size != size:
            raise OwnershipError(
                f"MetadataBuffers({size}, ...) needs the ReqToMetadataIdxAllocator({size}) "
                "built just before it in this thread, as SGLang's scheduler builds them"
            )
        fields = metadata_fields(
            hidden_size,
            hidden_states_dtype,
            max_sampling_mask_tokens,
            max_top_logprobs_num,
            output_dsa_topk_indices_dim,
            sampling_mask=sampling_mask_enabled(),
            kv_checksum=kv_checksum_enabled,
        )
        name = table_name or f"sglang-metadata-{os.getpid()}-{next(_names)}"
        # a dead decode side's rows are dropped: no other reader would ever take them
        self._bind(SlotTable.create(name, fields, slots=size, on_consumer_death="drop"))
        if DSA_TOPK in self._columns:  # SGLang's buffer starts as -1: "no indices"
            ptr, item_len = self._columns[DSA_TOPK]
            ctypes.memset(ptr, 0xFF, item_len * size)
        self.custom_mem_pool = custom_mem_pool
        allocator._join(self)

    def _bind(self, table: SlotTable) -> None:
        self.table = table
        self._allocator: ReqToMetadataIdxAllocator | None = None  # the decode side's
        slots = table.schema.slots
        self._names = list(slots)
        self.enable_sampling_mask = SAMPLING_MASK[0] in slots
        self.output_dsa_topk_indices_dim = (
            slots[DSA_TOPK].field.fixed_shape[0] if DSA_TOPK in slots else 0
        )
        self._kv_checksum = KV_CHECKSUM in slots
        self._infos = table.buffer_infos()
        ptrs, _, item_lens = self._infos
        # name -> (this process's address of its slot-0 item, item length)
        self._columns = dict(zip(self._names, zip(ptrs, item_lens, strict=True), strict=True))
        self._cleared = (ROOM, KV_CHECKSUM) if self._kv_checksum else (ROOM,)
        # get_buf()'s plan: the fields handed out as views, in SGLang's order (None for one
        # switched off), and the sampling mask's, handed out as copies in their place
        self._viewed = tuple(
            name if name in slots and name not in SAMPLING_MASK else None for name in GET_BUF_ORDER
        )
        self._copied = tuple(
            (GET_BUF_ORDER.index(name), name) for name in SAMPLING_MASK if name in slots
        )
        # slot -> the (address, length) of each item `_clear` zeroes
        self._cleared_items = [
            tuple(self._item(idx, name) for name in self._cleared) for idx in range(table.slots)
        ]
        self.bootstrap_room = _RoomColumn(self)

    @classmethod
    def attach(
        cls,
        name: str,
        role: str = "prefill",
        *,
        allocator: ReqToMetadataIdxAllocator | None = None,
    ) -> MetadataBuffers:
        """The buffers of the table `name`: for a prefill side on the same machine, or, with
        an `allocator` of its size, for a decode side that takes over the table.  A table
        that is not a MetadataBuffers' (other fields, or rows redelivered on a consumer's
        death) is refused."""
        table = SlotTable.attach(name, role)
        try:
            fields = table.schema.slots
            try:
                want = metadata_fields(
                    fields["output_hidden_states"].field.fixed_shape[0],
                    fields["output_hidden_states"].field.dtype,
                    fields[SAMPLING_MASK[1]].field.fixed_shape[0]
                    if SAMPLING_MASK[1] in fields
                    else 16,
                    fields["output_top_logprobs_val"].field.fixed_shape[0],
                    fields[DSA_TOPK].field.fixed_shape[0] if DSA_TOPK in fields else 0,
                    sampling_mask=SAMPLING_MASK[0] in fields,
                    kv_checksum=KV_CHECKSUM in fields,
                )
            except (KeyError, SchemaError):
                want = None
            if want != table.schema.fields or not table.drop_on_consumer_death:
                raise IncompatibleTable(f"table {name!r} is not SGLang metadata buffers")
            if allocator is not None and allocator.size != table.slots:
                raise SchemaError(f"allocator of {allocator.size} slots for {table.slots}")
            buffers = cls.__new__(cls)
            buffers._bind(table)
            if allocator is not None:
                allocator._join(buffers)
            return buffers
        except BaseException:
            table.close()
            raise

    @property
    def size(self) -> int:
        return self.table.slots

    @property
    def kv_checksum(self) -> bool:
        """Whether the rows carry SGLang's kv checksum (its `kv_checksum is not None`)."""
        return self._kv_checksum

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
        """Fill slot `req.metadata_buffer_index` from an SGLang `Req`, by address, reading
        what SGLang 0.5.23's own `set_buf` reads (only what the request has; the rest is left
        as it was)."""
        counts = [req.cached_tokens, req.cached_tokens_device]
        counts += [req.cached_tokens_host, req.cached_tokens_storage]
        if hasattr(req, "get_mm_token_counts"):
            counts += list(req.get_mm_token_counts())
        values: dict[str, Any] = {"output_ids": [req.output_ids[0]], "cached_tokens": counts}
        logprob = getattr(req, "logprob", None)
        if req.return_logprob and logprob is not None:
            for name in ("output_token_logprobs_val", "output_token_logprobs_idx"):
                if getattr(logprob, name):
                    values[name] = [getattr(logprob, name)[0]]
            for name in ("output_top_logprobs_val", "output_top_logprobs_idx"):
                if getattr(logprob, name):
                    values[name] = list(getattr(logprob, name)[0])
        if getattr(req, "return_sampling_mask", False):
            self._check_enabled(self.enable_sampling_mask, "the sampling mask")
            chunk = req.sampling_mask_rows.view()
            values[SAMPLING_MASK[0]] = [len(chunk.token_ids)]
            values[SAMPLING_MASK[1]] = torch.from_numpy(chunk.token_ids)
            values[SAMPLING_MASK[2]] = torch.from_numpy(chunk.logprobs)
        if req.hidden_states_tensor is not None:
            values["output_topk_p"] = req.output_topk_p
            values["output_topk_index"] = req.output_topk_index
            values["output_hidden_states"] = req.hidden_states_tensor
            if self.output_dsa_topk_indices_dim:
                dsa = getattr(req, "output_dsa_topk_indices", None)
                values[DSA_TOPK] = (
                    dsa if dsa is not None else [-1] * self.output_dsa_topk_indices_dim
                )
        values[ROOM] = [req.bootstrap_room or 0]
        self.write_by_address(req.metadata_buffer_index, values)

    def set_kv_checksum(self, req: Any, digest: int, signature: int) -> None:
        """SGLang's prefill call: the digest and the layout signature it was taken under."""
        self._check_enabled(self._kv_checksum, "the kv checksum")
        self.write_by_address(req.metadata_buffer_index, {KV_CHECKSUM: [digest, signature]})

    def get_kv_checksum(self, idx: int) -> tuple[int, int]:
        """`(digest, signature)` of slot `idx`; `(0, 0)` means no digest was written."""
        self._check_enabled(self._kv_checksum, "the kv checksum")
        digest, signature = self._words(idx, KV_CHECKSUM)[:2]
        return digest, signature

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

    def _clear(self, idx: int) -> None:
        """SGLang's `clear_slot`: zero slot `idx`'s room (and kv checksum), so the next owner's
        gate reads "not yet written"; the other fields keep their bytes, as in SGLang's
        buffers.  The caller owns slot `idx` (so it is in range) and nobody else reads it."""
        self._check_open()  # the addresses are the mapping's: gone with a closed table
        for address, item_len in self._cleared_items[idx]:
            ctypes.memset(address, 0, item_len)

    def _words(self, idx: object, name: str) -> tuple[int, ...]:
        """The 8 uint64 words of field `name` (room or checksum) of slot `idx`, by copy."""
        self._check_index(idx)
        assert isinstance(idx, int)
        return struct.unpack("<8Q", ctypes.string_at(self._item(idx, name)[0], 64))

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

    def _check_enabled(self, enabled: bool, what: str) -> None:
        if not enabled:
            raise SchemaError(f"these metadata buffers were built without {what}")

    def get_buf(self, idx: int) -> tuple[torch.Tensor | None, ...]:
        """Commit the transfer into `idx` and return its row, in SGLang's order (the decode
        side: see ReqToMetadataIdxAllocator.get_buf)."""
        return self._decode_side().get_buf(idx)

    def clear_slot(self, idx: int) -> None:
        """See ReqToMetadataIdxAllocator.clear_slot."""
        self._decode_side().clear_slot(idx)

    def row(self, lease: Lease) -> tuple[torch.Tensor | None, ...]:
        """The row held by `lease`, in SGLang's get_buf() order: zero-copy views, copies of the
        sampling mask, None for fields these buffers do not have."""
        row = lease.views(self._viewed)
        if not self._copied:
            return row
        values = list(row)
        for at, name in self._copied:
            values[at] = lease.copy(name)
        return tuple(values)

    def _decode_side(self) -> ReqToMetadataIdxAllocator:
        if self._allocator is None:
            raise OwnershipError(
                f"the buffers of table {self.table.name!r} were attached, not built with a "
                "ReqToMetadataIdxAllocator: only the decode side that built them commits rows"
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
            # unlinked while still attached: a cleanup that removes tables with no live
            # participant (another scheduler's start-up) finds none between the two steps
            try:
                if self.table.created_here and not self.table.unlinked:
                    with contextlib.suppress(TableNotFound):  # removed by hand meanwhile
                        self.table.unlink()
            finally:
                self.table.close()


@dataclass
class AllocatorStats:
    allocated: int = 0
    committed: int = 0  # get_buf: transfers committed in place
    deferred_frees: int = 0  # free() after commit: the request still owns the slot
    aborted_before_commit: int = 0  # reservations aborted (freed after the quarantine)
    aborted_writers_gone: int = 0  # of those, freed at once: their writers were dead
    aborted_after_commit: int = 0  # committed rows of aborted requests: released at once
    released: int = 0  # rows consumed and handed back
    stale_calls: int = 0  # a release or abort for a request that holds no slot any more
    orphaned: int = 0  # slots handed back because their request was garbage-collected


def _orphaned(orphans: list[int], idx: int, _: object) -> None:
    """A bound request was collected holding index `idx`: noted, handed back later."""
    orphans.append(idx)


class ReqToMetadataIdxAllocator:
    """SGLang's allocator of metadata indices, over the slots of the `MetadataBuffers` built
    right after it (SGLang's order); it answers those buffers' `get_buf` and `clear_slot`."""

    def __init__(
        self, size: int, *, late_write_window_s: float = 10.0, in_step: bool = False
    ) -> None:
        if not (type(size) is int and size > 0):
            raise SchemaError(f"size must be a positive int, got {size!r}")
        self.size = size
        # in step: quarantined slots are freed only by sweep(), which the caller makes in step
        # with its peers (SGLang's decode TP ranks: the plugin, each turn of the decode loop)
        self.in_step = in_step
        self.quarantine = Quarantine(late_write_window_s, settled_by_owner=in_step)
        self.stats = AllocatorStats()
        self.buffers: MetadataBuffers | None = None
        self._reserved: dict[int, Reservation] = {}  # allocated, not yet committed
        self._held: dict[int, Lease] = {}  # committed, not yet consumed
        self._freed: set[int] = set()  # committed and free()d by SGLang: still ours
        self._writers_gone: dict[int, Reservation] = {}  # reservations no write can reach
        self._slot_of: dict[int, int] = {}  # id(request) -> its index
        # index -> (id of its request, a weak reference to it)
        self._request_of: dict[int, tuple[int, Callable[[], Any]]] = {}
        self._orphans: list[int] = []  # indices whose request was collected holding them
        # index -> what its request's weak reference calls when the request is collected (each
        # holds this very list: it is emptied in place, never replaced)
        self._on_collected = [functools.partial(_orphaned, self._orphans, i) for i in range(size)]
        self._tags = itertools.count(1)
        _unjoined.allocator = self

    def _join(self, buffers: MetadataBuffers) -> None:
        if self.buffers is not None:
            raise OwnershipError(
                f"this allocator already hands out the slots of table {self.buffers.table.name!r}"
            )
        self.withdraw_from_pairing()
        self.buffers = buffers
        self.table = buffers.table
        buffers._allocator = self

    def withdraw_from_pairing(self) -> None:
        """No buffers built from now on join this allocator."""
        if unjoined_allocator() is self:
            _unjoined.allocator = None

    def _decode_buffers(self) -> MetadataBuffers:
        if self.buffers is None:
            raise OwnershipError(
                f"ReqToMetadataIdxAllocator({self.size}) has no MetadataBuffers yet: build "
                f"MetadataBuffers({self.size}, ...) right after it, as SGLang's scheduler does"
            )
        return self.buffers

    def available_size(self) -> int:
        self._sweep_own()
        return self.size - len(self._reserved) - len(self._held) - len(self.quarantine)

    def alloc(self) -> int | None:
        """Reserve a slot for a transfer; None when every slot is taken.  Its room (and
        checksum) is zeroed in the compiled step that reserves it, before any writer can
        have it, so SGLang's gate waits for this transfer's room."""
        buffers = self.buffers or self._decode_buffers()
        if self._orphans or (not self.in_step and self.quarantine):  # bool: no sweep
            self._sweep_own()
        try:
            reservation = self.table.reserve(next(self._tags), 0, zeroed=buffers._cleared)
        except SlotsExhausted:
            return None
        idx = reservation.slot
        if idx in self._held or idx in self._reserved:
            self._settle(idx)
        self._reserved[idx] = reservation
        self.stats.allocated += 1
        return idx

    def bind(self, req: Any, idx: int) -> None:
        """Index `idx` (allocated) is request `req`'s, an SGLang `Req` or the `DecodeRequest`
        that carries it: later calls find the slot by the request.  A request holds one slot:
        binding a new one (a rebootstrap) aborts the old."""
        req = getattr(req, "req", req)
        if self._check(idx) not in self._reserved and idx not in self._held:
            raise OwnershipError(f"metadata index {idx} is not allocated")
        bound = self._request_of.get(idx)
        holder = bound[1]() if bound is not None else None
        if holder is req:
            return
        if holder is not None:
            raise OwnershipError(f"metadata index {idx} is another request's")
        key = id(req)
        old = self._slot_of.get(key)
        if old is not None and self.slot_of(req) == old:
            self.abort(old)  # if it raises, idx is still its collected holder's, for the sweep
        if bound is not None:
            self._unbind(idx)
        self._slot_of[key] = idx
        ref: Callable[[], Any]
        try:
            ref = weakref.ref(req, self._on_collected[idx])
        except TypeError:  # no weak references (a SimpleNamespace): held, never collected
            ref = functools.partial(lambda held: held, req)
        self._request_of[idx] = (key, ref)

    def slot_of(self, req: Any) -> int | None:
        """The index request `req` holds, or None (never another request's slot)."""
        req = getattr(req, "req", req)
        idx = self._slot_of.get(id(req))
        bound = self._request_of.get(idx) if idx is not None else None
        return idx if bound is not None and bound[1]() is req else None

    def get_buf(self, idx: int) -> tuple[torch.Tensor | None, ...]:
        """Commit the transfer into `idx` in place and return its row in SGLang's order; the
        views stay valid until the slot is released or aborted.  (The transfer has landed,
        so a commit that fails frees the slot at once, with no quarantine.)"""
        buffers = self._decode_buffers()
        lease = self._held.get(self._check(idx))
        if lease is None:
            reservation = self._reserved.get(idx)
            if reservation is None:
                raise OwnershipError(f"metadata index {idx} is not allocated")
            try:  # one compiled step; a commit that fails has aborted the slot
                lease = self.table.keep_reserved(reservation)
            except BaseException:
                del self._reserved[idx]
                self._unbind(idx)
                raise
            del self._reserved[idx]
            self._held[idx] = lease
            self.stats.committed += 1
        return buffers.row(lease)

    def clear_slot(self, idx: int) -> None:
        """SGLang zeroes the room (and checksum) for the next owner right after commit; a
        committed row stays its request's, untouched, and `alloc()` clears every slot it hands
        out.  A reservation is cleared at once (a failed transfer's)."""
        if self._check(idx) in self._reserved:
            self._decode_buffers()._clear(idx)

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
        self._release(idx, lease)

    def _release(self, idx: int, lease: Lease) -> None:
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

    def release_consumed(self, reqs: Iterable[Any]) -> None:
        """After `process_prebuilt`: hand back the slot of each request that holds one."""
        for req in reqs:
            idx = self.slot_of(req)
            if idx is None:
                self.stats.stale_calls += 1
            elif (lease := self._held.get(idx)) is not None:
                self._release(idx, lease)
            else:  # consumed before its transfer was committed: it is over for this slot
                self.abort(idx)

    def abort_request(self, req: Any) -> None:
        """Abort at any stage, once: a request that holds no slot any more is counted."""
        idx = self.slot_of(req)
        if idx is None:
            self.stats.stale_calls += 1
        else:
            self.abort(idx)

    def settle_commits(self, pending: Iterable[tuple[Any, int]], kept: Iterable[Any]) -> None:
        """After SGLang's commit loop (`pop_transferred`): of the `(request, index)` pairs that
        were in flight before it, each row committed and freed there is bound to its request
        if the request was `kept` (it waits for `process_prebuilt`), and handed back at once
        if not (aborted at commit: a room mismatch, a room of 0)."""
        kept_ids = {id(req) for req in kept}
        for req, idx in pending:
            if idx in self._freed and idx not in self._request_of:
                if id(req) in kept_ids:
                    self.bind(req, idx)
                else:
                    self.release(idx)

    def _settle(self, idx: int) -> None:
        """Forget a handle of `idx` that ended without this book hearing of it (an interrupt
        between a release and `_forget`): the table gave the slot out again, so it is over."""
        lease = self._held.get(idx)
        if lease is not None and not lease._open:
            self._forget(idx)
        reservation = self._reserved.get(idx)
        if reservation is not None and not reservation._open:
            del self._reserved[idx]
            self._unbind(idx)

    def _forget(self, idx: int) -> None:
        del self._held[idx]
        self._freed.discard(idx)
        self._unbind(idx)

    def _unbind(self, idx: int) -> None:
        key, _ = self._request_of.pop(idx, (None, None))
        if key is not None and self._slot_of.get(key) == idx:
            del self._slot_of[key]

    def writers_gone(self, idx: int) -> None:
        """Every process that could write into reservation `idx` is dead (a transfer
        backend that knows it exactly says so): aborting it frees the slot at once, since a
        dead process writes nothing.  It applies to this reservation only, never to the
        next one of the same slot."""
        reservation = self._reserved.get(self._check(idx))
        if reservation is not None:
            self._writers_gone[idx] = reservation

    def _abort_reserved(self, idx: int) -> None:
        reservation = self._reserved.pop(idx)
        self._unbind(idx)
        if self._writers_gone.pop(idx, None) is reservation:
            reservation.end()
            self.stats.aborted_writers_gone += 1
        else:
            self.quarantine.hold(reservation)
        self.stats.aborted_before_commit += 1

    def sweep(self, due: int | None = None) -> None:
        """Free the first `due` quarantined slots (None: those whose window has passed on
        this process's clock), and hand back the slots of requests that were
        garbage-collected holding them.

        Allocating sweeps too, unless the allocator is `in_step`: then only this frees a
        quarantined slot (its table's claims do not either, until the quarantine's
        backstop), because SGLang's decode ranks each keep a table and must admit alike.
        The plugin sweeps on each turn of the decode loop (idle or not), as many as are
        due on every rank's clock."""
        self.quarantine.end_first(self.quarantine.due() if due is None else due)
        self._collect_orphans()

    def _sweep_own(self) -> None:
        """What allocating and `available_size()` sweep: the quarantine by this process's
        clock (not in step), and the slots of collected requests."""
        if self.in_step:
            self._collect_orphans()
        else:
            self.sweep()

    def _collect_orphans(self) -> None:
        """Hand back the slots of requests garbage-collected holding them."""
        while self._orphans:
            idx = self._orphans.pop()
            bound = self._request_of.get(idx)
            if bound is None or bound[1]() is not None:
                continue  # handed back, or bound to another request since
            self._unbind(idx)
            self.stats.orphaned += 1
            if idx in self._held:
                self._held[idx].abort()
                del self._held[idx]
                self._freed.discard(idx)
            elif idx in self._reserved:
                self.quarantine.hold(self._reserved.pop(idx))

    def _check(self, idx: object) -> int:
        if type(idx) is int and 0 <= idx < self.size:  # an index this allocator handed out
            return idx
        raise InvalidSlot(f"metadata index {idx!r} out of range 0..{self.size - 1}")

    def close(self) -> None:
        """Hand every slot back (the decode side is stopping); each handle once, so a close
        that raised part-way can be called again."""
        self._freed.clear()
        self._writers_gone.clear()
        self._slot_of.clear()
        self._request_of.clear()
        while self._held:
            self._held.popitem()[1].abort()
        while self._reserved:
            self._reserved.popitem()[1].end()
        self.quarantine.close()
