"""SGLang's decode-side commit path per request: shmslots' buffers against SGLang 0.5.23's own.

    python tools/bench.py sglang [--requests 20000] [--runs 5] [--hidden 4096]

Needs SGLang 0.5.23 (`pip install --no-deps -r tests/sglang-0.5.23.txt`).  One request's
metadata life on the decode side, as SGLang's scheduler calls it, the row already landed:

* SGLang: `alloc()`, `get_buf(idx)` (clones its 14 fields), `clear_slot(idx)`, `free(idx)`;
* shmslots: `alloc()`, `get_buf(idx)` (commits in place, zero-copy views), `clear_slot(idx)`,
  `free(idx)` (deferred), then the release after consumption (`release_consumed`).

Both with EAGLE's fields (hidden state bf16[--hidden]), in one process, one after the other,
each run alternating; prints µs per request (median, min-max of the runs) and the ratio,
then shmslots' calls each timed on its own.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import command_parser

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import sglang_env


class _Req:
    """Stands for SGLang's `Req`: a plain class, so weakly referenceable as SGLang's is."""


def _sglang_requests(utils: Any, n: int, hidden: int) -> float:
    allocator = utils.ReqToMetadataIdxAllocator(64)
    buffers = utils.MetadataBuffers(
        64, hidden_size=hidden, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=16
    )
    start = time.perf_counter_ns()
    for _ in range(n):
        idx = allocator.alloc()
        row = buffers.get_buf(idx)
        buffers.clear_slot(idx)
        allocator.free(idx)
        del row
    return (time.perf_counter_ns() - start) / n / 1000


@contextlib.contextmanager
def _decode_side(hidden: int, name: str) -> Iterator[tuple[Any, Any]]:
    """shmslots' allocator and buffers, built as SGLang's scheduler builds its own."""
    from shmslots.sglang import MetadataBuffers, ReqToMetadataIdxAllocator

    allocator = ReqToMetadataIdxAllocator(64)
    with MetadataBuffers(
        64,
        hidden_size=hidden,
        hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=16,
        table_name=name,
    ) as buffers:
        yield allocator, buffers


def _shmslots_requests(n: int, hidden: int, name: str) -> float:
    with _decode_side(hidden, name) as (allocator, buffers):
        req = _Req()
        start = time.perf_counter_ns()
        for _ in range(n):
            idx = allocator.alloc()
            assert idx is not None
            allocator.bind(req, idx)
            row = buffers.get_buf(idx)
            buffers.clear_slot(idx)
            allocator.free(idx)
            del row  # process_prebuilt has consumed the draft state
            allocator.release_consumed([req])
        return (time.perf_counter_ns() - start) / n / 1000


def shmslots_steps(n: int, hidden: int, name: str) -> dict[str, float]:
    """µs per call of shmslots' side, each call timed on its own (a timer read included)."""
    steps = ("alloc", "bind the request", "get_buf", "clear_slot + free", "release_consumed")
    spent = dict.fromkeys(steps, 0)
    clock = time.perf_counter_ns
    with _decode_side(hidden, name) as (allocator, buffers):
        req = _Req()
        for _ in range(n):
            t0 = clock()
            idx = allocator.alloc()
            t1 = clock()
            assert idx is not None
            allocator.bind(req, idx)
            t2 = clock()
            row = buffers.get_buf(idx)
            t3 = clock()
            buffers.clear_slot(idx)
            allocator.free(idx)
            t4 = clock()
            del row
            allocator.release_consumed([req])
            t5 = clock()
            for step, took in zip(
                steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
            ):
                spent[step] += took
    return {step: ns / n / 1000 for step, ns in spent.items()}


def missing() -> str | None:
    """Why SGLang's side cannot be measured here, or None."""
    return sglang_env.SGLANG_MISSING


def measure(requests: int, runs: int, hidden: int = 4096) -> tuple[list[float], list[float]]:
    """µs per request of each run, SGLang's and shmslots', alternating; SGLang must be
    installed (`sglang_env.SGLANG_MISSING` is None)."""
    sglang_env.install_torchvision_stand_in()
    from sglang.srt.disaggregation import utils

    theirs: list[float] = []
    ours: list[float] = []
    for run in range(runs):
        name = f"shmslots-bench-sglang-{os.getpid()}-{run}"
        theirs.append(_sglang_requests(utils, requests, hidden))
        ours.append(_shmslots_requests(requests, hidden, name))
    return theirs, ours


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("sglang", __doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
    if sglang_env.SGLANG_MISSING:
        print(f"tools/bench.py sglang: {sglang_env.SGLANG_MISSING}", file=sys.stderr)
        return 2
    theirs, ours = measure(args.requests, args.runs, args.hidden)

    def line(label: str, xs: list[float]) -> str:
        return f"{label:<44} {statistics.median(xs):7.2f} µs  ({min(xs):.2f}-{max(xs):.2f})"

    print(f"{args.requests} requests a run, {args.runs} runs, hidden bf16[{args.hidden}]")
    print(line("SGLang 0.5.23 (alloc, get_buf clone, clear, free)", theirs))
    print(line("shmslots (alloc, get_buf views, clear, free, release)", ours))
    ratio = statistics.median(theirs) / statistics.median(ours)
    print(f"SGLang / shmslots per request: {ratio:.2f}x (target >= 4x)")
    print("shmslots' calls, each timed on its own (µs, a timer read included):")
    name = f"shmslots-bench-sglang-{os.getpid()}-steps"
    for step, us in shmslots_steps(args.requests, args.hidden, name).items():
        print(f"  {step:<42} {us:7.2f}")
    return 0
