# python examples/sglang_decode.py [TABLE]
"""SGLang's decode-side calls on shmslots.sglang, with a prefill process writing by address."""

import multiprocessing as mp
import sys
from types import SimpleNamespace

import torch

from shmslots.sglang import MetadataBuffers, ReqToMetadataIdxAllocator


def prefill(name: str, idx: int, room: int) -> None:
    """The prefill side: fills index `idx` by address, as a transfer engine does."""
    with MetadataBuffers.attach(name) as buffers:
        req = SimpleNamespace(
            metadata_buffer_index=idx,
            output_ids=[1234],
            cached_tokens=0,
            cached_tokens_device=0,
            cached_tokens_host=0,
            cached_tokens_storage=0,
            return_logprob=False,
            output_topk_p=torch.tensor([0.5, 0.25]),
            output_topk_index=torch.tensor([17, 42]),
            hidden_states_tensor=torch.full((256,), 0.25, dtype=torch.bfloat16),
            bootstrap_room=room,
        )
        buffers.set_buf(req)  # ptrs[i] + item_lens[i] * idx, field by field


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "sglang-decode"
    # SGLang's scheduler's order: the allocator, then the buffers (the last is
    # max_sampling_mask_tokens, for when SGLANG_ENABLE_DISAGG_SAMPLING_MASK is on)
    allocator = ReqToMetadataIdxAllocator(4)
    with MetadataBuffers(4, 256, torch.bfloat16, 16, table_name=name) as buffers:
        req = SimpleNamespace(metadata_buffer_index=allocator.alloc(), bootstrap_room=77)
        allocator.bind(req, req.metadata_buffer_index)  # the plugin binds SGLang's Req
        engine = mp.get_context("spawn").Process(
            target=prefill, args=(name, req.metadata_buffer_index, req.bootstrap_room)
        )
        engine.start()
        engine.join(60)
        idx = req.metadata_buffer_index
        assert buffers.bootstrap_room[idx, 0] != 0  # the metadata gate: it has arrived
        # pop_transferred: commit (no copy), room check, then SGLang frees at once
        output_ids, *logprobs, topk_p, topk_index, hidden, dsa, room = buffers.get_buf(idx)
        assert dsa is None  # switched off; the sampling mask too (three more Nones)
        assert output_ids is not None and topk_p is not None and topk_index is not None
        assert hidden is not None and room is not None
        assert int(room[0]) == req.bootstrap_room
        buffers.clear_slot(idx)
        allocator.free(idx)  # deferred: the request still owns its row
        print(f"after free: {allocator.available_size()} of 4 free, row still held")
        # ... the request waits; other transfers cannot land in its slot ...
        # process_prebuilt: build the draft input from the views, then let go of them
        token = int(output_ids[0])
        draft = (topk_p[:2].tolist(), topk_index[:2].tolist(), hidden[0].item())
        del output_ids, logprobs, topk_p, topk_index, hidden, room
        allocator.release_consumed([req])  # the one call SGLang lacks
        print(f"token {token} draft {draft}; after release: {allocator.available_size()} of 4 free")
    return 0 if engine.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
