"""The three consumption policies on SGLang 0.5.23's own decode code, same traffic, one run.

    python tools/sglang_policies.py [--requests 3000] [--slots 16] [--hidden 4096]

Needs SGLang 0.5.23 (`pip install --no-deps -r tests/sglang-0.5.23.txt`).  Requests go
through SGLang's `DecodeTransferQueue.pop_transferred` (rows landed by its `AuxDataCodec`
from its own prefill `MetadataBuffers.set_buf`) into a waiting queue, and later through its
`process_prebuilt`, which builds the EAGLE draft input; the draft each request gets is checked
against what its prefill wrote (tests/sglang_env.py sets this up).  The decode side's buffers:

* ``hold``: shmslots' plugin (`SHMSLOTS_SGLANG=1`): zero-copy views, the slot held until
  `process_prebuilt` has consumed it;
* ``clone``: SGLang 0.5.23 as shipped: `get_buf` clones every field, the index is freed at
  commit;
* ``early-release``: SGLang before it cloned (a subclass of its `MetadataBuffers` whose
  `get_buf` returns views, as older SGLang did): freed at commit, views kept — the bug.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import sglang_env as env
from sglang_cpu import early_release

TOPK = 8
POLICIES = ("hold", "clone", "early-release")


def run(policy: str, requests: int, slots: int, hidden: int, seed: int) -> dict[str, Any]:
    classes = None
    if policy != "hold":
        allocator, buffers = env.SGLANG_CLASSES["allocator"], env.SGLANG_CLASSES["buffers"]
        if policy == "early-release":
            buffers = type(
                "ViewingMetadataBuffers", (buffers,), {"get_buf": early_release.views_get_buf}
            )
        classes = (allocator, buffers)
    lane = env.Lane(slots, hidden, TOPK, classes=classes)
    rng = random.Random(seed)
    consumed = corrupted = 0
    started = time.perf_counter()
    try:
        for batch, spec in lane.drive(requests, rng, send_chance=0.8, max_batch=4):
            for i, req in enumerate(batch):
                p, index, state = env.expected_draft(int(req.rid.split("-")[1]), hidden, TOPK)
                k = spec.topk_p.shape[-1]  # the runtime's speculative_eagle_topk
                want = (p[:k], index[:k], state)
                got = (spec.topk_p[i], spec.topk_index[i], spec.hidden_states[i])
                corrupted += not all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            consumed += len(batch)
        seconds = time.perf_counter() - started
    finally:
        lane.close()
    return {"policy": policy, "requests": consumed, "seconds": seconds, "corrupted": corrupted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if env.SGLANG_MISSING:
        print(f"tools/sglang_policies.py: {env.SGLANG_MISSING}", file=sys.stderr)
        return 2
    env.load_sglang(plugin=True)
    env.start_decode_runtime(TOPK)
    shape = f"{args.slots} slots, hidden bf16[{args.hidden}], EAGLE top-k {TOPK}"
    print(f"{args.requests} requests, {shape}")
    print(f"{'policy':<14} {'requests/s':>11} {'corrupted drafts':>17}")
    for policy in POLICIES:
        r = run(policy, args.requests, args.slots, args.hidden, args.seed)
        rate = r["requests"] / r["seconds"]
        print(f"{policy:<14} {rate:>11,.0f} {r['corrupted']:>17,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
