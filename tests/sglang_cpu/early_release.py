"""The early-release decode policy: SGLang's `MetadataBuffers.get_buf` as it was before 0.5.23
cloned every field (`disaggregation/utils.py:550`).  The row's index is still freed at commit
(`disaggregation/decode.py` `pop_transferred`), while the request keeps these views until
`process_prebuilt` reads them, so a later transfer into the same row silently changes the
draft state a waiting request will start from: the seed's bug.
"""

from __future__ import annotations

import types
from typing import Any

UTILS = "sglang.srt.disaggregation.utils"


def views_get_buf(buffers: Any, idx: int) -> tuple[Any, ...]:
    """`get_buf`'s fourteen values, as views of row `idx` (None where SGLang returns None)."""
    return tuple(
        None if t is None else t[idx]
        for t in (
            buffers.output_ids, buffers.cached_tokens, buffers.output_token_logprobs_val,
            buffers.output_token_logprobs_idx, buffers.output_top_logprobs_val,
            buffers.output_top_logprobs_idx, buffers.output_token_sampling_mask_len,
            buffers.output_token_sampling_mask_idx, buffers.output_token_sampling_logprobs,
            buffers.output_topk_p, buffers.output_topk_index, buffers.output_hidden_states,
            buffers.output_dsa_topk_indices, buffers.bootstrap_room,
        )
    )  # fmt: skip


def patch(utils: types.ModuleType) -> None:
    """On a server (`SHMSLOTS_SGLANG_CPU_POLICY=early-release`): every `MetadataBuffers`
    of the process hands out views."""
    utils.MetadataBuffers.get_buf = views_get_buf
