"""SGLang 0.5.23's disaggregation metadata buffers on shmslots, and the plugin that installs them.

`buffers` holds the two classes, callable exactly as SGLang calls them; `plugin` makes SGLang's
own scheduler build them (`SHMSLOTS_SGLANG=1`).  Neither imports SGLang until the plugin is
switched on.  Every SGLang 0.5.23 call site they serve:

- `managers/scheduler.py`, `Scheduler.init_disaggregation`: `ReqToMetadataIdxAllocator(
  buffer_size)`, then `MetadataBuffers(buffer_size, hidden_size=, hidden_states_dtype=,
  max_sampling_mask_tokens=, custom_mem_pool=, output_dsa_topk_indices_dim=,
  kv_checksum_enabled=)`; `disagg_metadata_buffers.enable_sampling_mask`;
- `disaggregation/decode.py`, `DecodePreallocQueue`: `get_buf_infos()` (the receiver's aux
  buffers), `available_size()`, `alloc()` (`_send_kv_metadata`);
- `disaggregation/utils.py`, `_apply_metadata_gate`: `bootstrap_room[idx, 0].item()`;
- `DecodeTransferQueue._commit_transfer_to_req`: `get_kv_checksum(idx)`, `get_buf(idx)` (14
  values);
- `DecodeTransferQueue.pop_transferred` and `_do_release`: `clear_slot(idx)`, `free(idx)`;
- `disaggregation/prefill.py` (a prefill side attached on the same machine):
  `get_buf_infos()`, `available_size()`, `alloc()`, `free()`, `set_buf(req)`,
  `set_kv_checksum(req, digest, signature)`.
"""

from .buffers import (
    GET_BUF_ORDER,
    SGLANG_VERSION,
    AllocatorStats,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    metadata_fields,
)

__all__ = [
    "GET_BUF_ORDER",
    "SGLANG_VERSION",
    "AllocatorStats",
    "MetadataBuffers",
    "ReqToMetadataIdxAllocator",
    "metadata_fields",
]
