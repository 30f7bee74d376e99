"""`shmslots.sglang`'s own API, beyond what SGLang's code can drive here.

A prefill side attached by name in another process, writes by address (`write_by_address`),
a decode side SIGKILLed holding rows, strict refusals, the three policies under load, and
the request-level calls on requests bound with `bind()`.  The calls are SGLang 0.5.23's, in
its order, but SGLang is not running: these test shmslots' rules, not compatibility.  SGLang's
own code runs against the same classes in test_sglang_upstream.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from typing import Any

import pytest
import torch
from conftest import SPAWN, Children
from shmslots.workers import sglang_flow
from shmslots.workers.sglang_flow import (
    HIDDEN,
    ROOM,
    TOPK,
    TOPK_INDEX,
    TOPK_P,
    prefill_request,
    row_of,
)

from shmslots import (
    Field,
    IncompatibleTable,
    InvalidSlot,
    LeakedViewWarning,
    OwnershipError,
    SchemaError,
    SlotTable,
    State,
    TableClosed,
)
from shmslots.sglang import (
    SGLANG_VERSION,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    metadata_fields,
)

HIDDEN_SIZE = 256
# SGLang's buffers, in get_buf_infos() order, with one row's bytes each
SGLANG_ITEM_LENS = {
    "output_ids": 64,
    "cached_tokens": 64,
    "output_token_logprobs_val": 64,
    "output_token_logprobs_idx": 64,
    "output_top_logprobs_val": 512,
    "output_top_logprobs_idx": 512,
    "output_topk_p": 64,
    "output_topk_index": 128,
    "output_hidden_states": 2 * HIDDEN_SIZE,
    "bootstrap_room": 64,
}


def _decode_side(
    name: str, size: int = 4, window_s: float = 0.3
) -> tuple[MetadataBuffers, ReqToMetadataIdxAllocator]:
    allocator = ReqToMetadataIdxAllocator(size, late_write_window_s=window_s)
    return MetadataBuffers(size, HIDDEN_SIZE, torch.bfloat16, 16, table_name=name), allocator


def _transfer(name: str, idx: int, rid: int) -> None:
    """The prefill side of one request, in a process of its own: set_buf by address."""
    with MetadataBuffers.attach(name) as prefill:
        prefill.set_buf(prefill_request(rid, idx, HIDDEN_SIZE))


def _intact(buf: tuple[torch.Tensor, ...], rid: int) -> bool:
    want = prefill_request(rid, -1, HIDDEN_SIZE)
    return (
        torch.equal(buf[TOPK_P][:TOPK], want.output_topk_p)
        and torch.equal(buf[TOPK_INDEX][:TOPK], want.output_topk_index)
        and torch.equal(buf[HIDDEN], want.hidden_states_tensor)
        and int(buf[ROOM][0]) == rid + 1
    )


class Req:
    def __init__(self, rid: int, idx: int) -> None:
        self.rid, self.metadata_buffer_index = rid, idx


def test_the_module_imports_without_sglang_and_names_its_version() -> None:
    code = (
        "import sys, shmslots.sglang as s; assert 'sglang' not in sys.modules; "
        "print(s.SGLANG_VERSION)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == SGLANG_VERSION == "0.5.23"


def test_buffer_infos_are_sglangs_fields_in_order_with_its_item_lengths(name: str) -> None:
    buffers, allocator = _decode_side(name, size=5)
    with buffers:
        ptrs, data_lens, item_lens = buffers.get_buf_infos()
        assert item_lens == list(SGLANG_ITEM_LENS.values())
        assert data_lens == [5 * n for n in item_lens]
        idx = allocator.alloc()
        assert idx is not None
        _transfer(name, idx, 41)
        buf = buffers.get_buf(idx)
        assert len(buf) == 14 and sum(t is None for t in buf) == 4  # sampling mask, DSA: off
        views = [t for t in buf if t is not None]
        for k, view in enumerate(views):  # every view is the engine's address for (field, idx)
            assert view.data_ptr() == ptrs[k] + item_lens[k] * idx
        assert [t.dtype for t in views] == [torch.int32, torch.int32, torch.float32, torch.int32,
                                          torch.float32, torch.int32, torch.float32, torch.int64,
                                          torch.bfloat16, torch.uint64]  # fmt: skip
        del buf, view, views
        allocator.release(idx)
    assert [f.name for f in metadata_fields(16, torch.float32, 16)] == list(SGLANG_ITEM_LENS)
    with pytest.raises(SchemaError, match="multiple of 64"):
        metadata_fields(100, torch.bfloat16, 16)  # 200-byte rows: SGLang's engines would disagree


@pytest.mark.timeout(120)
def test_sglangs_calls_in_order_keep_the_draft_state_until_it_is_consumed(
    name: str, children: Children
) -> None:
    """alloc, transfer by address, the gate, get_buf, room check, clear_slot + free right after
    commit, wait while later transfers reuse indices, consume in a batch, release."""
    jobs, done = SPAWN.Queue(), SPAWN.Queue()
    buffers, allocator = _decode_side(name, size=4)
    with buffers:
        children.start(sglang_flow.prefill, name, HIDDEN_SIZE, jobs, done)
        parked: list[tuple[Req, tuple[torch.Tensor, ...]]] = []
        for rid in range(12):
            idx = allocator.alloc()
            while idx is None:  # every slot is owned by a waiting request: consume a batch
                batch, parked = parked[:2], parked[2:]
                assert all(_intact(buf, req.rid) for req, buf in batch)  # still its own
                consumed = [req for req, _ in batch]
                del batch  # the batch drops its views
                allocator.release_consumed(consumed)  # the one call SGLang lacks
                assert all(allocator.slot_of(req) is None for req in consumed)
                idx = allocator.alloc()
            assert buffers.bootstrap_room[idx, 0] == 0  # the gate: not arrived yet
            jobs.put((idx, rid))  # the index goes to prefill, which writes by address
            assert done.get(timeout=30) == rid  # the engine says the transfer is done
            assert buffers.bootstrap_room[idx, 0] == rid + 1  # arrived
            buf = row_of(buffers.get_buf(idx))  # commit, in place
            assert int(buf[ROOM][0]) == rid + 1  # SGLang's room check
            buffers.clear_slot(idx)
            allocator.free(idx)  # right after commit, as SGLang does: deferred
            assert buffers.table.slot_info(idx)[0] is State.HELD
            req = Req(rid, idx)
            allocator.bind(req, idx)
            parked.append((req, buf))
        del buf
        jobs.put(None)
        assert all(_intact(buf, req.rid) for req, buf in parked)
        leases = [allocator._held[req.metadata_buffer_index] for req, _ in parked]
        assert all(lease.verify() for lease in leases)
        del leases
        reqs = [req for req, _ in parked]
        parked.clear()
        allocator.release_consumed(reqs)
        assert allocator.available_size() == 4
        assert allocator.stats.deferred_frees == 12 and allocator.stats.released == 12
        assert buffers.table.stats().counters["leaked_views"] == 0
        assert buffers.table.check_consistency() == []


def test_misuse_raises_instead_of_corrupting_the_free_list(name: str) -> None:
    buffers, allocator = _decode_side(name, size=2)
    with buffers:
        a, b = allocator.alloc(), allocator.alloc()
        assert a is not None and b is not None and allocator.alloc() is None  # full: None
        with pytest.raises(InvalidSlot):
            allocator.free(99)  # SGLang accepts it
        with pytest.raises(InvalidSlot):
            allocator.free(True)
        with pytest.raises(OwnershipError, match="no committed row"):
            allocator.release(a)  # nothing was committed
        _transfer(name, a, 1)
        buffers.get_buf(a)  # committed; the views are dropped at once
        allocator.free(a)
        with pytest.raises(OwnershipError, match="double free"):
            allocator.free(a)  # SGLang would hand a out twice
        allocator.release(a)
        with pytest.raises(OwnershipError):
            allocator.release(a)
        with pytest.raises(OwnershipError, match="not allocated"):
            buffers.get_buf(a)
        allocator.free(b)  # before commit: aborted (quarantined)
        with pytest.raises(OwnershipError, match="double free"):
            allocator.free(b)
        assert allocator.available_size() == 1  # b waits out its late-write window
    with pytest.raises(OwnershipError, match="ReqToMetadataIdxAllocator"):
        MetadataBuffers(2, HIDDEN_SIZE, torch.bfloat16, 16, table_name=name)  # none built
    ReqToMetadataIdxAllocator(3)
    with pytest.raises(OwnershipError, match="ReqToMetadataIdxAllocator"):
        MetadataBuffers(2, HIDDEN_SIZE, torch.bfloat16, 16, table_name=name)  # not its size
    with pytest.raises(OwnershipError, match="no MetadataBuffers"):
        ReqToMetadataIdxAllocator(2).alloc()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", ["before transfer", "during transfer", "after commit",
                                   "after consumption"])  # fmt: skip
def test_abort_at_every_stage(name: str, stage: str) -> None:
    buffers, allocator = _decode_side(name, size=1, window_s=0.3)
    with buffers:
        idx = allocator.alloc()
        assert idx is not None
        req = Req(0, idx)
        allocator.bind(req, idx)
        if stage == "before transfer":
            allocator.abort_request(req)
        elif stage == "during transfer":
            allocator.abort_request(req)
            _transfer(name, idx, 0)  # the engine was slow: its write lands after the abort
        else:
            _transfer(name, idx, 0)
            buf = row_of(buffers.get_buf(idx))
            allocator.free(idx)
            if stage == "after consumption":
                assert _intact(buf, 0)
                del buf
                allocator.release_consumed([req])
            else:
                del buf
            allocator.abort_request(req)  # after consumption: nothing left to do
            assert allocator.available_size() == 1  # released at once
            assert allocator.slot_of(req) is None
            allocator.abort_request(req)  # a second abort is no second release
            return
        assert allocator.slot_of(req) is None
        assert allocator.available_size() == 0 and allocator.alloc() is None  # quarantined
        assert buffers.table.slot_info(idx)[0] is State.QUARANTINED  # closed to all
        deadline = time.monotonic() + 5
        while allocator.available_size() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert allocator.available_size() == 1 and allocator.quarantine.released == 1
        again = allocator.alloc()
        assert again == idx and buffers.bootstrap_room[idx, 0] == 0  # the gate is closed


@pytest.mark.timeout(60)
def test_in_step_a_quarantined_slot_is_freed_only_by_a_sweep(name: str) -> None:
    """The plugin's allocator (`in_step`): SGLang's decode TP ranks must admit alike, so a
    quarantined slot goes back only when swept, which the plugin does on the decode loop's
    beat in step across ranks; not by allocating, nor by a claim when its window ends."""
    allocator = ReqToMetadataIdxAllocator(1, late_write_window_s=0.1, in_step=True)
    with MetadataBuffers(1, HIDDEN_SIZE, torch.bfloat16, 16, table_name=name) as buffers:
        idx = allocator.alloc()
        assert idx is not None
        allocator.free(idx)  # a failed transfer's slot: quarantined
        time.sleep(0.3)  # its window has passed on this clock
        assert allocator.alloc() is None and allocator.available_size() == 0
        assert buffers.table.slot_info(idx)[0] is State.QUARANTINED
        allocator.sweep()
        assert allocator.available_size() == 1 and allocator.alloc() == idx


def test_a_transfer_whose_writers_are_dead_frees_its_slot_at_once(name: str) -> None:
    """A dead writer writes nothing, so its aborted reservation needs no quarantine; the mark
    is that reservation's, and the next one of the same slot is quarantined as usual."""
    buffers, allocator = _decode_side(name, size=2, window_s=30)
    with buffers:
        dead, alive = allocator.alloc(), allocator.alloc()
        assert dead is not None and alive is not None
        allocator.writers_gone(dead)
        allocator.free(dead)
        allocator.free(alive)
        assert buffers.table.slot_info(dead)[0] is State.FREE
        assert buffers.table.slot_info(alive)[0] is State.QUARANTINED
        assert allocator.stats.aborted_writers_gone == 1 and allocator.available_size() == 1
        again = allocator.alloc()
        assert again == dead
        allocator.free(again)  # a new reservation: the old mark does not carry over
        assert buffers.table.slot_info(dead)[0] is State.QUARANTINED
        with pytest.raises(InvalidSlot):
            allocator.writers_gone(2)


@pytest.mark.timeout(60)
def test_a_late_write_from_an_aborted_transfer_never_reaches_the_next_request(
    name: str, children: Children
) -> None:
    """Request 0's transfer is aborted while its engine is slow; the index is asked for again
    at once.  Were it handed out, request 1's transfer would land and request 0's late write
    after it; in quarantine the late write lands where no request reads."""
    buffers, allocator = _decode_side(name, size=1, window_s=0.5)
    with buffers:
        first = allocator.alloc()
        assert first is not None
        allocator.abort(first)
        second = allocator.alloc()  # an index freed at once would be reused here
        if second is not None:
            _transfer(name, second, 1)
        children.start(_transfer, name, first, 0).join(30)  # request 0's late write
        while second is None:
            time.sleep(0.02)
            if (second := allocator.alloc()) is not None:
                _transfer(name, second, 1)
        buf = row_of(buffers.get_buf(second))
        assert _intact(buf, 1)  # request 1's own row
        del buf
        allocator.release(second)


@pytest.mark.timeout(120)
def test_the_sglang_flow_holds_under_hold_and_clone_and_breaks_under_early_release(
    name: str,
) -> None:
    results: dict[str, Any] = {}
    for policy in sglang_flow.POLICIES:
        cfg = sglang_flow.FlowConfig(requests=600, slots=8, hidden=64, policy=policy)
        results[policy] = sglang_flow.run(cfg, f"{name}-{policy}")
    hold, clone, early = (results[p] for p in sglang_flow.POLICIES)
    assert hold.corrupted == clone.corrupted == 0
    assert hold.leaked_views == clone.leaked_views == 0 and hold.copies == 0 < clone.copies
    assert hold.deferred_frees > 0
    assert early.corrupted > 0 and early.leaked_views > 0  # the bug, seen and reported
    for r in results.values():
        assert r.consumed + r.aborted == 600


def _decode_that_dies(name: str, ready: Any) -> None:
    """A decode side holding a committed row and a reservation when it is SIGKILLed."""
    allocator = ReqToMetadataIdxAllocator(4)
    buffers = MetadataBuffers.attach(name, role="decode", allocator=allocator)
    held, _reserved = allocator.alloc(), allocator.alloc()
    assert held is not None
    buffers.set_buf(prefill_request(5, held, HIDDEN_SIZE))
    buf = buffers.get_buf(held)  # noqa: F841 (the request holds its views)
    ready.set()
    time.sleep(60)


@pytest.mark.timeout(60)
def test_a_dead_decode_sides_slots_all_come_back(name: str, children: Children) -> None:
    """Its committed rows are dropped, not queued for a reader that will never come, and its
    reservations freed: the table is whole again after a reap."""
    ReqToMetadataIdxAllocator(4)
    buffers = MetadataBuffers(4, HIDDEN_SIZE, torch.bfloat16, 16, table_name=name)
    with buffers:
        ready = SPAWN.Event()
        proc = children.start(_decode_that_dies, name, ready)
        assert ready.wait(30)
        stats = buffers.table.stats()
        assert stats.states["HELD"] == 1 and stats.states["RESERVED"] == 1
        proc.kill()
        proc.join(10)
        buffers.table.reap()
        stats = buffers.table.stats()
        assert stats.owned == 0 and stats.states["READY"] == 0 and stats.queued == 0
        assert buffers.table.check_consistency() == []


def test_bad_input_to_the_buffers_is_refused_and_changes_nothing(name: str) -> None:
    buffers, allocator = _decode_side(name, size=2)
    with buffers:
        idx = allocator.alloc()
        assert idx is not None
        for bad in (-1, 2, 10**7, True):
            with pytest.raises(InvalidSlot):
                buffers.write_by_address(bad, {"output_ids": [1]})
            with pytest.raises(InvalidSlot):
                buffers.bootstrap_room[bad, 0]
        with pytest.raises(InvalidSlot):
            buffers.bootstrap_room[idx, 8]
        before = buffers.bootstrap_room[idx].clone()
        for values in (
            {"bootstrap_room": [5], "output_ids": list(range(17))},  # too many values
            {"bootstrap_room": [5], "nope": [1]},  # no such field
            {"bootstrap_room": [5], "output_ids": [3.9]},  # not exact in int32
            {"bootstrap_room": [-1]},  # not a uint64
            {"bootstrap_room": ["x"]},
        ):
            with pytest.raises(SchemaError):
                buffers.write_by_address(idx, values)
            assert torch.equal(buffers.bootstrap_room[idx], before)  # nothing was written
        buffers.write_by_address(idx, {"bootstrap_room": [2**64 - 1]})
        assert buffers.bootstrap_room[idx, 0].item() == 2**64 - 1
        room = buffers.bootstrap_room[idx, 0]
    assert room.item() == 2**64 - 1  # a copy: still readable after close
    for call in (
        buffers.get_buf_infos,
        lambda: buffers.bootstrap_room[0, 0],
        lambda: buffers.write_by_address(0, {"output_ids": [1]}),
        lambda: buffers._clear(0),  # clear_slot's write, for a reservation a failed close left
    ):
        with pytest.raises(TableClosed):
            call()


def test_a_table_that_is_not_sglangs_is_refused(name: str) -> None:
    fields = [Field("bootstrap_room", "int8", (3,))]
    with SlotTable.create(name, fields, slots=2), pytest.raises(IncompatibleTable):
        MetadataBuffers.attach(name)
    fields = list(metadata_fields(HIDDEN_SIZE, torch.bfloat16, 16))  # SGLang's fields, but a
    redeliver = f"{name}-redeliver"  # dead decode side's rows would be queued for nobody
    with SlotTable.create(redeliver, fields, slots=2), pytest.raises(IncompatibleTable):
        MetadataBuffers.attach(redeliver)


def test_a_release_interrupted_before_the_book_forgot_it_does_not_block_the_index(
    name: str,
) -> None:
    """An interrupt between `lease.release()` and the allocator forgetting the index left a
    closed lease in its book, and the next alloc() of that index conflicted (#24, defect 8)."""
    buffers, allocator = _decode_side(name, size=1)
    with buffers:
        idx = allocator.alloc()
        assert idx is not None
        _transfer(name, idx, 7)
        buffers.get_buf(idx)  # committed; its views dropped at once
        allocator._held[idx].release()  # the release ran; the interrupt came before _forget
        again = allocator.alloc()
        assert again == idx and allocator._held == {}
        _transfer(name, again, 8)
        buf = row_of(buffers.get_buf(again))
        assert _intact(buf, 8)
        del buf
        allocator.release(again)
        assert allocator.available_size() == 1


def test_a_refused_release_keeps_the_index_the_requests(name: str) -> None:
    buffers, allocator = _decode_side(name, size=1)
    with buffers:
        idx = allocator.alloc()
        assert idx is not None
        _transfer(name, idx, 3)
        buf = row_of(buffers.get_buf(idx))
        with warnings.catch_warnings():
            warnings.simplefilter("error", LeakedViewWarning)
            with pytest.raises(LeakedViewWarning):
                allocator.release(idx)  # the views are still held: refused, as an error
        assert buffers.table.slot_info(idx)[0] is State.HELD and allocator.alloc() is None
        assert _intact(buf, 3)  # still the request's own row
        del buf
        allocator.release(idx)  # again, the views gone
        assert allocator.available_size() == 1
