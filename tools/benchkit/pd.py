"""Prefill to decode on one host through SGLang 0.5.23's own managers: shmslots' same-host
backend against SGLang's Mooncake manager (TCP), its NIXL manager (UCX with its defaults, and
with shared-memory transports and CMA allowed), and a memcpy floor.

    python tools/bench.py pd [--layers 32] [--requests 24] [--runs 3]

Needs SGLang 0.5.23 (`pip install --no-deps -r tests/sglang-0.5.23.txt`) and, for the Mooncake
and NIXL columns, the Mooncake wheel with Debian's libibverbs1 and the `nixl-cu12` wheel (the
test extra; each skipped, saying so, without it).  The harness is the tests'
(tests/pd_env.py): a prefill and a decode process, each running SGLang's manager, sender,
receiver and bootstrap server, looked up by `get_kv_class` under the backend's name, over CPU
KV of a Llama-3-8B-like layout (32 layers, 8 KV heads, head dim 128, bf16, page size 64;
`--layers` fewer, for memory: a 1k-token request is 4 MiB a layer, an 8k one 32 MiB, and
each side holds one more request than it has in flight), aux rows in the plugin's table.
Bytes are moved, not filled or checked (the tests check them).

Reported per backend and request size (1k and 8k tokens): GB/s of KV moved, requests/s, p50
and p99 from the prefill's send to the decode's Success; then, with a prefill SIGKILLed
mid-transfer, the time from the kill until decode has the pages of the rooms it had begun
back (SGLang's heartbeat: 2 x 5 s, then its 30 s deferred release).  The floor is a
request's bytes copied by one process, each entry's pages as one run (torch's `copy_`,
cached stores, its intra-op threads); the harness's decode takes pages from a free list, as
SGLang's does, so its blocks are often a page each.  Beside the floor, the engine alone: the
floor's runs moved by the same-host engine, which streams them past the cache (so it can
beat the floor), as many calls at once as requests in flight, with no SGLang manager,
harness or decode taking CPU beside it; the engine's own cost of a call, one 64-byte block
at a time; and an aux row's call (14 blocks), alone and beside a busy Python thread.
For NIXL the harness enters the `nixl-cu12` wheel under the `nixl` name SGLang imports, and
labels the KV pools "DRAM", as SGLang labels a host pool (it says "VRAM" for every other pool,
which UCX without CUDA refuses at registration).  NIXL's UCX backend asks UCX for peer failure
handling by default, which no shared-memory transport (posix, sysv, cma) offers, so it runs
over TCP on loopback; `nixl+cma` is the same manager with SGLang's own knob for its backend's
parameters, `SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS='{"ucx_error_handling_mode": "none"}'`,
which lets UCX pick shared memory and CMA (and gives up its detection of a dead peer).
Mooncake's manager sends a request's pages of every layer in one batch by default, and at 8k
tokens of 16 or 32 layers (512 MiB, 1 GiB) its TCP transport refuses that batch ("TCP lane
queue-full rejection") and the request never completes (at 8 layers, 256 MiB, it does).
So Mooncake alone runs with SGLang's knob for batches of pages,
`SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`, at the most pages that make 256 MiB (32 at 32
layers): a 1k-token request stays one batch, an 8k one is four.  (This backend's manager
is Mooncake's and would split its calls by the same knob: it runs without it.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import command_parser

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import pd_env
import sglang_env

from shmslots.sglang import samehost

TOKENS = (1024, 8192)


NIXL_CMA = '{"ucx_error_handling_mode": "none"}'
MOONCAKE_BATCH_BYTES = 256 << 20  # the largest batch Mooncake's TCP transport completed here


def _shape(backend: str, layers: int, tokens: int, window: int) -> pd_env.Shape:
    pages = tokens // 64
    shape = pd_env.Shape(
        layers=layers, page_size=64, heads=8, head_dim=128, pages=pages * (window + 1),
        backend=backend.split("+")[0], slots=max(8, 2 * window), verify=False,
        nixl_params=NIXL_CMA if backend == "nixl+cma" else "",
    )  # fmt: skip
    if backend != "mooncake":
        return shape
    page_bytes = shape.entries * shape.item_len  # a page of every entry
    return dataclasses.replace(shape, mooncake_batch=max(1, MOONCAKE_BATCH_BYTES // page_bytes))


def _throughput(shape: pd_env.Shape, requests: int, window: int) -> dict[str, float]:
    pages = shape.pages // (window + 1)
    with pd_env.Pair(shape) as pair:
        pair.start_prefill()
        pair.start_decode()
        # connect, and warm every page of both pools: a prefill maps and populates each part
        # of a decode's pool on its first write there (about 0.3 s a GiB here), and a decode
        # hands freed pages out again first, so rooms one at a time would warm one room's
        warm = list(range(1, window + 2))
        pair.submit(warm, pages, len(warm))
        pair.reply(pair.prefill)
        pair.reply(pair.decode)
        rooms = list(range(100, 100 + requests))
        start = time.monotonic()
        pair.submit(rooms, pages, window)
        _, _, _, sent_at = pair.reply(pair.prefill, 600)
        _, outcomes = pair.reply(pair.decode, 600)
        elapsed = max(o.landed_at for o in outcomes.values()) - start
    ok = [o for o in outcomes.values() if o.status == "Success"]
    moved = len(ok) * pages * shape.entries * shape.item_len
    latency = sorted(o.landed_at - sent_at[o.room] for o in ok)
    return {
        "ok": len(ok),
        "GB/s": moved / elapsed / 1e9,
        "req/s": len(ok) / elapsed,
        "p50_ms": 1e3 * latency[len(latency) // 2],
        "p99_ms": 1e3 * latency[min(len(latency) - 1, int(0.99 * len(latency)))],
    }


def _kill_to_release(shape: pd_env.Shape, window: int) -> float:
    """Seconds from a prefill's SIGKILL to the last of its failed rooms released at decode:
    those the decode had begun before the kill (one begun after fails at its handshake)."""
    pages = shape.pages // (window + 1)
    with pd_env.Pair(shape) as pair:
        pair.start_prefill()
        pair.start_decode()
        pair.submit(list(range(1, 10_000)), pages, window)
        pair.wait_until(pair.sent, 3, 120)
        proc = pair.prefill_procs[0]
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        _, outcomes = pair.reply(pair.decode, 120)
    failed = [o.released_at for o in outcomes.values() if o.released_at and o.began_at < killed]
    return max(failed) - killed if failed else float("nan")


def _floor(shape: pd_env.Shape, runs: int) -> float:
    """GB/s of the same page runs copied within one process."""
    pages = shape.pages // 2
    src = [
        torch.ones(shape.pages * shape.item_len, dtype=torch.uint8) for _ in range(shape.entries)
    ]
    dst = [torch.zeros_like(t) for t in src]
    n = pages * shape.item_len
    rates = []
    for _ in range(runs * 5):
        start = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            d[:n].copy_(s[n : 2 * n])
        rates.append(n * shape.entries / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


@contextlib.contextmanager
def _engine_pair(
    name: str, sources: list[torch.Tensor], targets: list[torch.Tensor]
) -> Iterator[tuple[samehost.SameHostEngine, str]]:
    """A prefill's engine with `sources` registered and the session of a decode's engine
    with `targets` registered (moved onto its memfds), both in this process: the copy is the
    same memmove into the decode's memfd through a mapping of the prefill's own."""
    tag = f"{samehost.PREFIX}bench-{name}-{os.getpid()}"
    with (
        samehost.SameHostEngine(tag + "-d") as decode,
        samehost.SameHostEngine(tag + "-p", receives=False) as prefill,
    ):
        decode.batch_register([t.data_ptr() for t in targets], [t.numel() for t in targets])
        prefill.batch_register([t.data_ptr() for t in sources], [t.numel() for t in sources])
        yield prefill, decode.get_session_id()


def _engine_alone(shape: pd_env.Shape, callers: int, runs: int) -> float:
    """GB/s of the same page runs moved by the same-host engine alone, `callers` threads
    calling at once (as SGLang's transfer queues do, each call a request's pages of every
    entry): the backend's own rate, with no SGLang manager, harness or decode beside it."""
    pages = shape.pages // (callers + 1)
    n = pages * shape.item_len
    size = n * callers + (1 << 20)  # the first MiB stays clear of the pool's unshared head
    src = [torch.ones(size, dtype=torch.uint8) for _ in range(shape.entries)]
    dst = [torch.zeros(size, dtype=torch.uint8) for _ in range(shape.entries)]
    rates = []
    with _engine_pair("alone", src, dst) as (prefill, session):
        calls = [
            [(s.data_ptr() + (1 << 20) + c * n, d.data_ptr() + (1 << 20) + c * n, n)
             for s, d in zip(src, dst, strict=True)]
            for c in range(callers)
        ]  # fmt: skip

        def call(blocks: list[tuple[int, int, int]], times: int) -> None:
            sources, targets, lengths = zip(*blocks, strict=True)
            for _ in range(times):
                prefill.transfer(session, sources, targets, lengths)

        for _ in range(runs * 5):
            threads = [threading.Thread(target=call, args=(c, 4)) for c in calls]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rates.append(4 * n * shape.entries * callers / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def _call_us(runs: int, blocks: int = 1, busy: bool = False) -> float:
    """Microseconds a transfer call of `blocks` 64-byte blocks takes (one: the engine's own
    cost of a call, its peer's liveness, planning and dispatch, apart from its bytes; 14: an
    aux row, one block per metadata buffer), by median of batches; with `busy`, beside a
    Python thread that never waits (as SGLang's scheduler thread is at times), where every
    time a call lets the GIL go it may wait up to a switch interval (5 ms) to get it back."""
    src = torch.ones(1 << 20, dtype=torch.uint8)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    at = [65536 + 256 * i for i in range(blocks)]  # on the memfd
    call = ([src.data_ptr() + a for a in at], [dst.data_ptr() + a for a in at], [64] * blocks)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    times = []
    spinner = threading.Thread(target=spin)
    calls = 20 if busy else 1000  # a batch, timed whole
    with _engine_pair("call", [src], [dst]) as (prefill, session):
        if busy:
            spinner.start()
        try:
            for _ in range(runs * 5):
                start = time.perf_counter()
                for _ in range(calls):
                    prefill.transfer(session, *call)
                times.append((time.perf_counter() - start) * 1e6 / calls)
        finally:
            stop.set()
            if busy:
                spinner.join()
    return statistics.median(times)


def _missing(backend: str) -> str | None:
    """Why SGLang's `backend` manager cannot run here, or None."""
    try:
        if backend == "mooncake":
            import mooncake.engine  # noqa: F401
        else:
            import nixl_cu12  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"{backend} unavailable here ({exc})"
    return None


def main(argv: list[str]) -> int:
    parser = command_parser("pd", __doc__)
    parser.add_argument("--layers", type=int, default=32, help="fewer than 32, for memory")
    parser.add_argument("--requests", type=int, default=24, help="requests a run (1k tokens)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=int, default=4, help="requests in flight")
    args = parser.parse_args(argv)
    if sglang_env.SGLANG_MISSING:
        print(sglang_env.SGLANG_MISSING, file=sys.stderr)
        return 2
    backends = ["shmslots"]
    for peer in ("mooncake", "nixl"):
        missing = _missing(peer)
        if missing is None:
            backends += [peer, "nixl+cma"] if peer == "nixl" else [peer]
        else:
            print(f"{peer}: skipped: {missing}")
    print(
        f"KV: {args.layers} layers x K,V x 8 heads x 128 dim, bf16, page 64; "
        f"{args.window} requests in flight for {TOKENS[0]} tokens, 1 for {TOKENS[1]}; "
        f"{args.runs} runs; median (lowest-highest); Mooncake in batches of "
        f"{_shape('mooncake', args.layers, TOKENS[0], 1).mooncake_batch} pages"
    )
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    floors: dict[int, float] = {}
    alone: dict[int, float] = {}
    windows = {TOKENS[0]: args.window, TOKENS[1]: 1}
    for tokens in TOKENS:
        window = windows[tokens]
        requests = args.requests if tokens == TOKENS[0] else max(4, args.requests // 6)
        floors[tokens] = _floor(_shape("shmslots", args.layers, tokens, 1), args.runs)
        alone[tokens] = _engine_alone(
            _shape("shmslots", args.layers, tokens, window), window, args.runs
        )
        for _ in range(args.runs):  # backends alternate within each run
            for backend in backends:
                shape = _shape(backend, args.layers, tokens, window)
                results.setdefault((backend, tokens), []).append(
                    _throughput(shape, requests, window)
                )
    print(f"{'backend':<10}{'tokens':>7}{'GB/s':>22}{'req/s':>20}{'p50 ms':>12}{'p99 ms':>12}")
    for (backend, tokens), rows in results.items():
        print(
            f"{backend:<10}{tokens:>7}{_spread(rows, 'GB/s'):>22}{_spread(rows, 'req/s'):>20}"
            f"{statistics.median(r['p50_ms'] for r in rows):>12.1f}"
            f"{statistics.median(r['p99_ms'] for r in rows):>12.1f}"
        )
    rate = {key: statistics.median(r["GB/s"] for r in rows) for key, rows in results.items()}
    for tokens in TOKENS:
        ours = rate[("shmslots", tokens)]
        line = f"{tokens} tokens: memcpy floor {floors[tokens]:.2f} GB/s, shmslots at "
        line += f"{floors[tokens] / ours:.2f}x the floor (target <= 1.5x)"
        peers = (("mooncake", "Mooncake", 10), ("nixl", "NIXL", 2), ("nixl+cma", "NIXL+CMA", 2))
        for peer, name, target in peers:
            if (peer, tokens) in rate:
                line += f"; {ours / rate[(peer, tokens)]:.1f}x {name} (target >= {target}x)"
        print(line)
        line = (
            f"{tokens} tokens: the engine alone, {windows[tokens]} "
            f"call(s) at once: {alone[tokens]:.2f} GB/s, {floors[tokens] / alone[tokens]:.2f}x "
            "the floor"
        )
        if ("mooncake", tokens) in rate:  # what the copies could give with nothing beside
            line += f", {alone[tokens] / rate[('mooncake', tokens)]:.1f}x Mooncake"
        print(line)
    print(f"the engine's own cost of a call (one 64-byte block): {_call_us(args.runs):.1f} us")
    print(
        f"an aux row's call (14 blocks): {_call_us(args.runs, 14):.1f} us alone, "
        f"{_call_us(args.runs, 14, busy=True):.1f} us beside a busy Python thread"
    )
    for backend in backends:
        shape = _shape(backend, args.layers, TOKENS[0], args.window)
        print(
            f"{backend}: prefill SIGKILLed mid-transfer -> decode has its pages back in "
            f"{_kill_to_release(shape, args.window):.3f} s (target <= 0.1 s)"
        )
    return 0


def _spread(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
