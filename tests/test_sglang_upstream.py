"""SGLang 0.5.23's own decode code on shmslots, through the plugin SGLang's `load_plugins()` loads.

Not a copy of SGLang's rules: `pop_transferred`, `_commit_transfer_to_req`, the metadata gate,
`AuxDataCodec`, `set_buf`, `process_prebuilt` and `build_eagle_disagg_draft_input` are SGLang's
(tests/sglang_env.py says what stands in, and why).  The plugin is switched on in this process
(`SHMSLOTS_SGLANG=1`), as in a decode scheduler; a child process checks SGLang without it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sglang_env as env
import torch

from shmslots import InvalidSlot, OwnershipError, ShmSlotsError
from shmslots.sglang import GET_BUF_ORDER, MetadataBuffers, ReqToMetadataIdxAllocator
from shmslots.sglang.plugin import DecodeAllocator, DecodeMetadataBuffers

pytestmark = pytest.mark.skipif(env.SGLANG_MISSING is not None, reason=env.SGLANG_MISSING or "")
HIDDEN, TOPK = 64, 4


@pytest.fixture(scope="module")
def sglang_decode() -> None:
    env.load_sglang(plugin=True)
    env.start_decode_runtime(TOPK)


@pytest.fixture
def lanes(sglang_decode: None) -> Iterator[list[env.Lane]]:
    made: list[env.Lane] = []
    yield made
    for lane in made:
        lane.close()


def _lane(lanes: list[env.Lane], slots: int = 4, **kwargs: Any) -> env.Lane:
    lane = env.Lane(slots, HIDDEN, TOPK, **kwargs)
    lanes.append(lane)
    return lane


def _rid(req: Any) -> int:
    return int(req.rid.split("-")[1])


def _owned(lane: env.Lane) -> int:
    """Slots owned in the table itself (not the allocator's own count)."""
    return sum(n for state, n in lane.buffers.table.stats().states.items() if state != "FREE")


def test_the_scheduler_builds_shmslots_buffers_with_sglangs_item_lengths(
    lanes: list[env.Lane],
) -> None:
    lane = _lane(lanes, dsa_dim=64)
    assert isinstance(lane.allocator, DecodeAllocator)
    assert isinstance(lane.buffers, DecodeMetadataBuffers)
    assert not isinstance(lane.prefill, MetadataBuffers)  # the prefill side keeps SGLang's
    _, data_lens, item_lens = lane.buffers.get_buf_infos()
    assert (data_lens, item_lens) == tuple(lane.prefill.get_buf_infos()[1:])
    assert lane.buffers.enable_sampling_mask is lane.prefill.enable_sampling_mask is False
    assert (
        lane.buffers.table.name.startswith("sglang-")
        and f"-{os.getpid()}" in lane.buffers.table.name
    )


def test_optional_fields_follow_sglangs_switches(
    sglang_decode: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    args: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        hidden_states_dtype=torch.float16,
        max_sampling_mask_tokens=32,
        max_top_logprobs_num=64,
        custom_mem_pool=None,
        output_dsa_topk_indices_dim=48,
        kv_checksum_enabled=True,
    )
    theirs = env.SGLANG_CLASSES["buffers"](8, **args)
    ReqToMetadataIdxAllocator(8)
    with MetadataBuffers(8, **args) as ours:
        assert ours.get_buf_infos()[1:] == theirs.get_buf_infos()[1:]
        assert ours.enable_sampling_mask and ours.output_dsa_topk_indices_dim == 48
        idx = ours._allocator.alloc()  # type: ignore[union-attr]
        assert idx is not None
        req = env.sglang_req(3, HIDDEN, TOPK)
        req.metadata_buffer_index = idx
        ours.set_kv_checksum(req, 0xDEAD, 0xBEEF)
        assert ours.get_kv_checksum(idx) == (0xDEAD, 0xBEEF)
        row = ours.get_buf(idx)
        assert len(row) == len(GET_BUF_ORDER) == 14
        dsa = row[GET_BUF_ORDER.index("output_dsa_topk_indices")]
        assert dsa is not None and int(dsa[0]) == -1  # SGLang's "none written"
        del dsa
        del row


def test_pop_transferred_commits_every_transfer_in_place_and_each_draft_survives_slot_reuse(
    lanes: list[env.Lane],
) -> None:
    lane = _lane(lanes)
    rng = random.Random(7)
    ptrs, data_lens, _ = lane.buffers.get_buf_infos()
    hidden_column = lane.buffers._names.index("output_hidden_states")
    ptr, data_len = ptrs[hidden_column], data_lens[hidden_column]

    def in_place(req: Any) -> None:
        """Zero copy: the request's draft state is a view of its slot's row."""
        assert ptr <= req.hidden_states_tensor.data_ptr() < ptr + data_len

    checked = 0
    for batch, spec in lane.drive(60, rng, send_chance=0.7, max_batch=3, popped=in_place):
        for i, req in enumerate(batch):
            topk_p, topk_index, hidden = env.expected_draft(_rid(req), HIDDEN, TOPK)
            assert torch.equal(spec.topk_p[i], topk_p)
            assert torch.equal(spec.topk_index[i], topk_index)
            assert torch.equal(spec.hidden_states[i], hidden)
            assert req.output_ids == [_rid(req) % 50_000]
            assert req.hidden_states_tensor is None  # consumed, and its slot handed back
        checked += len(batch)
    assert checked == 60
    stats = lane.allocator.stats
    assert stats.committed == stats.deferred_frees == stats.released == 60
    assert lane.allocator.available_size() == 4 and _owned(lane) == 0


def test_a_failed_transfer_holds_its_slot_for_the_late_write_window(
    lanes: list[env.Lane],
) -> None:
    lane = _lane(lanes, slots=2)
    lane.allocator.quarantine.window_s = 0.3
    failed = lane.send(1)
    failed.kv_receiver.fail()  # KVPoll.Failed: SGLang frees the index before any commit
    assert lane.pop() == []
    assert lane.allocator.available_size() == 1 and _owned(lane) == 1
    ok = lane.send(2)
    lane.land(failed, succeed=False)  # the failed transfer's write lands late
    lane.land(ok)
    [req] = lane.pop()
    assert _rid(req) == 2 and ok.metadata_buffer_index != failed.metadata_buffer_index
    quarantined = failed.metadata_buffer_index
    lane.prebuild([req])
    deadline = time.monotonic() + 5
    while lane.allocator.available_size() < 2:  # freed by SGLang's beat, once due
        assert time.monotonic() < deadline
        lane.queue.resolve_deferred_releases()
    again = lane.send(3)  # the quarantined slot, reset: the gate waits for this transfer
    assert again.metadata_buffer_index == quarantined
    assert lane.buffers.bootstrap_room[quarantined, 0].item() == 0
    lane.land(again)
    [req] = lane.pop()
    spec = lane.prebuild([req]).spec_info
    assert torch.equal(spec.hidden_states[0], env.expected_draft(3, HIDDEN, TOPK)[2])


def test_an_idle_decode_loop_frees_a_quarantined_slot_when_its_window_ends(
    lanes: list[env.Lane],
) -> None:
    """No allocation follows (the server is idle): SGLang's own per-turn
    `resolve_deferred_releases` is the beat that frees the slot in the table."""
    lane = _lane(lanes, slots=2)
    lane.allocator.quarantine.window_s = 2.0  # long enough for a loaded machine
    failed = lane.send(1)
    failed.kv_receiver.fail()
    assert lane.pop() == []
    lane.queue.resolve_deferred_releases()
    assert _owned(lane) == 1  # quarantined: its window has not passed
    time.sleep(2.1)
    assert _owned(lane) == 1  # nothing swept yet
    lane.queue.resolve_deferred_releases()
    assert _owned(lane) == 0 and lane.allocator.quarantine.released == 1


def test_a_room_mismatch_at_commit_hands_the_slot_back_at_once(lanes: list[env.Lane]) -> None:
    lane = _lane(lanes, slots=2)
    decode_req = lane.send(5)
    decode_req.req.bootstrap_room = 999  # the row that lands is another request's
    lane.land(decode_req)
    assert lane.pop() == []
    assert decode_req.req.finished_reason is not None  # SGLang aborted it
    assert lane.allocator.available_size() == 2 and _owned(lane) == 0
    assert lane.allocator.stats.released == 1


def test_an_abort_in_the_waiting_queue_releases_once_and_a_stale_one_spares_the_next_owner(
    lanes: list[env.Lane],
) -> None:
    lane = _lane(lanes, slots=1)
    lane.land(lane.send(1))
    [first] = lane.pop()
    lane.abort_waiting(first)
    assert lane.allocator.available_size() == 1 and _owned(lane) == 0
    lane.land(lane.send(2))
    [second] = lane.pop()
    lane.abort_waiting(first)  # stale: the slot is the second request's now
    assert lane.allocator.stats.stale_calls == 0  # the hook only acts for a holder
    lane.allocator.abort_request(first)
    assert lane.allocator.stats.stale_calls == 1
    spec = lane.prebuild([second]).spec_info
    assert torch.equal(spec.hidden_states[0], env.expected_draft(2, HIDDEN, TOPK)[2])
    assert lane.allocator.available_size() == 1


def test_a_request_dropped_for_a_kv_checksum_mismatch_hands_its_slot_back(
    lanes: list[env.Lane], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_verify_kv_checksums` drops such a request from its batch before `process_prebuilt`:
    its slot goes back then, not when the request is collected."""
    monkeypatch.setenv("SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB", "0.5")  # not a CI error
    lane = _lane(lanes, slots=2)
    lane.land(lane.send(1))
    [req] = lane.pop()
    lane.drop_on_kv_checksum_mismatch(req)
    assert lane.allocator.available_size() == 2 and _owned(lane) == 0
    assert lane.allocator.stats.aborted_after_commit == 1 and req.hidden_states_tensor is None


def test_a_request_dropped_while_holding_its_slot_hands_it_back(lanes: list[env.Lane]) -> None:
    lane = _lane(lanes, slots=2)
    lane.land(lane.send(1))
    reqs = lane.pop()
    assert lane.allocator.available_size() == 1
    del reqs
    gc.collect()
    assert lane.allocator.available_size() == 2 and _owned(lane) == 0
    assert lane.allocator.stats.orphaned == 1


def test_misuse_raises_a_shmslots_error_and_changes_nothing(lanes: list[env.Lane]) -> None:
    lane = _lane(lanes, slots=2)
    lane.land(lane.send(1))
    [req] = lane.pop()
    idx = lane.allocator.slot_of(req)
    with pytest.raises(OwnershipError):
        lane.allocator.free(idx)  # SGLang freed it after commit already
    for bad in (-1, 2, True, "0", None):
        with pytest.raises(InvalidSlot):
            lane.allocator.free(bad)
    free_idx = 1 - idx
    with pytest.raises(OwnershipError):
        lane.allocator.free(free_idx)
    with pytest.raises(ShmSlotsError):
        lane.buffers.get_buf(free_idx)
    assert lane.allocator.available_size() == 1 and _owned(lane) == 1
    lane.prebuild([req])
    assert _owned(lane) == 0


def test_a_retracted_request_resumed_after_its_slot_went_back_gets_a_zero_draft(
    lanes: list[env.Lane],
) -> None:
    """The hook is called as `resume_retracted_reqs`' AFTER hook would call it (resuming a
    retracted request for real needs SGLang's KV pools)."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    from shmslots.sglang import plugin

    assert DecodePreallocQueue.resume_retracted_reqs.__wrapped__  # the hook is installed
    lane = _lane(lanes, slots=1)
    lane.land(lane.send(1))
    [req] = lane.pop()
    lane.prebuild([req])
    plugin._resumed([req])
    spec = lane.prebuild([req]).spec_info
    assert not spec.hidden_states.any() and spec.hidden_states.shape == (1, HIDDEN)


def test_a_configuration_a_table_cannot_hold_keeps_sglangs_classes(
    sglang_decode: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampling mask of 1,000 tokens is 4,000 bytes a row, not a multiple of 64: SGLang
    allows it, so the decode side runs as shipped (with a warning) instead of failing."""
    from sglang.srt.managers import scheduler

    monkeypatch.setenv("SGLANG_ENABLE_DISAGG_SAMPLING_MASK", "1")
    allocator = scheduler.ReqToMetadataIdxAllocator(4)
    buffers = scheduler.MetadataBuffers(
        4, hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=1000
    )
    assert type(buffers) is env.SGLANG_CLASSES["buffers"]
    idx = allocator.alloc()
    assert idx is not None and allocator.available_size() == 3
    allocator.free(idx)
    assert allocator.available_size() == 4


def test_a_role_switch_removes_the_table_and_a_dead_schedulers_table_is_removed_at_start(
    sglang_decode: None,
) -> None:
    from sglang.srt.disaggregation import role_switch
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import scheduler

    args: dict[str, Any] = dict(
        hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=16
    )
    scheduler.ReqToMetadataIdxAllocator(4)
    first = scheduler.MetadataBuffers(4, **args)
    assert isinstance(first, MetadataBuffers)
    name = first.table.name
    prefix = name[: name.rindex("-", 0, name.rindex("-")) + 1]  # sglang-<port>-tp<rank>-
    other_server = "sglang-1-tp0-"  # another server's, killed whole: no exit of its ran
    dead = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, torch; from shmslots import SlotTable, Field; "
         "import os; t = [SlotTable.create(p + str(os.getpid()) + '-0', [Field('x', 'int64')], "
         "slots=2) for p in sys.argv[1:]]; print('up', flush=True); time.sleep(60)",
         prefix, other_server],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert dead.stdout is not None and dead.stdout.readline().strip() == "up"
    finally:
        dead.kill()
        dead.wait(10)
    orphans = [f"{prefix}{dead.pid}-0", f"{other_server}{dead.pid}-0"]
    assert all(os.path.exists(f"/dev/shm/{orphan}") for orphan in orphans)
    standin = SimpleNamespace(  # a mode with nothing else to tear down
        disaggregation_mode=DisaggregationMode.NULL, disagg_metadata_buffers=first
    )
    with contextlib.suppress(AttributeError):  # its prefix cache is not ours to stand in for
        role_switch.teardown_disaggregation(standin)
    assert first.table.closed and not os.path.exists(f"/dev/shm/{name}")
    scheduler.ReqToMetadataIdxAllocator(4)
    with scheduler.MetadataBuffers(4, **args) as second:  # decode again: a fresh table
        assert second.table.name != name
        assert not any(os.path.exists(f"/dev/shm/{o}") for o in orphans)  # the dead's, removed


CHILD = Path(__file__).with_name("sglang_plugin_child.py")


@pytest.mark.parametrize("switch", ["1", None])
def test_load_plugins_puts_shmslots_in_sglangs_scheduler_only_when_switched_on(
    switch: str | None,
) -> None:
    child_env = {k: v for k, v in os.environ.items() if k != "SHMSLOTS_SGLANG"}
    if switch is not None:
        child_env["SHMSLOTS_SGLANG"] = switch
    out = subprocess.run(
        [sys.executable, str(CHILD)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    if switch:
        assert got["decode"] == ["DecodeAllocator", "DecodeMetadataBuffers"]
        assert got["prefill"] == ["ReqToMetadataIdxAllocator", "MetadataBuffers"]
        assert got["prefill_module"] == "sglang.srt.disaggregation.utils"
        assert got["flow"] == {"committed": 3, "released": 2, "aborted_after_commit": 1, "free": 4}
    else:
        assert got["decode"] == ["ReqToMetadataIdxAllocator", "MetadataBuffers"]
        assert got["decode_module"] == "sglang.srt.disaggregation.utils"
        assert "flow" not in got


def test_on_sglangs_own_code_only_views_freed_at_commit_corrupt_drafts(sglang_decode: None) -> None:
    """tools/sglang_policies.py's three policies, small: the plugin and SGLang's clone never
    hand a request another's draft; views kept past a free at commit do."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        import sglang_policies
    finally:
        sys.path.pop(0)
    got = {p: sglang_policies.run(p, 300, 4, HIDDEN, seed=1) for p in sglang_policies.POLICIES}
    assert got["hold"]["corrupted"] == got["clone"]["corrupted"] == 0
    assert got["early-release"]["corrupted"] > 0
    assert all(r["requests"] == 300 for r in got.values())


class _Manager:
    """What the plugin asks of a transfer manager: whether a room's writers are all dead
    (on this rank; shmslots' same-host manager answers from its prefill watcher)."""

    def __init__(self, gone: bool) -> None:
        self.gone = gone

    def writers_gone(self, bootstrap_room: int, receiver: object) -> bool:
        return self.gone


@contextlib.contextmanager
def _rank_of_two(
    rank: int, port: int, table: str, window_s: float
) -> Iterator[tuple[Any, ReqToMetadataIdxAllocator, MetadataBuffers]]:
    """One decode TP rank in a real two-rank gloo group: the group, and the plugin's
    allocator with its buffers (a table of this rank's own)."""
    import torch.distributed as dist

    env.install_torchvision_stand_in()  # this process imports SGLang's disaggregation utils

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        allocator = ReqToMetadataIdxAllocator(2, late_write_window_s=window_s, in_step=True)
        with MetadataBuffers(2, 16, torch.float32, 16, table_name=f"{table}-{rank}") as buffers:
            yield group, allocator, buffers
    finally:
        dist.destroy_process_group()


def _two_ranks(children: Any, rank_main: Any, per_rank: tuple[Any, Any]) -> list[Any]:
    """What `rank_main(rank, port, per_rank[rank], results)` put, for ranks 0 and 1."""
    from conftest import SPAWN

    results = SPAWN.Queue()
    port = env.free_port()
    for rank in (0, 1):
        children.start(rank_main, rank, port, per_rank[rank], results)
    children.join_all(90)
    return sorted(results.get(timeout=5) for _ in range(2))


def _decode_rank(rank: int, port: int, case: tuple[str, bool], results: Any) -> None:
    """One failed transfer, whose writers this rank alone may think dead."""
    from shmslots.sglang import plugin

    table, gone = case
    with _rank_of_two(rank, port, table, 30.0) as (group, allocator, buffers):
        idx = allocator.alloc()
        assert idx is not None
        transfer = SimpleNamespace(
            req=SimpleNamespace(bootstrap_room=7),
            metadata_buffer_index=idx,
            kv_receiver=SimpleNamespace(kv_mgr=_Manager(gone)),
        )  # the fields of SGLang's DecodeRequest the plugin reads
        plugin._mark_writers_gone(allocator, [transfer], group)
        allocator.free(idx)  # SGLang's release of the failed transfer
        results.put((rank, buffers.table.slot_info(idx)[0].name, allocator.available_size()))


def _quarantining_rank(rank: int, port: int, case: tuple[str, float], results: Any) -> None:
    """One failed transfer, quarantined with a late-write window of this rank's own."""
    from shmslots.sglang import plugin

    table, window_s = case
    with _rank_of_two(rank, port, table, window_s) as (group, allocator, buffers):
        idx = allocator.alloc()
        assert idx is not None
        allocator.free(idx)  # SGLang's release of a failed transfer: quarantined
        time.sleep(0.3)  # a window of 0.1 s has passed; one of 30 s has not
        sizes = [allocator.available_size()]
        plugin._sweep_agreed(allocator, group)  # SGLang's per-turn beat
        sizes.append(allocator.available_size())
        results.put((rank, buffers.table.slot_info(idx)[0].name, sizes))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("windows", [(0.1, 0.1), (0.1, 30.0)], ids=["both due", "one due"])
def test_decode_ranks_free_a_quarantined_slot_only_when_it_is_due_on_every_rank(
    name: str, children: Any, windows: tuple[float, float]
) -> None:
    """Each rank's window ends on its own clock; were one rank to free the slot (by an
    allocation, a claim at the deadline, or its own sweep) while another still held it,
    their admission would differ, and then the lengths of SGLang's polling collectives."""
    seen = _two_ranks(children, _quarantining_rank, ((name, windows[0]), (name, windows[1])))
    want = ("FREE", [1, 2]) if windows == (0.1, 0.1) else ("QUARANTINED", [1, 1])
    assert [s[1:] for s in seen] == [want, want]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gone", [(True, True), (True, False)], ids=["both", "one"])
def test_decode_ranks_free_a_dead_writers_slot_at_once_only_when_all_agree(
    name: str, children: Any, gone: tuple[bool, bool]
) -> None:
    """Each decode rank watches its prefill peers on its own; were one to free a slot at once
    while another quarantined it, their admission would differ and SGLang's next collective
    would hang or mismatch."""
    seen = _two_ranks(children, _decode_rank, ((name, gone[0]), (name, gone[1])))
    want = ("FREE", 2) if all(gone) else ("QUARANTINED", 1)
    assert [s[1:] for s in seen] == [want, want]
