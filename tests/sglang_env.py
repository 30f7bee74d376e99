"""SGLang 0.5.23's own decode path, set up in one CPU process for the tests that drive it.

What is SGLang's here: `Req`, `DecodeRequest`, `DecodeTransferQueue` (its `pop_transferred`
and `_commit_transfer_to_req`), the metadata gate, `KVPoll`, `AuxDataCodec` (its TCP aux
path: bytes out of the prefill side's `MetadataBuffers` row, into the decode side's by
`get_buf_infos()` address), `MetadataBuffers.set_buf`, `build_eagle_disagg_draft_input`,
`ScheduleBatchDisaggregationDecodeMixin.process_prebuilt`, `Scheduler._release_aborted_request`,
its runtime context (`override_server_args`, a one-rank gloo group) and `load_plugins()`.

What stands in, and why:
- `torchvision`: imported at module level by SGLang's multimodal configs, never called on this
  path; PyPI's build is CUDA's and cannot sit beside CPU torch.  The servers' stand-in
  (`sglang_cpu/standins.py`): any attribute, never callable, hidden from transformers' own
  availability check.
- the scheduler object (`Scheduler` needs a model): `Lane.scheduler` has the attributes
  `DecodeTransferQueue` reads, and SGLang's unbound methods are called on it;
- the KV receiver (the transport): `Receiver` says what `poll()` answers, as a real one would
  once its KV pages and aux data have landed; the aux bytes land through `AuxDataCodec`;
- a batch for `process_prebuilt`: the attributes the mixin reads, with a no-op tree cache.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from sglang_cpu import standins

SGLANG_MISSING: str | None = None
try:
    import sglang  # noqa: F401
except ImportError as exc:  # the README's test command installs it; say so if it did not
    SGLANG_MISSING = (
        f"SGLang 0.5.23 is not installed ({exc}): pip install --no-deps -r tests/sglang-0.5.23.txt"
    )


def install_torchvision_stand_in() -> None:
    """Before SGLang is imported: the servers' strict torchvision stand-in
    (sglang_cpu/standins.py); this path runs no sgl_kernel op either way.  On a CUDA machine
    SGLang imports sgl_kernel at module level, so where it is not installed (its wheel is
    CUDA's and large: tools/gpu_check.sh's machine may lack it) that one stands in too,
    equally strict; a CPU machine keeps SGLang's own import-time choices."""
    cuda_without_kernels = torch.cuda.is_available() and (
        importlib.util.find_spec("sgl_kernel") is None
    )
    standins.install(
        roots=("torchvision", "sgl_kernel") if cuda_without_kernels else ("torchvision",)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_decode_runtime(topk: int = 4) -> None:
    """SGLang's runtime context for one decode rank with EAGLE: its server args (test
    override), rank 0 of a one-rank gloo group."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().override_server_args(
        disaggregation_mode="decode",
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=topk,
        speculative_num_steps=1,
        speculative_num_draft_tokens=topk + 1,
    ).install()
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    group = dist.new_group([0], backend="gloo")
    get_parallel().override_permanently(tp_rank=0, attn_tp_group=SimpleNamespace(cpu_group=group))


class Receiver:
    """The transport's side of one request: what SGLang's `poll()` answers.  `land()` is the
    transfer arriving: the prefill row's bytes written by SGLang's `AuxDataCodec`."""

    def __init__(self) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.state = int(KVPoll.Transferring)
        self.abort_notified = False
        self.kv_mgr = SimpleNamespace(enable_deferred_decode_kv_release=False)
        self.bootstrap_infos: list[object] = []
        self.supports_host_destination = False

    def poll(self) -> int:
        return self.state

    def succeed(self) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.state = int(KVPoll.Success)

    def fail(self) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.state = int(KVPoll.Failed)

    def failure_exception(self) -> None:
        raise RuntimeError("the test failed this transfer")

    def clear(self) -> None:
        pass

    def abort(self) -> None:
        self.fail()


def land(prefill: Any, src_idx: int, decode_infos: Sequence[list[int]], dst_idx: int) -> None:
    """SGLang's TCP aux path: each prefill buffer's item at `src_idx`, serialized, then
    deserialized at the decode side's `ptrs[i] + item_lens[i] * dst_idx`."""
    from sglang.srt.disaggregation.common.utils import AuxDataCodec

    src_ptrs, _, src_lens = prefill.get_buf_infos()
    kv_args = SimpleNamespace(aux_data_ptrs=decode_infos[0], aux_item_lens=decode_infos[2])
    for i, (ptr, item_len) in enumerate(zip(src_ptrs, src_lens, strict=True)):
        data = AuxDataCodec.serialize_data_from_buffer(ptr + item_len * src_idx, item_len)
        AuxDataCodec.deserialize_data_to_buffer(kv_args, i, dst_idx, data)


def sglang_req(rid: int, hidden_size: int, topk: int) -> Any:
    """A real SGLang `Req` as a prefill side leaves it: its first token and EAGLE draft state,
    every value a function of rid so the decode side can check what it reads."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"req-{rid}", "", [1, 2, 3], SamplingParams(max_new_tokens=8), bootstrap_room=rid + 1)
    req.output_ids = [rid % 50_000]
    req.output_topk_p = torch.arange(topk, dtype=torch.float32) / (rid + 1)
    req.output_topk_index = torch.arange(topk, dtype=torch.int64) + 1000 * rid
    req.hidden_states_tensor = ((torch.arange(hidden_size) + 7 * rid) % 128).to(torch.bfloat16)
    return req


def expected_draft(rid: int, hidden_size: int, topk: int) -> tuple[torch.Tensor, ...]:
    req = sglang_req(rid, hidden_size, topk)
    return req.output_topk_p, req.output_topk_index, req.hidden_states_tensor


class Lane:
    """One decode rank's metadata path, SGLang's code throughout: a prefill side with SGLang's
    own `MetadataBuffers` (its `set_buf`), the decode side's allocator and buffers as SGLang's
    scheduler builds them (by the names its modules hold: shmslots' once the plugin is on), its
    `DecodeTransferQueue`, `process_prebuilt` and `_release_aborted_request`."""

    def __init__(
        self,
        slots: int,
        hidden_size: int,
        topk: int,
        dsa_dim: int = 0,
        classes: tuple[Any, Any] | None = None,
    ) -> None:
        """`classes`: the decode side's (allocator, buffers) classes, if not the ones
        SGLang's scheduler module names."""
        from sglang.srt.disaggregation import decode
        from sglang.srt.managers import scheduler
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.hidden_size, self.topk = hidden_size, topk
        args: dict[str, Any] = dict(
            hidden_size=hidden_size,
            hidden_states_dtype=torch.bfloat16,
            max_sampling_mask_tokens=16,
            output_dsa_topk_indices_dim=dsa_dim,
        )
        # the prefill side: SGLang's own classes, whatever the plugin replaced
        self.prefill_allocator = SGLANG_CLASSES["allocator"](slots)
        self.prefill = SGLANG_CLASSES["buffers"](slots, **args)
        # the decode side, exactly as Scheduler.init_disaggregation builds it
        allocator, buffers = classes or (
            scheduler.ReqToMetadataIdxAllocator,
            scheduler.MetadataBuffers,
        )
        self.allocator = allocator(slots)
        self.buffers = buffers(slots, custom_mem_pool=None, kv_checksum_enabled=False, **args)
        self.scheduler = SimpleNamespace(
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"),
            kv_checksum_computer=None,
            enable_decode_hicache=False,
            enable_hisparse=False,
            batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=_nothing),
            output_streamer=SimpleNamespace(stream_output=_nothing),
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            disagg_decode_prealloc_queue=None,
            tree_cache=SimpleNamespace(  # KV pages are the stand-in transport's: nothing held
                finish=_nothing, checkpoint=_nothing, unlock=_nothing, supports_mamba=lambda: True
            ),
        )
        self.queue = decode.DecodeTransferQueue(
            self.allocator, self.buffers, self.scheduler, self.scheduler.tree_cache
        )
        self.queue._release_request = _nothing  # KV pages are the stand-in transport's
        self._scheduler_module = scheduler
        self.prefill_index: dict[str, int] = {}  # rid -> its row on the prefill side

    def drive(
        self,
        requests: int,
        rng: random.Random,
        *,
        send_chance: float,
        max_batch: int,
        popped: Callable[[Any], object] | None = None,
    ) -> Iterator[tuple[list[Any], Any]]:
        """SGLang's decode flow for requests 0..requests-1: each is sent and landed while a
        slot is free (with `send_chance` a turn), committed by `pop_transferred` (each
        committed request goes to `popped` first), waits, and is built into a batch of
        1..max_batch in random order by `process_prebuilt`.  Yields (batch, its spec_info)."""
        waiting: list[Any] = []
        sent = consumed = 0
        while consumed < requests:
            while sent < requests and self.allocator.available_size() > 0:
                if rng.random() >= send_chance:
                    break
                self.land(self.send(sent))
                sent += 1
            for req in self.pop():
                if popped is not None:
                    popped(req)
                waiting.append(req)
            rng.shuffle(waiting)
            take = rng.randint(1, max_batch)
            batch, waiting = waiting[:take], waiting[take:]
            if batch:
                yield batch, self.prebuild(batch).spec_info
                consumed += len(batch)

    def send(self, rid: int) -> Any:
        """A request through pre-allocation (`_send_kv_metadata`'s `alloc()`) into the
        transfer queue, its prefill side's row written by SGLang's `set_buf`."""
        from sglang.srt.disaggregation.decode import DecodeRequest

        prefilled = sglang_req(rid, self.hidden_size, self.topk)
        prefilled.metadata_buffer_index = self.prefill_allocator.alloc()
        self.prefill.set_buf(prefilled)
        req = sglang_req(rid, self.hidden_size, self.topk)
        decode_req = DecodeRequest(req=req, kv_receiver=Receiver())
        decode_req.req.output_ids = []
        for name in ("output_topk_p", "output_topk_index", "hidden_states_tensor"):
            setattr(decode_req.req, name, None)
        decode_req.metadata_buffer_index = self.allocator.alloc()
        assert decode_req.metadata_buffer_index is not None
        self.prefill_index[req.rid] = prefilled.metadata_buffer_index
        self.queue.add(decode_req)
        return decode_req

    def land(self, decode_req: Any, *, succeed: bool = True) -> None:
        """The transfer arrives: aux bytes through `AuxDataCodec`, then `poll()` says so."""
        infos = self.buffers.get_buf_infos()
        src = self.prefill_index.pop(decode_req.req.rid)
        land(self.prefill, src, infos, decode_req.metadata_buffer_index)
        self.prefill_allocator.free(src)
        if succeed:
            decode_req.kv_receiver.succeed()

    def pop(self) -> list[Any]:
        return list(self.queue.pop_transferred())

    def prebuild(self, reqs: list[Any]) -> Any:
        """SGLang's `process_prebuilt` over a batch of waiting requests: returns the batch,
        whose `spec_info` holds the draft state stacked from the requests."""
        from sglang.srt.disaggregation.decode_schedule_batch_mixin import (
            ScheduleBatchDisaggregationDecodeMixin,
        )

        batch = SimpleNamespace(
            reqs=reqs,
            tree_cache=self.scheduler.tree_cache,
            device="cpu",
            spec_algorithm=self.scheduler.spec_algorithm,
            enable_overlap=False,
            model_config=SimpleNamespace(hf_config=SimpleNamespace(), vocab_size=50_000),
            req_pool_indices=torch.arange(len(reqs)),
            seq_lens=torch.full((len(reqs),), 4),
        )
        ScheduleBatchDisaggregationDecodeMixin.process_prebuilt(batch, future_map=None)
        return batch

    def drop_on_kv_checksum_mismatch(self, req: Any) -> None:
        """`_verify_kv_checksums`' path for a request it drops from its prebuilt batch."""
        from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin

        handle = SchedulerDisaggregationDecodeMixin._handle_kv_checksum_mismatch
        handle(self.scheduler, req, "KV checksum mismatch (test)")

    def abort_waiting(self, req: Any) -> None:
        """`Scheduler.abort_request`'s waiting-queue path: `_release_aborted_request(req)`."""
        self._scheduler_module.Scheduler._release_aborted_request(self.scheduler, req)

    def close(self) -> None:
        if hasattr(self.buffers, "close"):  # SGLang's own buffers are plain tensors
            self.buffers.close()


def _nothing(*args: object, **kwargs: object) -> None:
    return None


SGLANG_CLASSES: dict[str, Any] = {}


def load_sglang(plugin: bool) -> None:
    """Import SGLang as a scheduler process does, with its plugins loaded by its own
    `load_plugins()`; `plugin` sets `SHMSLOTS_SGLANG`."""
    install_torchvision_stand_in()
    if plugin:
        os.environ["SHMSLOTS_SGLANG"] = "1"
    else:
        os.environ.pop("SHMSLOTS_SGLANG", None)
    from sglang.srt.disaggregation import utils
    from sglang.srt.managers import scheduler  # noqa: F401  (what the plugin patches)
    from sglang.srt.plugins import load_plugins

    SGLANG_CLASSES.setdefault("allocator", utils.ReqToMetadataIdxAllocator)
    SGLANG_CLASSES.setdefault("buffers", utils.MetadataBuffers)
    load_plugins()
