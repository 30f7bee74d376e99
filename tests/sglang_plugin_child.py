"""A decode scheduler process in miniature, for test_sglang_upstream: SGLang's `load_plugins()`
with or without `SHMSLOTS_SGLANG=1`, the classes its scheduler module then names, and (plugin
on) three requests through the patched `pop_transferred`, `process_prebuilt` and
`_release_aborted_request`.  Prints one JSON line."""

from __future__ import annotations

import json
import os

import sglang_env as env
import torch


def main() -> None:
    plugin = os.environ.get("SHMSLOTS_SGLANG") == "1"
    env.load_sglang(plugin=plugin)
    env.start_decode_runtime()
    from sglang.srt.managers import scheduler
    from sglang.srt.runtime_context import get_disagg

    got: dict[str, object] = {}
    for side in ("prefill", "decode"):
        with get_disagg().override(disaggregation_mode=side):
            allocator = scheduler.ReqToMetadataIdxAllocator(4)
            buffers = scheduler.MetadataBuffers(
                4,
                hidden_size=64,
                hidden_states_dtype=torch.bfloat16,
                max_sampling_mask_tokens=16,
            )
            got[side] = [type(allocator).__name__, type(buffers).__name__]
            got[f"{side}_module"] = type(buffers).__module__
            if hasattr(buffers, "close"):
                buffers.close()
    if plugin:
        lane = env.Lane(4, 64, 4)
        for rid in range(3):
            lane.land(lane.send(rid))
        reqs = lane.pop()
        lane.prebuild(reqs[:2])
        lane.abort_waiting(reqs[2])
        stats = lane.allocator.stats
        got["flow"] = {
            "committed": stats.committed,
            "released": stats.released,
            "aborted_after_commit": stats.aborted_after_commit,
            "free": lane.allocator.available_size(),
        }
        lane.close()
    print(json.dumps(got))


if __name__ == "__main__":
    main()
