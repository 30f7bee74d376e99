"""STANDALONE speculative decoding (topk 1) as SGLang 0.5.23 defines it, in a few lines of
transformers, as a reference that shares no code with the servers' stand-ins.

The target decodes greedily.  Each verify pass checks `steps` drafts, taken greedily from the
same model, which never sees the request's first token: SGLang's draft-extend shifts its
input ids left by one (`speculative/eagle_worker_v2.py` `_draft_extend_for_prefill`).  The
pass keeps the drafts up to the first the target disagrees with, then the target's own token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM


def verify_passes(
    model_dir: Path, prompts: list[str], steps: int, max_new_tokens: int
) -> list[tuple[list[int], int]]:
    """For each prompt: the tokens generated and the number of verify passes it took."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train(False)  # inference: no dropout
    eos = model.config.eos_token_id

    @torch.no_grad()
    def greedy(ids: list[int]) -> int:
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    results = []
    for prompt in prompts:
        seq = tokenizer(prompt)["input_ids"]
        out = [greedy(seq)]  # the prefill's token
        seq = [*seq, out[0]]
        passes = 0
        while len(out) < max_new_tokens and out[-1] != eos:
            drafts: list[int] = []
            for _ in range(steps):
                drafts.append(greedy(seq[1:] + drafts))
            passes += 1
            for draft in drafts:
                token = greedy(seq)
                out.append(token)
                seq.append(token)
                if token != draft or token == eos or len(out) == max_new_tokens:
                    break
            else:
                if len(out) < max_new_tokens:  # every draft accepted: the bonus token
                    token = greedy(seq)
                    out.append(token)
                    seq.append(token)
        results.append((out, passes))
    return results
