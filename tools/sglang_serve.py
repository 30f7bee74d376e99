"""Prefill and decode on one host, as users run them: real SGLang 0.5.23 servers on this CPU
behind SGLang's router, the shmslots backend beside Mooncake's (TCP on loopback), one run.

    python tools/sglang_serve.py [--prompt-tokens 512] [--max-new-tokens 64]
                                 [--requests 24] [--concurrency 4] [--ttft-samples 8]
                                 [--runs 1]

Needs the test environment (README, command 2).  For each setup it starts a prefill/decode
pair and the router with tests/sglang_cpu's harness (the tiny random Llama, the CPU flags,
the strict stand-ins), then measures through the router:

* time to first token: `--ttft-samples` streamed `/generate` requests one at a time, from
  sending to the first streamed chunk;
* tokens/s: `--requests` requests, `--concurrency` at a time, each generating exactly
  `--max-new-tokens` (`ignore_eos`), output tokens over wall time.

Three pairs, one after the other, never together: the shmslots backend (with the plugin,
`SHMSLOTS_SGLANG=1`, which it needs), Mooncake with the plugin (the plugin's share of any
difference), and Mooncake as SGLang ships it.  Each run starts the three in another order
(run k with the k-th setup first), so no setup always meets the machine first.
The model is tiny, so the figures weigh the transfer and scheduling path, not the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sglang_cpu.harness import (
    DECODE_FLAGS,
    PD_FLAGS,
    Deployment,
    Process,
    free_port,
    generate,
    post,
)
from sglang_cpu.model import make_model

PLUGIN = {"SHMSLOTS_SGLANG": "1"}
# name: (transfer backend, server environment)
SETUPS = {
    "shmslots": ("shmslots", PLUGIN),
    "mooncake+plugin": ("mooncake", PLUGIN),  # the plugin's share of any difference
    "mooncake": ("mooncake", {}),  # SGLang as shipped
}


def first_token_s(url: str, prompt: str) -> float:
    """Seconds from sending a streamed /generate to its first chunk."""
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}  # fmt: skip
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                first = time.perf_counter() - start
                reply.read()  # the rest of the stream, so the request ends normally
                return first
    raise RuntimeError("the stream ended with no chunk")


def tokens_per_s(url: str, prompts: list[str], concurrency: int, max_new_tokens: int) -> float:
    def one(prompt: str) -> int:
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        reply = post(url, "/generate", {"text": prompt, "sampling_params": sampling})
        return len(reply["output_ids"])

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        produced = sum(pool.map(one, prompts))
    return produced / (time.perf_counter() - start)


def measure(setup: str, model: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    backend, env = SETUPS[setup]
    bootstrap = free_port()
    flags = ["--disaggregation-transfer-backend", backend,
             "--disaggregation-bootstrap-port", str(bootstrap), *PD_FLAGS]  # fmt: skip
    (logs / setup).mkdir(parents=True)
    with Deployment(model, logs / setup) as deployment:
        started = time.perf_counter()
        prefill = deployment.server("prefill", "--disaggregation-mode", "prefill", *flags, env=env)
        decode: Process = deployment.server(
            "decode", "--disaggregation-mode", "decode", *flags, *DECODE_FLAGS, env=env
        )
        router = deployment.router(prefill, bootstrap, decode)
        up_s = time.perf_counter() - started
        prompts = [prompt(i, args.prompt_tokens) for i in range(args.requests)]
        warm = generate(router.url, prompts[0], 4)  # the first request builds what stays
        prompt_tokens = int(warm["meta_info"]["prompt_tokens"])
        ttft = [first_token_s(router.url, p) for p in prompts[: args.ttft_samples]]
        rate = tokens_per_s(router.url, prompts, args.concurrency, args.max_new_tokens)
    return {"setup": setup, "up_s": up_s, "ttft": ttft, "tokens_per_s": rate,
            "prompt_tokens": prompt_tokens}  # fmt: skip


def prompt(i: int, tokens: int) -> str:
    """A prompt of about `tokens` tokens (this vocabulary gives about 4 a word), each its own."""
    return " ".join(f"w{i}x{j}" for j in range(max(1, tokens // 4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--ttft-samples", type=int, default=8)
    parser.add_argument("--runs", type=int, default=1, help="each in another setup order")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sglang-serve-"))  # kept: the servers' logs
    print(f"servers' logs: {work}", flush=True)
    model = make_model(work / "model")
    for run in range(args.runs):
        order = [*SETUPS][run % len(SETUPS) :] + [*SETUPS][: run % len(SETUPS)]
        done = {setup: measure(setup, model, work / f"run{run + 1}", args) for setup in order}
        report(run + 1, order, [done[setup] for setup in SETUPS], args)


def report(
    run: int, order: list[str], results: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    """One run's table, in SETUPS' order, and each setup against SGLang as shipped."""
    print(
        f"run {run} (in the order {', '.join(order)}): tiny Llama on CPU; prompts of "
        f"{results[0]['prompt_tokens']} tokens (the first); {args.requests} requests x "
        f"{args.max_new_tokens} tokens, {args.concurrency} at a time; time to first token "
        f"over {args.ttft_samples} streamed requests, one at a time"
    )
    print(f"{'setup':<17}{'up s':>6}{'TTFT p50 ms':>13}{'TTFT max ms':>13}{'tokens/s':>10}")
    for r in results:
        ttft = r["ttft"]
        print(
            f"{r['setup']:<17}{r['up_s']:>6.1f}{statistics.median(ttft) * 1e3:>13.1f}"
            f"{max(ttft) * 1e3:>13.1f}{r['tokens_per_s']:>10.1f}"
        )
    shipped = results[-1]
    for r in results[:-1]:
        ttft_ratio = statistics.median(r["ttft"]) / statistics.median(shipped["ttft"])
        rate_ratio = r["tokens_per_s"] / shipped["tokens_per_s"]
        print(f"{r['setup']} / mooncake: TTFT p50 {ttft_ratio:.2f}x, tokens/s {rate_ratio:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
