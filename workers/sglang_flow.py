"""SGLang's prefill/decode flow on `shmslots.sglang`, call for call.

A prefill process attaches to the decode side's `MetadataBuffers` and fills each request's
slot by address (`set_buf`, a memmove per field, as an engine writes RDMA), then reports the
transfer done.  The decode side runs SGLang's calls in SGLang's order: `alloc()`, the
metadata gate (`bootstrap_room[idx, 0] != 0`), `get_buf(idx)` and the room check, then
`clear_slot(idx)` + `free(idx)` right after commit; the request waits in a queue, and
`process_prebuilt` reads its `output_topk_p[:topk]`, `output_topk_index[:topk]` and hidden
state, checked against what prefill wrote.  Some requests are aborted while their transfer
is in flight (its write still lands, late) and some while they wait.

The policy says when the slot goes back:

* ``hold``: shmslots' rule — `free` after commit is deferred; `release_consumed` after
  `process_prebuilt` (or abort) hands the slot back;
* ``clone``: SGLang 0.5.23 — copy the fields at commit, hand the slot back at once;
* ``early-release``: SGLang before 0.5.23 — keep the views and hand the slot back at commit:
  later transfers into the reused slot corrupt the waiting draft state.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from types import SimpleNamespace
from typing import Literal

import torch

from shmslots import LeakedViewWarning
from shmslots.sglang import GET_BUF_ORDER, MetadataBuffers, ReqToMetadataIdxAllocator

Policy = Literal["hold", "clone", "early-release"]
POLICIES: tuple[Policy, ...] = ("hold", "clone", "early-release")
TOPK = 8
# places in get_buf()'s tuple, SGLang's order
OUTPUT_IDS, ROOM = GET_BUF_ORDER.index("output_ids"), GET_BUF_ORDER.index("bootstrap_room")
TOPK_P, TOPK_INDEX = GET_BUF_ORDER.index("output_topk_p"), GET_BUF_ORDER.index("output_topk_index")
HIDDEN = GET_BUF_ORDER.index("output_hidden_states")
_OFF = torch.empty(0)


def row_of(buf: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
    """get_buf()'s row with each switched-off field (None) as an empty tensor, places kept."""
    return tuple(_OFF if t is None else t for t in buf)


def prefill_request(rid: int, idx: int, hidden: int) -> SimpleNamespace:
    """What prefill computed for request `rid`, as the fields SGLang's set_buf reads; every
    value a function of rid, so decode can check what it reads."""
    return SimpleNamespace(
        metadata_buffer_index=idx,
        output_ids=[rid % 50_000],
        cached_tokens=rid % 13,
        cached_tokens_device=rid % 7,
        cached_tokens_host=0,
        cached_tokens_storage=0,
        return_logprob=False,
        output_topk_p=torch.arange(TOPK, dtype=torch.float32) / (rid + 1),
        output_topk_index=torch.arange(TOPK, dtype=torch.int64) + 1000 * rid,
        hidden_states_tensor=((torch.arange(hidden) + 7 * rid) % 128).to(torch.bfloat16),
        bootstrap_room=rid + 1,  # never 0: 0 means "not arrived"
    )


def prefill(name: str, hidden: int, jobs: Queue[tuple[int, int] | None], done: Queue[int]) -> None:
    """The prefill process: fill each (idx, rid) by address, then say the transfer is done."""
    with MetadataBuffers.attach(name) as buffers:
        while (job := jobs.get(timeout=60)) is not None:
            idx, rid = job
            buffers.set_buf(prefill_request(rid, idx, hidden))
            done.put(rid)


@dataclass
class FlowConfig:
    requests: int = 2_000
    slots: int = 32
    hidden: int = 256
    policy: Policy = "hold"
    batch: int = 8
    wait_iterations: tuple[int, int] = (1, 20)
    abort_in_flight: float = 0.02  # aborted before their transfer lands (a late write)
    abort_waiting: float = 0.02  # aborted after commit, before consumption
    late_write_window_s: float = 0.5
    seed: int = 0


@dataclass
class FlowReport:
    policy: Policy
    consumed: int = 0
    corrupted: int = 0
    aborted: int = 0
    copies: int = 0
    peak_owned: int = 0
    deferred_frees: int = 0
    leaked_views: int = 0
    seconds: float = 0.0
    latencies_us: list[float] = field(default_factory=list)  # commit -> consume

    @property
    def rate(self) -> float:
        return self.consumed / self.seconds if self.seconds else 0.0

    def latency_us(self, q: float) -> float:
        ordered = sorted(self.latencies_us)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass
class _Req:
    rid: int
    metadata_buffer_index: int
    wait: int = 0
    commit_ns: int = 0
    abort_waiting: bool = False
    draft: tuple[torch.Tensor, ...] = ()  # views (hold, early-release) or clones (clone)


def decode(
    buffers: MetadataBuffers,
    allocator: ReqToMetadataIdxAllocator,
    cfg: FlowConfig,
    jobs: Queue[tuple[int, int] | None],
    done: Queue[int],
) -> FlowReport:
    """The decode scheduler: SGLang's calls, in SGLang's order, under `cfg.policy`."""
    rng = random.Random(cfg.seed)
    report = FlowReport(cfg.policy)
    in_flight: dict[int, _Req] = {}
    waiting: deque[_Req] = deque()
    next_rid, finished = 0, 0
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeakedViewWarning)  # counted by the table
        while finished < cfg.requests:
            # prealloc: a slot per new request while there is room, sent to prefill
            while next_rid < cfg.requests and (idx := allocator.alloc()) is not None:
                req = _Req(next_rid, idx)
                allocator.bind(req, idx)
                next_rid += 1
                in_flight[req.rid] = req
                jobs.put((idx, req.rid))
                if rng.random() < cfg.abort_in_flight:  # aborted; its write still lands
                    del in_flight[req.rid]
                    allocator.abort_request(req)
                    report.aborted += 1
                    finished += 1
            finished += _pop_transferred(buffers, allocator, cfg, rng, in_flight, waiting, done)
            report.peak_owned = max(report.peak_owned, cfg.slots - allocator.available_size())
            finished += _process_prebuilt(allocator, cfg, waiting, report)
    jobs.put(None)
    report.seconds = time.monotonic() - start
    report.deferred_frees = allocator.stats.deferred_frees
    report.leaked_views = buffers.table.stats().counters["leaked_views"]
    allocator.close()
    return report


def _pop_transferred(
    buffers: MetadataBuffers,
    allocator: ReqToMetadataIdxAllocator,
    cfg: FlowConfig,
    rng: random.Random,
    in_flight: dict[int, _Req],
    waiting: deque[_Req],
    done: Queue[int],
) -> int:
    """Commit every landed transfer; returns the requests that ended here."""
    try:
        rids = [done.get(timeout=0.001 if not waiting else 0)]
    except queue.Empty:
        return 0
    ended = 0
    while True:
        try:
            rids.append(done.get_nowait())
        except queue.Empty:
            break
    for rid in rids:
        req = in_flight.pop(rid, None)
        if req is None:  # aborted while in flight: its late write was quarantined
            continue
        idx = req.metadata_buffer_index
        assert buffers.bootstrap_room[idx, 0] != 0  # the metadata gate
        buf = row_of(buffers.get_buf(idx))
        if int(buf[ROOM][0]) != rid + 1:  # SGLang's room check
            allocator.abort_request(req)
            ended += 1
            continue
        buffers.clear_slot(idx)
        if cfg.policy == "clone":  # SGLang 0.5.23: its free at commit really frees
            req.draft = tuple(t.clone() for t in buf)
            del buf  # no view outlives the slot
            allocator.release(idx)
            req.metadata_buffer_index = -1
        elif cfg.policy == "early-release":  # before 0.5.23: the views stay with the request
            req.draft, buf = buf, ()
            allocator.release(idx)
            req.metadata_buffer_index = -1
        else:
            allocator.free(idx)  # SGLang frees right after commit: deferred, still ours
            req.draft, buf = buf, ()
        req.commit_ns = time.monotonic_ns()
        req.wait = rng.randint(*cfg.wait_iterations)
        req.abort_waiting = rng.random() < cfg.abort_waiting
        waiting.append(req)
    return ended


def _process_prebuilt(
    allocator: ReqToMetadataIdxAllocator,
    cfg: FlowConfig,
    waiting: deque[_Req],
    report: FlowReport,
) -> int:
    """Consume the draft state of requests whose wait is over, a batch at a time."""
    batch: list[_Req] = []
    ended = 0
    for _ in range(len(waiting)):
        req = waiting.popleft()
        req.wait -= 1
        if req.abort_waiting and req.wait <= 0:
            req.draft = ()
            allocator.abort_request(req)  # released at once (nothing if already handed back)
            report.aborted += 1
            ended += 1
        elif req.wait <= 0 and len(batch) < cfg.batch:
            batch.append(req)
        else:
            waiting.append(req)
    now = time.monotonic_ns()
    for req in batch:  # build_eagle_disagg_draft_input reads these
        report.consumed += 1
        report.corrupted += not _intact(req.draft, prefill_request(req.rid, -1, cfg.hidden))
        report.copies += len(req.draft) if cfg.policy == "clone" else 0
        report.latencies_us.append((now - req.commit_ns) / 1e3)
        req.draft = ()  # consumed: the batch holds its own copy now
    allocator.release_consumed(batch)  # hold: the slot goes back now
    return ended + len(batch)


def _intact(draft: tuple[torch.Tensor, ...], want: SimpleNamespace) -> bool:
    """Whether the draft state a request reads is what prefill wrote for it."""
    return (
        torch.equal(draft[TOPK_P][:TOPK], want.output_topk_p)
        and torch.equal(draft[TOPK_INDEX][:TOPK], want.output_topk_index)
        and torch.equal(draft[HIDDEN], want.hidden_states_tensor)
        and int(draft[OUTPUT_IDS][0]) == want.output_ids[0]
    )


def run(cfg: FlowConfig, name: str) -> FlowReport:
    """One flow: the decode side here, a spawned prefill process, a table named `name`."""
    ctx = multiprocessing.get_context("spawn")
    jobs: Queue[tuple[int, int] | None] = ctx.Queue()
    done: Queue[int] = ctx.Queue()
    # SGLang's scheduler's order: the allocator, then the buffers it hands out
    allocator = ReqToMetadataIdxAllocator(cfg.slots, late_write_window_s=cfg.late_write_window_s)
    with MetadataBuffers(cfg.slots, cfg.hidden, torch.bfloat16, 16, table_name=name) as buffers:
        proc = ctx.Process(target=prefill, args=(name, cfg.hidden, jobs, done), daemon=True)
        proc.start()
        try:
            report = decode(buffers, allocator, cfg, jobs, done)
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    if proc.exitcode != 0:
        raise RuntimeError(f"prefill process exited with {proc.exitcode}")
    return report


__all__ = [
    "POLICIES",
    "FlowConfig",
    "FlowReport",
    "Policy",
    "decode",
    "prefill",
    "row_of",
    "run",
]
