"""What SGLang 0.5.23 lacks to run STANDALONE speculative decoding (topk 1) with the
`torch_native` attention backend on a CPU, each applied when its module is first imported
(`standins.install_spec`); no SGLang file is edited.

1. No torch_native draft backends: `DraftBackendFactory.create_decode_backend` and
   `create_draft_extend_backend` (`speculative/draft_utils.py:84-150`) map backend names to
   makers and raise "EAGLE is not supported in decode attention backend torch_native".  The
   CPU path is written for `intel_amx`, whose kernels come from a CPU `sgl_kernel`.  Added: a
   `torch_native` entry in each map.  Draft extend is the plain backend; the multi-step draft
   decode is one backend per step, as `IntelAMXMultiStepDraftBackend`
   (`layers/attention/intel_amx_backend.py:426`) builds it: with topk 1 the draft tokens sit
   in a chain, and step i's query attends to its request's first seq_len + i + 1 tokens.
2. No verify pass in torch_native: its `forward_extend` reads `extend_prefix_lens` and
   `extend_seq_lens`, which a TARGET_VERIFY batch does not carry (`intel_amx_backend.py:83`
   derives them from `spec_info`).  Added: in TARGET_VERIFY each request's draft tokens
   attend to its prefix and, causally, to each other (topk 1: a chain, no tree mask).
3. PD with STANDALONE (an upstream bug, docs/sglang.md): the draft-state hand-off is gated on
   `is_eagle()`, which excludes STANDALONE (`speculative/spec_info.py:103-109`), while
   `need_topk()` (`:233`) and the decode (`disaggregation/decode.py:2727`) expect the state.
   So the prefill never copies `topk_p`/`topk_index` into the request
   (`disaggregation/prefill.py:943, 1035`) and the decode's `build_disagg_draft_input`
   (`spec_info.py:208`) returns None, which crashes its first draft forward.  Stand-in: both
   sides take the EAGLE hand-off for STANDALONE, the fix upstream would make; the prefill
   sends zeros for the hidden state STANDALONE's draft never reads (its draft extend returns
   none: `speculative/eagle_worker_v2.py` `_draft_extend_for_prefill`).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

TORCH_NATIVE = "torch_native"


def _topk_one(topk: int) -> None:
    if topk != 1:
        raise NotImplementedError(f"the torch_native draft stand-in is topk 1 only, not {topk}")


def patch_torch_native_backend(module: types.ModuleType) -> None:
    """Item 2: the verify pass."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    base = module.TorchNativeAttnBackend
    plain_extend = base.forward_extend

    def forward_extend(
        self: Any,
        q: Any,
        k: Any,
        v: Any,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if not forward_batch.forward_mode.is_target_verify():
            plain: torch.Tensor = plain_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
            return plain
        spec = forward_batch.spec_info
        _topk_one(spec.topk)
        if layer.is_cross_attention or (layer.sliding_window_size or -1) > -1:
            raise NotImplementedError("the torch_native verify stand-in is full self-attention")
        if save_kv_cache and k is not None and v is not None:
            where = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, where, k, v)
        drafts = spec.draft_token_num
        queries = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty((queries.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        values = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        requests = forward_batch.req_pool_indices.tolist()
        for b, (req, prefix) in enumerate(
            zip(requests, forward_batch.seq_lens.tolist(), strict=True)
        ):
            tokens = req_to_token[req, : prefix + drafts]
            # Every draft sees the whole prefix, and the drafts before it.
            mask = torch.ones(drafts, prefix + drafts, dtype=torch.bool).tril(prefix)
            rows = slice(b * drafts, (b + 1) * drafts)
            attended = scaled_dot_product_attention(
                queries[rows].movedim(0, 1).unsqueeze(0),
                keys[tokens].movedim(0, 1).to(q.dtype).unsqueeze(0),
                values[tokens].movedim(0, 1).to(q.dtype).unsqueeze(0),
                attn_mask=mask,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
                scale=layer.scaling,
            )
            out[rows] = attended.squeeze(0).movedim(1, 0)
        flat: torch.Tensor = out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        return flat

    base.forward_extend = forward_extend


@functools.cache
def draft_step_backend() -> type:
    """A torch_native backend for draft decode step `step` (item 1): its token sits at
    seq_len + step and attends to what precedes it."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchNativeDraftStep(TorchNativeAttnBackend):  # type: ignore[misc]
        def __init__(self, model_runner: Any, step: int) -> None:
            super().__init__(model_runner)
            self.step = step

        def forward_decode(
            self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True
        ) -> torch.Tensor:
            verified = forward_batch.seq_lens
            forward_batch.seq_lens = verified + self.step + 1
            try:
                out: torch.Tensor = super().forward_decode(
                    q, k, v, layer, forward_batch, save_kv_cache
                )
                return out
            finally:
                forward_batch.seq_lens = verified

    return TorchNativeDraftStep


class TorchNativeMultiStepDraft:
    """The per-step backends of one draft decode (the shape `eagle_worker_v2.py` reads:
    `attn_backends[i]` and `init_forward_metadata`)."""

    def __init__(self, model_runner: Any, topk: int, steps: int) -> None:
        _topk_one(topk)
        self.topk, self.speculative_num_steps = topk, steps
        step = draft_step_backend()
        self.attn_backends = [step(model_runner, i) for i in range(steps - 1)]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)


def patch_draft_utils(module: types.ModuleType) -> None:
    """Item 1: a torch_native entry in the factory's decode and draft-extend maps."""
    factory = module.DraftBackendFactory
    create = factory._create_backend

    def _create_backend(
        self: Any, backend_name: str, backend_map: dict[str, Any], error_template: str, **kw: Any
    ) -> Any:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        runner = self.draft_model_runner
        # only the multi-step draft decode stamps children (draft_utils.py:119); draft extend
        # may be named "decode_attention_backend" too (`--speculative-attention-mode decode`)
        if kw.get("stamps_children"):
            maker = lambda: (  # noqa: E731
                TORCH_NATIVE,
                TorchNativeMultiStepDraft(runner, self.topk, self.speculative_num_steps),
            )
        else:
            maker = lambda: (TORCH_NATIVE, TorchNativeAttnBackend(runner))  # noqa: E731
        return create(
            self, backend_name, {**backend_map, TORCH_NATIVE: maker}, error_template, **kw
        )

    factory._create_backend = _create_backend


def patch_spec_info(module: types.ModuleType) -> None:
    """Item 3, decode side: STANDALONE builds its prebuilt draft input as EAGLE does."""
    algorithm = module.SpeculativeAlgorithm
    build = algorithm.build_disagg_draft_input

    def build_disagg_draft_input(self: Any, batch: Any, last_tokens: Any, future_map: Any) -> Any:
        if self.is_standalone():
            from sglang.srt.speculative.eagle_disaggregation import build_eagle_disagg_draft_input

            return build_eagle_disagg_draft_input(batch, last_tokens, future_map)
        return build(self, batch, last_tokens, future_map)

    algorithm.build_disagg_draft_input = build_disagg_draft_input


def patch_prefill(module: types.ModuleType) -> None:
    """Item 3, prefill side: for the one method whose only algorithm checks are the two gates,
    the scheduler answers as EAGLE, and the draft's missing hidden state is zeros."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    mixin = module.SchedulerDisaggregationPrefillMixin
    process = mixin.process_batch_result_disagg_prefill

    def process_batch_result_disagg_prefill(self: Any, batch: Any, result: Any) -> Any:
        draft = getattr(result, "next_draft_input", None)
        if not self.spec_algorithm.is_standalone() or draft is None:
            return process(self, batch, result)
        if draft.hidden_states is None:
            hidden = self.disagg_metadata_buffers.output_hidden_states
            draft.hidden_states = hidden.new_zeros((draft.topk_p.shape[0], hidden.shape[1]))
        self.spec_algorithm = SpeculativeAlgorithm.EAGLE
        try:
            return process(self, batch, result)
        finally:
            self.spec_algorithm = SpeculativeAlgorithm.STANDALONE

    mixin.process_batch_result_disagg_prefill = process_batch_result_disagg_prefill


PATCHES = {
    "sglang.srt.layers.attention.torch_native_backend": patch_torch_native_backend,
    "sglang.srt.speculative.draft_utils": patch_draft_utils,
    "sglang.srt.speculative.spec_info": patch_spec_info,
    "sglang.srt.disaggregation.prefill": patch_prefill,
}
