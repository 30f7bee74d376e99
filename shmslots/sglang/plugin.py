"""shmslots as an SGLang general plugin: SGLang's own decode scheduler, unchanged, on shmslots.

Registered under the `sglang.srt.plugins` entry-point group as `shmslots`; SGLang's
`load_plugins()` calls `register()` in every scheduler process.  It does nothing unless
`SHMSLOTS_SGLANG=1`, so installing shmslots leaves SGLang as shipped.  Switched on, it
registers hooks with SGLang's `HookRegistry`:

- the decode side's `ReqToMetadataIdxAllocator` and `MetadataBuffers` are shmslots' (one
  table per scheduler process, named `sglang-<port>-tp<rank>-<pid>-<n>`; tables whose
  schedulers all died, any server's, are removed first).  The prefill side keeps SGLang's
  own: it frees an index only after its transfer is done, and nothing there holds views of a
  row past that, so it has no bug to fix.  Where SGLang's arguments give an item length that
  is not a multiple of 64 bytes, SGLang keeps its own classes there too, with a warning;
- after `DecodeTransferQueue.pop_transferred`, each row committed and freed there is bound to
  its `Req` if the request was kept, and handed back at once if it was aborted at commit
  (room mismatch, room 0); failed transfers are SGLang's own `free()` before commit, which
  holds the slot for the late-write window;
- after `DecodeTransferQueue.resolve_deferred_releases` (every turn of the decode loop, idle
  or not), slots whose late-write window has passed are freed; a failed transfer whose
  writers the same-host backend knows to be dead frees its slot at once, with no window
  (read before SGLang frees them: the transfer queue's entries and its `_deferred_releases`);
- after `process_prebuilt` has stacked each request's draft state into the batch, that state
  is dropped from the `Req` and its slot is released;
- after `Scheduler._release_aborted_request` (an abort in the waiting queue) and
  `_handle_kv_checksum_mismatch` (a request dropped from its prebuilt batch), the slot is
  aborted; a request garbage-collected holding a slot hands it back; at exit, or when a role
  switch tears the decode side down, every slot is handed back and the table unlinked;
- a scheduler that exits when SGLang asks it to (`ShutdownReq`, on `kill PID`) removes its
  table and same-host registry itself; one SIGKILLed runs no exit handler: the server's own
  process, at its exit, removes the tables and same-host registries of dead schedulers;
- a request retracted after its slot went back is resumed with a zero draft state, which the
  target model's verify rejects (SGLang reuses the first token's stale one there).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import logging
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .. import orphans
from ..errors import SchemaError, ShmSlotsError
from ..segment import SHM_DIR
from . import backend, samehost
from .buffers import (
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    metadata_fields,
    sampling_mask_enabled,
    unjoined_allocator,
)

ENV = "SHMSLOTS_SGLANG"
UTILS = "sglang.srt.disaggregation.utils"
DECODE = "sglang.srt.disaggregation.decode"
MIXIN = "sglang.srt.disaggregation.decode_schedule_batch_mixin"
SCHEDULER = "sglang.srt.managers.scheduler"
ROLE_SWITCH = "sglang.srt.disaggregation.role_switch"
# the Req attributes that carry a committed row's draft state (views of the row)
DRAFT_STATE = ("output_topk_p", "output_topk_index", "hidden_states_tensor")
DSA_STATE = "output_dsa_topk_indices"

log = logging.getLogger(__name__)
_sglang_classes: dict[str, Any] = {}  # SGLang's own classes, for the prefill side
_built = itertools.count()
_allocators: weakref.WeakSet[ReqToMetadataIdxAllocator] = weakref.WeakSet()
_drained: weakref.WeakKeyDictionary[Any, ReqToMetadataIdxAllocator] = weakref.WeakKeyDictionary()
_registered_at_exit: list[object] = []
TABLE_PREFIX = "sglang-"


def active() -> bool:
    return os.environ.get(ENV) == "1"


def register() -> None:
    """SGLang's entry point: register the hooks when `SHMSLOTS_SGLANG=1`."""
    if not active():
        return
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _sglang_classes.setdefault("allocator", utils.ReqToMetadataIdxAllocator)
    _sglang_classes.setdefault("buffers", utils.MetadataBuffers)
    hooks = [
        (f"{UTILS}.ReqToMetadataIdxAllocator", DecodeAllocator, HookType.REPLACE),
        (f"{UTILS}.MetadataBuffers", DecodeMetadataBuffers, HookType.REPLACE),
        (f"{DECODE}.DecodeTransferQueue.pop_transferred", _pop_transferred, HookType.AROUND),
        (f"{DECODE}.DecodePreallocQueue.resume_retracted_reqs", _resumed, HookType.AFTER),
        (f"{DECODE}.DecodeTransferQueue.resolve_deferred_releases", _resolved, HookType.AROUND),
        (
            f"{MIXIN}.ScheduleBatchDisaggregationDecodeMixin.process_prebuilt",
            _prebuilt,
            HookType.AFTER,
        ),
        (f"{SCHEDULER}.Scheduler._release_aborted_request", _aborted, HookType.AFTER),
        (
            f"{DECODE}.SchedulerDisaggregationDecodeMixin._handle_kv_checksum_mismatch",
            _aborted,  # dropped from its prebuilt batch before process_prebuilt
            HookType.AFTER,
        ),
        (f"{ROLE_SWITCH}.teardown_disaggregation", _tearing_down, HookType.BEFORE),
    ]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    backend.register_hooks()
    if not _registered_at_exit:
        _registered_at_exit.append(atexit.register(_remove_what_dead_schedulers_left))


def _remove_what_dead_schedulers_left() -> None:
    """At a process's exit (the server's own, after SGLang's shutdown has SIGKILLed the
    schedulers that did not exit when asked, which run no exit handler): remove the plugin
    tables and same-host registries whose makers are all dead.  SGLang's `kill_process_tree`
    has reaped them by then (`srt/utils/common.py:2507`, `wait_timeout=60`), so their locks
    are gone."""
    _remove_orphaned_tables()
    with contextlib.suppress(ShmSlotsError, OSError):
        samehost.sweep()


def _remove_orphaned_tables() -> None:
    """Remove every plugin table whose makers are all dead.  Live ones, another server's
    included, are spared: each is judged by its makers' liveness locks, never by name."""
    for entry in os.scandir(SHM_DIR):
        if entry.name.startswith(TABLE_PREFIX):
            with contextlib.suppress(ShmSlotsError, OSError):
                if orphans.remove_if_orphaned(entry.name):
                    log.warning("shmslots: removed %s, left by a scheduler that died", entry.name)


def _on_decode_side() -> bool:
    from sglang.srt.runtime_context import get_disagg

    return bool(get_disagg().disaggregation_mode == "decode")


def _table_name() -> str:
    """Which server and TP rank a table belongs to, for `shmslots ls` and `inspect`; tables
    left by dead schedulers (a server killed whole, so no exit of its ran) are removed first."""
    from sglang.srt.runtime_context import get_parallel, get_server_args

    try:
        port, rank = get_server_args().port, get_parallel().tp_rank
    except (AttributeError, RuntimeError, ValueError):
        port, rank = "x", "x"
    _remove_orphaned_tables()
    return f"{TABLE_PREFIX}{port}-tp{rank}-{os.getpid()}-{next(_built)}"


class DecodeAllocator(ReqToMetadataIdxAllocator):
    """SGLang's `ReqToMetadataIdxAllocator` as its scheduler names it: shmslots' on the decode
    side, SGLang's own elsewhere (and where the buffers could not be shmslots')."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not _on_decode_side():
            return _sglang_classes["allocator"](*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, size: int, **kwargs: Any) -> None:
        # its quarantine is freed on the decode loop's beat, in step with the other TP ranks
        super().__init__(size, in_step=True, **kwargs)
        self.sglang_allocator: Any = None  # set when the buffers fell back to SGLang's
        _allocators.add(self)

    def available_size(self) -> int:
        if self.sglang_allocator is not None:
            return int(self.sglang_allocator.available_size())
        return super().available_size()

    def alloc(self) -> int | None:
        if self.sglang_allocator is not None:
            got: int | None = self.sglang_allocator.alloc()
            return got
        return super().alloc()

    def free(self, free_index: int) -> None:
        if self.sglang_allocator is not None:
            return self.sglang_allocator.free(free_index)  # type: ignore[no-any-return]
        super().free(free_index)


class DecodeMetadataBuffers(MetadataBuffers):
    """SGLang's `MetadataBuffers` as its scheduler names it: shmslots' on the decode side
    (closed and unlinked at exit), SGLang's own elsewhere."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not _on_decode_side():
            return _sglang_classes["buffers"](*args, **kwargs)
        why = _unsupported(args, kwargs)
        allocator = unjoined_allocator()
        if why is not None and isinstance(allocator, DecodeAllocator):
            log.warning("shmslots: SGLang keeps its own metadata buffers here: %s", why)
            allocator.withdraw_from_pairing()
            allocator.sglang_allocator = _sglang_classes["allocator"](allocator.size)
            return _sglang_classes["buffers"](*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("table_name", _table_name())
        super().__init__(*args, **kwargs)
        atexit.register(_close_at_exit, weakref.ref(self))


def _unsupported(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why SGLang's arguments make rows a table cannot hold (an item length that is not a
    multiple of 64 bytes, which SGLang's own tensors allow), or None."""
    call = inspect.signature(MetadataBuffers.__init__).bind(None, *args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    try:
        metadata_fields(
            a["hidden_size"],
            a["hidden_states_dtype"],
            a["max_sampling_mask_tokens"],
            a["max_top_logprobs_num"],
            a["output_dsa_topk_indices_dim"],
            sampling_mask=sampling_mask_enabled(),
            kv_checksum=a["kv_checksum_enabled"],
        )
    except SchemaError as exc:
        return str(exc)
    return None


def _close_at_exit(ref: weakref.ref[DecodeMetadataBuffers]) -> None:
    buffers = ref()
    if buffers is not None:
        buffers.close()


def _allocator_of(queue: Any) -> ReqToMetadataIdxAllocator | None:
    allocator = queue.req_to_metadata_buffer_idx_allocator
    return allocator if isinstance(allocator, ReqToMetadataIdxAllocator) else None


def _pop_transferred(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    allocator = _allocator_of(queue)
    if allocator is None:
        return original(queue, *args, **kwargs)
    pending = [(dr.req, dr.metadata_buffer_index) for dr in queue.queue]
    _mark_writers_gone(allocator, queue.queue, queue.gloo_group)
    kept = original(queue, *args, **kwargs)
    allocator.settle_commits(pending, kept)
    return kept


def _resolved(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang resolves its deferred releases on every turn of the decode loop, idle or not:
    the quarantine, their sibling for metadata slots, frees what is due on the same beat."""
    allocator = _allocator_of(queue)
    if allocator is None:
        return original(queue, *args, **kwargs)
    _mark_writers_gone(
        allocator, [entry[0] for entry in queue._deferred_releases], queue.gloo_group
    )
    result = original(queue, *args, **kwargs)
    _sweep_agreed(allocator, queue.gloo_group)
    return result


def _sweep_agreed(allocator: ReqToMetadataIdxAllocator, group: Any) -> None:
    """Free as many quarantined slots as are due on every decode rank's clock (a MIN
    all-reduce over `group`), on every rank in the same turn, so every rank frees the same
    number: the ranks hold the same slots, as they follow SGLang's agreed frees (but for a
    request garbage-collected holding a reservation, which each rank finds on its own).
    One number is reduced on every turn, so no rank can skip the collective."""
    from sglang.srt.disaggregation.utils import all_reduce_flags
    from torch.distributed import ReduceOp

    [due] = all_reduce_flags(flags=[allocator.quarantine.due()], group=group, op=ReduceOp.MIN)
    allocator.sweep(due)


def _mark_writers_gone(
    allocator: ReqToMetadataIdxAllocator, decode_reqs: Iterable[Any], group: Any
) -> None:
    """Before SGLang frees the slots of failed transfers: those whose writers its manager
    knows to be dead (shmslots' same-host one: `writers_gone`) are freed at once, the
    others quarantined.  A network engine cannot know, so its slots keep the window.
    Each decode rank watches on its own, so a slot is freed at once only where every rank
    of `group` (the queue's `gloo_group`) says so: SGLang keeps the ranks' admission
    identical (`decode.py:2957-2963`), and a slot free on one rank only would split it."""
    from sglang.srt.disaggregation.utils import all_reduce_flags
    from torch.distributed import ReduceOp

    decode_reqs = list(decode_reqs)
    gone = []
    for decode_req in decode_reqs:
        manager = getattr(decode_req.kv_receiver, "kv_mgr", None)
        writers_gone = getattr(manager, "writers_gone", None)
        room, receiver = decode_req.req.bootstrap_room, decode_req.kv_receiver
        gone.append(int(writers_gone is not None and writers_gone(room, receiver)))
    agreed = all_reduce_flags(flags=gone, group=group, op=ReduceOp.MIN)
    for decode_req, everywhere in zip(decode_reqs, agreed, strict=True):
        if everywhere:
            allocator.writers_gone(decode_req.metadata_buffer_index)


def _prebuilt(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """The batch has stacked its requests' draft state: drop it from each request, then
    hand its slot back."""
    for allocator in list(_allocators):
        held = [req for req in batch.reqs if allocator.slot_of(req) is not None]
        for req in held:
            if req.hidden_states_tensor is not None:
                _drained[req] = allocator
            _drop_draft_state(req)
        allocator.release_consumed(held)


def _aborted(result: Any, scheduler: Any, req: Any, *args: Any) -> None:
    """An aborted request's draft state is never read: drop it, then abort its slot."""
    for allocator in list(_allocators):
        if allocator.slot_of(req) is not None:
            _drop_draft_state(req)
            allocator.abort_request(req)


def _tearing_down(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """A role switch drops the decode side: hand its slots back and remove its table."""
    buffers = getattr(scheduler, "disagg_metadata_buffers", None)
    if isinstance(buffers, MetadataBuffers):
        if buffers._allocator is not None:
            _allocators.discard(buffers._allocator)
        buffers.close()


def _drop_draft_state(req: Any) -> None:
    for name in (*DRAFT_STATE, DSA_STATE):
        setattr(req, name, None)


def _resumed(resumed: Any, *args: Any, **kwargs: Any) -> None:
    """A retracted request whose draft state went with its slot gets a zero one (shaped as
    the table's fields), so SGLang's draft builder finds what it expects."""
    for req in resumed or ():
        allocator = _drained.pop(req, None)
        if allocator is None or allocator.buffers is None:
            continue
        slots = allocator.buffers.table.schema.slots
        for name, field in zip(
            DRAFT_STATE, ("output_topk_p", "output_topk_index", "output_hidden_states"), strict=True
        ):
            f = slots[field].field
            setattr(req, name, torch.zeros(f.fixed_shape, dtype=f.torch_dtype))
