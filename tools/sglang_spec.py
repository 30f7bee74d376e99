"""The seed's symptom where users see it: SGLang's reported speculative accept length through
real prefill/decode servers on this CPU, for three decode-side policies, same traffic.

    python tools/sglang_spec.py [--requests 64] [--concurrency 32] [--max-new-tokens 4]
                                [--decode-running 2] [--decode-extra-slots 16] [--runs 1]

Needs the test environment (README, command 2).  Each policy gets its own prefill/decode pair
(STANDALONE speculative decoding, topk 1, the tiny model as its own draft; Mooncake's TCP
transfer, so only the decode's metadata rows differ) behind SGLang's router:

* ``hold``: shmslots' plugin on the decode (`SHMSLOTS_SGLANG=1`): the row is held until
  `process_prebuilt` has read it;
* ``clone``: SGLang 0.5.23 as shipped: `get_buf` clones the row, the index is freed at commit;
* ``early-release``: `get_buf` returns views, the index is still freed at commit
  (tests/sglang_cpu/early_release.py): the bug;
* ``hold, shmslots``: hold again, with shmslots' same-host backend moving the bytes (both
  servers with the plugin): the prefill lands the draft state in the decode's slot in place.

The accept length is SGLang's own: each reply's `meta_info.spec_accept_length` (weighted by its
`spec_verify_ct`) and the decode's `/get_server_info` `avg_spec_accept_length`.  A request whose
first draft comes from another request's row starts with a rejected draft; its tokens stay
right (verification is exact at temperature 0), which is why the bug raises no error.  Every
policy's tokens are checked against the first policy's, and each request's number of verify
passes against its own under hold ("slower than hold": more passes for the same tokens).

When a row can come back while its last request still waits: the decode has 2 x
`--max-running-requests` rows (`managers/scheduler.py:1570`, its pool's `size`), and up to
`--max-running-requests` + `--disaggregation-decode-extra-slots` requests at once
(`disaggregation/decode.py:171-200`); rows freed at commit go to the back of a FIFO
(`disaggregation/utils.py:376-393`).  A row is reused under a waiting request only when more
requests wait in the decode than it has rows: a small running batch with room for many
transfers (SGLang's own default headroom is 2 x the batch below 32,
`arg_groups/pd_disaggregation_hook.py:133-140`; here 8 x), and short requests, so that the
first verify pass, the one a wrong first draft spoils, weighs in the average.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sglang_cpu.harness import DECODE_FLAGS, PD_FLAGS, Deployment, free_port, generate, get
from sglang_cpu.model import make_model

PLUGIN = {"SHMSLOTS_SGLANG": "1"}
# name: (transfer backend, decode server's environment)
POLICIES = {
    "hold": ("mooncake", PLUGIN),
    "clone": ("mooncake", {}),
    "early-release": ("mooncake", {"SHMSLOTS_SGLANG_CPU_POLICY": "early-release"}),
    "hold, shmslots": ("shmslots", PLUGIN),  # the same-host backend lands the rows in place
}


def spec_flags(model: Path) -> list[str]:
    """STANDALONE, topk 1: the draft model is the target itself (2 steps, 3 draft tokens);
    a log line per decode step, at which `/get_server_info`'s average is summed; no prefix
    cache, so a request's drafts do not depend on which requests came before it (a cached
    prefix changes the prefill's arithmetic, and a random model's near-ties with it)."""
    return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(model),
            "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "3",
            "--decode-log-interval", "1", "--disable-radix-cache"]  # fmt: skip


def measure(policy: str, model: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    backend, env = POLICIES[policy]
    bootstrap = free_port()
    flags = ["--disaggregation-transfer-backend", backend,
             "--disaggregation-bootstrap-port", str(bootstrap),
             *PD_FLAGS, *spec_flags(model)]  # fmt: skip
    with Deployment(model, logs) as deployment:
        prefill = deployment.server(
            "prefill",
            "--disaggregation-mode",
            "prefill",
            *flags,
            env=env if backend == "shmslots" else None,
        )
        decode = deployment.server(
            "decode", "--disaggregation-mode", "decode", *flags, *DECODE_FLAGS,
            "--max-running-requests", str(args.decode_running),
            "--disaggregation-decode-extra-slots", str(args.decode_extra_slots), env=env,
        )  # fmt: skip
        router = deployment.router(prefill, bootstrap, decode)
        prompts = [f"request {i} says" for i in range(args.requests)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            replies = list(
                pool.map(lambda p: generate(router.url, p, args.max_new_tokens), prompts)
            )
        [state] = get(decode.url, "/get_server_info")["internal_states"]
    (logs / "replies.json").write_text(json.dumps(replies))
    verifies = sum(r["meta_info"].get("spec_verify_ct", 0) for r in replies)
    accepted = sum(
        r["meta_info"].get("spec_accept_length", 0) * r["meta_info"].get("spec_verify_ct", 0)
        for r in replies
    )
    return {
        "policy": policy,
        "outputs": [r["output_ids"] for r in replies],
        "verifies": [r["meta_info"].get("spec_verify_ct", 0) for r in replies],
        "accept": accepted / verifies if verifies else float("nan"),
        "server_accept": float(state.get("avg_spec_accept_length", "nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--decode-running", type=int, default=2)
    parser.add_argument("--decode-extra-slots", type=int, default=16)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sglang-spec-"))  # kept: the servers' logs
    print(f"servers' logs: {work}", flush=True)
    model = make_model(work / "model")
    print(
        f"tiny Llama on CPU, STANDALONE topk 1; {args.requests} requests x "
        f"{args.max_new_tokens} tokens, {args.concurrency} at a time, through the router; "
        f"decode --max-running-requests {args.decode_running}"
    )
    print(
        f"{'run':>3} {'policy':<16}{'accept length':>14}{'server avg':>11}"
        f"{'tokens':>10}{'slower than hold':>18}"
    )
    for run in range(1, args.runs + 1):
        hold: dict[str, Any] = {}
        for policy in POLICIES:
            logs = work / f"{run}-{policy.replace(', ', '-')}"
            logs.mkdir()
            r = measure(policy, model, logs, args)
            hold = hold or r
            same = "same" if r["outputs"] == hold["outputs"] else "DIFFERENT"
            slower = sum(v > h for v, h in zip(r["verifies"], hold["verifies"], strict=True))
            print(
                f"{run:>3} {policy:<16}{r['accept']:>14.3f}{r['server_accept']:>11.3f}"
                f"{same:>10}{slower:>18}",
                flush=True,
            )


if __name__ == "__main__":
    main()
