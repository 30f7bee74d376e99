"""shmslots as SGLang 0.5.23's transfer backend on one host: SGLang's own manager, sender,
receiver and bootstrap server in two spawned processes (tests/pd_env.py), every byte checked."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sglang_env as env
import torch

pytestmark = pytest.mark.skipif(env.SGLANG_MISSING is not None, reason=env.SGLANG_MISSING or "")

from pd_env import Pair, Shape, forgotten_main, ids_main, window_main  # noqa: E402

from shmslots.errors import InvalidArgument  # noqa: E402
from shmslots.sglang.backend import WATCH_ENV, watch_interval  # noqa: E402

CUDA_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _parse(plugin: bool) -> dict[str, Any]:
    child = os.path.join(os.path.dirname(__file__), "sglang_backend_child.py")
    environ = {k: v for k, v in os.environ.items() if k != "SHMSLOTS_SGLANG"}
    if plugin:
        environ["SHMSLOTS_SGLANG"] = "1"
    out = subprocess.run(
        [sys.executable, child], env=environ, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_sglangs_parser_takes_the_backend_with_the_plugin_and_refuses_it_without() -> None:
    got = _parse(plugin=True)
    assert got["backend"] == "shmslots" and got["mooncake"] == "MooncakeKVManager"
    assert got["classes"] == {
        "KVARGS": "KVArgs",
        "MANAGER": "ShmslotsKVManager",
        "SENDER": "ShmslotsKVSender",
        "RECEIVER": "ShmslotsKVReceiver",
        "BOOTSTRAP_SERVER": "ShmslotsKVBootstrapServer",
    }
    assert "invalid choice: 'shmslots'" in _parse(plugin=False)["refused"]
    # docs/sglang.md's limit: SGLang itself refuses its deferred decode allocation for
    # every backend but Mooncake's, this one included, so it never runs untested here
    assert "other than Mooncake" in got["prefill_complete"], got["prefill_complete"]


@pytest.mark.parametrize(
    ("shape", "rooms", "pages", "window"),
    [
        (Shape(), 200, 3, 6),  # 200 requests through 8 aux slots
        (Shape(mla=True, page_size=8), 40, 5, 4),  # MLA: one entry a layer
        # SGLang's state buffers through its own `maybe_send_extra` and this engine: a Mamba
        # group (a conv and a temporal tensor, one row a request), and SWA layers (K and V
        # pages of the window, sent page by page as the KV is)
        (Shape(state="mamba"), 60, 3, 4),
        (Shape(state="swa"), 60, 3, 4),
        (Shape(mla=True, state="dsa"), 60, 3, 4),  # DeepSeek-V3.2: MLA KV, DSA indexer keys
        # Prefill at attention TP 2, decode at 1: each prefill rank holds half the KV heads,
        # and SGLang's own `send_kvcache_slice` writes them into the decode's whole pages, a
        # head-slice of every token (blocks of 4 heads x 16 dim here); so, too, each rank's
        # half of a Mamba state's dims and of an SWA window's heads
        (Shape(heads=8, page_size=8, prefill_tp=2, state="mamba"), 40, 3, 4),
        (Shape(heads=8, page_size=8, prefill_tp=2, state="swa"), 40, 3, 4),
        # Decode at attention TP 2, prefill at 1 (as on one 8-GPU host: a prefill of fewer
        # GPUs than its decode): each decode rank asks for the room, SGLang's prefill waits
        # for both and writes each its own pages: its half of every token's heads through
        # `send_kvcache_slice` (MLA's one latent whole to each, through `send_kvcache`), its
        # half of a Mamba state's dims (`_send_mamba_state_slice`) or of an SWA window's
        # heads (`_send_swa_state_slice`), and an aux row into each rank's table
        (Shape(heads=4, page_size=8, decode_tp=2, state="mamba"), 40, 3, 4),
        (Shape(heads=4, page_size=8, decode_tp=2, state="swa"), 40, 3, 4),
        (Shape(heads=4, page_size=8, decode_tp=2, mla=True), 40, 3, 4),
        # DSA's indexer keys beside MLA at attention TP 2 on either side: replicated state,
        # which SGLang writes whole to each decode rank, as MLA's latent
        (Shape(page_size=8, decode_tp=2, mla=True, state="dsa"), 40, 3, 4),
        (Shape(page_size=8, prefill_tp=2, mla=True, state="dsa"), 40, 3, 4),
        # KV and Mamba state on the GPU, written by CUDA IPC (tools/gpu_check.sh); the
        # prefill's pools VMM memory too (--enable-memory-saver), which it only sends from
        pytest.param(Shape(state="mamba", device="cuda"), 60, 3, 4, marks=CUDA_ONLY),
        pytest.param(
            Shape(state="mamba", device="cuda", vmm_prefill=True), 60, 3, 4, marks=CUDA_ONLY
        ),
    ],
    ids=[
        "200-through-8-slots",
        "mla",
        "mamba-state",
        "swa-state",
        "dsa-state",
        "prefill-tp2-mha-and-mamba",
        "prefill-tp2-swa",
        "decode-tp2-mha-and-mamba",
        "decode-tp2-swa",
        "decode-tp2-mla",
        "decode-tp2-dsa",
        "prefill-tp2-dsa",
        "cuda-kv",
        "cuda-kv-vmm",
    ],
)
def test_every_byte_of_every_request_lands(
    shape: Shape, rooms: int, pages: int, window: int
) -> None:
    """Every rank of each side sees every room through, and each decode rank checks every
    byte it was to get."""
    with Pair(shape) as pair:
        pair.start_prefill()
        assert pair.prefill_receives is False  # the backend's prefill engine only sends
        assert pair.prefill_shareable == (None if shape.device == "cpu" else not shape.vmm_prefill)
        pair.start_decode()
        numbers = list(range(1000, 1000 + rooms))
        pair.submit(numbers, pages=pages, window=window)
        for conn in pair.prefills:
            _, sent, refused, _ = pair.reply(conn)
            assert set(sent.values()) == {"Success"} and refused == 0
        for conn in pair.decodes:
            _, outcomes = pair.reply(conn)
            assert sorted(outcomes) == numbers
            assert all(o.status == "Success" and o.verified for o in outcomes.values())
        assert pair.settle() == (True, shape.pages, shape.slots)


def _kill_mid_transfer(pair: Pair, side: str, rank: int = 0) -> float:
    """SIGKILL `side`'s `rank` once transfers are flowing; returns the kill's monotonic
    time."""
    pair.wait_until(pair.sent, 20)
    proc = (pair.prefill_procs if side == "prefill" else pair.decode_procs)[rank]
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.join(10)
    return killed


# big pages, so that a kill lands while transfers are in flight; a Mamba state group too, so
# that the canary covers its rows
BIG = Shape(layers=4, pages=48, page_size=64, heads=8, head_dim=128, state="mamba")


def test_prefill_sigkilled_mid_transfer_decode_releases_at_once_and_serves_on() -> None:
    with Pair(BIG) as pair:
        pair.start_prefill()
        pair.start_decode()
        rooms = list(range(1, 2001))
        pair.submit(rooms, pages=4, window=6)
        killed = _kill_mid_transfer(pair, "prefill")
        _, outcomes = pair.reply(pair.decode)
        failed = [o for o in outcomes.values() if o.status == "Failed"]
        assert failed, "the kill landed after every transfer"
        # released on the prefill's death, never by SGLang's 30 s timeout ("Failed-timeout");
        # rooms after the kill never start once their pages are all a failed room's
        statuses = Counter(o.status for o in outcomes.values())
        assert set(statuses) <= {"Success", "Failed", "NotStarted"}, statuses
        assert all(o.verified for o in outcomes.values() if o.status == "Success")
        # settled from the kill: detected by the registry lock, released without the 30 s
        assert max(o.released_at for o in failed) - killed < 2.0, statuses
        assert pair.settle() == (True, BIG.pages, BIG.slots)  # nothing landed after release
        # a new prefill on the same port: the decode serves on
        pair.start_prefill()
        more = list(range(5001, 5021))
        pair.submit(more, pages=4, window=4)
        pair.reply(pair.prefill)
        _, outcomes = pair.reply(pair.decode)
        assert all(o.status == "Success" and o.verified for o in outcomes.values())


def test_a_second_receiver_of_an_id_in_flight_is_refused_and_the_id_fails() -> None:
    """Room ids are the client's to choose (and SGLang 0.5.23 gives a request's parallel
    samples one id).  Here each id is sent to two prefill servers at once, a receiver on
    each.  SGLang keys a room's status and ACKs by id, so one's Success would read as the
    other's: a row consumed before its bytes landed (seen without this refusal: another
    room's aux row, the state rows unwritten).  The second receiver is refused and the id
    fails, as SGLang itself does under deferred allocation.  Both are released at once and
    nothing lands after, and the decode serves on.  (A retry of an id: the test below.)"""
    with Pair(BIG) as pair:
        pair.start_prefill()
        pair.start_decode()
        pair.start_second_prefill()
        rooms = list(range(1, 31))
        pair.submit(rooms, pages=4, window=6)
        for conn in (pair.prefill, pair.second):
            _, _, refused, _ = pair.reply(conn)
            assert refused == 0
        _, outcomes = pair.reply(pair.decode)
        assert sorted(outcomes) == [(room, server) for room in rooms for server in (0, 1)]
        pairs = Counter((outcomes[room, 0].status, outcomes[room, 1].status) for room in rooms)
        # refused pairs hold their pages until "settle", and the ids after them never start;
        # an id whose first receiver was done before the second came was served twice
        assert pairs[("Failed", "Failed")], pairs
        assert set(pairs) <= {("Failed", "Failed"), ("NotStarted",) * 2, ("Success",) * 2}
        for o in outcomes.values():
            if o.status == "Failed":
                assert "Duplicate decode bootstrap room" in o.reason, o
                assert o.released_at - o.failed_at < 2.0, o
            assert o.verified or o.status != "Success", o
        assert pair.settle() == (True, BIG.pages, BIG.slots)  # nothing landed after release
        assert pair.second is not None
        pair.second.send(("stop",))
        pair.second = None
        more = list(range(5001, 5021))
        pair.submit(more, pages=4, window=6)  # one server again: one receiver each
        pair.reply(pair.prefill)
        _, outcomes = pair.reply(pair.decode)
        assert sorted(outcomes) == more
        assert all(o.status == "Success" and o.verified for o in outcomes.values())


def test_a_refused_request_and_the_first_of_its_id_are_told_why_and_a_retry_is_served() -> None:
    """SGLang's decode in its own order (the scheduler thread's calls, beside a prefill):
    both requests of a refused id are told it was a duplicate (the id's one failure record
    was the first to ask's, the other told "unknown reason from another rank"); a retry
    made before a failed receiver's second clear survives it (which popped the retry's
    status: it failed); a retry is refused while a failed receiver that asked for pages
    awaits its release, and served after.  A rank of a receiver done with its
    id, found dead once a new request holds the id, fails no one (it failed the new one)."""
    with Pair(Shape()) as pair:
        pair.start_prefill()
        pair.start_decode(ids_main)
        _, facts = pair.reply(pair.decode)
    assert facts["failed"] == [True, True]
    assert all("Duplicate decode bootstrap room" in why for why in facts["reasons"]), facts
    assert facts["retry"] and facts["again"], facts
    # a retry while a failed receiver that asked for pages awaits release is refused (its
    # prefill may still write them, and answers by id), and one after its release served
    assert facts["retry_while_held"][0], facts
    assert all("Duplicate decode bootstrap room" in why for why in facts["retry_while_held"][1:])
    assert facts["left_after_refusals"] == [False, False], facts
    assert facts["retry_once_released"], facts
    assert facts["new_after_death"], facts  # a dead rank of a done receiver fails no one


def test_a_room_bootstrapped_while_the_watcher_fails_a_dead_prefill_is_released_at_once() -> None:
    """A race that can fail the kill test above (seen once): a receiver made between
    the watcher's look at SGLang's tables and SGLang's failing of the dead prefill's rooms
    took the dead ranks from SGLang's cache, and SGLang fails its room too.  It must be
    released at once with the others, not sent an ABORT the dead prefill never acknowledges
    (30 s, "Failed-timeout").  And a room id that another receiver, whose ranks are not
    known dead, also holds (clients choose ids) is not released early until SGLang lets go
    of that receiver: SGLang asks by id."""
    with Pair(Shape()) as pair:
        pair.start_prefill()
        pair.start_decode(window_main)
        assert pair.reply(pair.decode) == ("bootstrapped",)
        prefill = pair.prefill_procs[0]
        assert prefill.pid is not None
        os.kill(prefill.pid, signal.SIGKILL)
        prefill.join(10)
        pair.decode.send(("prefill killed",))  # type: ignore[union-attr]
        _, facts = pair.reply(pair.decode)
        assert facts["statuses"] == [True, True]  # both rooms failed by SGLang
        assert facts["safe"] == [True, True] and facts["marked"] and not facts["armed"]
        assert not facts["fresh_entries_gone"]
        assert facts["beside_a_live_twin"] == [False, False]  # a room id with a live writer
        assert facts["once_let_go"] == [True, True]


@pytest.mark.parametrize("rank", [0, 1], ids=["bootstrap-rank", "other-rank"])
def test_a_prefills_death_fails_rooms_whose_ranks_sglang_forgot(rank: int) -> None:
    """SGLang drops a server's cached rank entries whenever one of its requests times out
    waiting, while other rooms of that server are in flight.  The watcher looked only at
    SGLang's cache and at rooms awaiting ACKs, so a prefill rank's SIGKILL then went unseen:
    its rooms failed at SGLang's heartbeat (9.8 s: rank 0, which serves the bootstrap), or
    not in 20 s (rank 1).  Every room in flight has its ranks watched."""
    with Pair(dataclasses.replace(Shape(), prefill_tp=2)) as pair:
        pair.start_prefill()
        pair.start_decode(forgotten_main)
        _, forgotten, status = pair.reply(pair.decode)
        assert forgotten and status != "KVPoll.Failed", status
        proc = pair.prefill_procs[rank]
        assert proc.pid is not None
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        pair.decode.send(("killed", killed))  # type: ignore[union-attr]
        _, failed, took = pair.reply(pair.decode, 60)
        proc.join(10)
    assert failed and took < 2.0, took  # 0.02-0.03 s here, idle: the watcher's interval


def test_a_bad_watch_interval_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a watcher that died at its first look (a word) or spins (0, below 0)."""
    for bad in ("abc", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(WATCH_ENV, bad)
        with pytest.raises(InvalidArgument, match=WATCH_ENV):
            watch_interval()
    monkeypatch.setenv(WATCH_ENV, "0.5")
    assert watch_interval() == 0.5


def _failed_rooms(pair: Pair) -> tuple[list[Any], Counter[str]]:
    """The decode's failed rooms once its run ends, and every room's status: each room
    ended, none by SGLang's 30 s timeout ("Failed-timeout"), and some failed."""
    _, outcomes = pair.reply(pair.decode)
    failed = [o for o in outcomes.values() if o.status == "Failed"]
    statuses = Counter(o.status for o in outcomes.values())
    assert failed and set(statuses) <= {"Success", "Failed", "NotStarted"}, statuses
    return failed, statuses


@contextlib.contextmanager
def _two_rank_prefill() -> Iterator[Pair]:
    """A decode and a prefill server of two ranks (attention TP 2), both up."""
    with Pair(dataclasses.replace(BIG, state="", prefill_tp=2)) as pair:
        pair.start_prefill()
        pair.start_decode()
        yield pair


def test_a_prefill_server_dying_rank_by_rank_is_released_when_its_last_rank_dies() -> None:
    """SGLang's launcher takes a whole server down when one of its schedulers dies, one rank
    after another.  At the first death SGLang fails the server's rooms and forgets its
    ranks; a live rank may still be writing, so the rooms wait.  Here rank 0 is stopped
    first, so it can neither write nor acknowledge: the rooms must be released when it dies,
    not after the 30 s deferred-release timeout ("Failed-timeout"), and not before."""
    with _two_rank_prefill() as pair:
        pair.submit(list(range(1, 2001)), pages=4, window=6)
        pair.wait_until(pair.sent, 20)
        first, last = pair.prefill_procs[1], pair.prefill_procs[0]
        assert first.pid is not None and last.pid is not None
        os.kill(last.pid, signal.SIGSTOP)  # alive, mid-write perhaps, and silent
        os.kill(first.pid, signal.SIGKILL)
        time.sleep(0.5)  # SGLang fails the server's rooms; its rank 0 still lives
        killed = time.monotonic()  # before the kill: a release may come before we run again
        os.kill(last.pid, signal.SIGKILL)
        failed, statuses = _failed_rooms(pair)
        held = [o for o in failed if o.required_acks]  # rooms whose pages a rank held
        assert held, "no room was mid-transfer at the first kill"
        assert min(o.released_at for o in held) >= killed  # none while rank 0 could write
        assert max(o.released_at for o in failed) - killed < 2.0, statuses
        assert pair.settle() == (True, BIG.pages, BIG.slots)  # nothing landed after release


@pytest.mark.timeout(360)  # up to three runs of the scenario
def test_a_dead_ranks_missing_ack_does_not_hold_a_room_its_live_ranks_acked() -> None:
    """One rank of a two-rank prefill dies and the other lives on (SGLang's launcher did not
    take the server down).  SGLang counts a room's ABORT_ACKs, so the dead rank's missing
    one held every room for the 30 s timeout; each room is released once its live rank has
    acked, by the rank number its ACKs carry (1 here), and the dead one's write is known to
    have stopped.  Then the decode serves a new prefill.  The kill must find a room that
    both ranks were asked for: on a loaded host it may find none (every room in flight
    still bootstrapping), and the scenario is run again, up to three times."""
    for attempt in range(3):
        with _two_rank_prefill() as pair:
            pair.submit(list(range(1, 201)), pages=4, window=6)
            pair.wait_until(pair.sent, 20)
            dead, live = pair.prefill_procs  # rank 0 (its bootstrap server with it), rank 1
            assert dead.pid is not None
            os.kill(dead.pid, signal.SIGKILL)
            killed = time.monotonic()
            failed, statuses = _failed_rooms(pair)
            held = [o for o in failed if o.required_acks == 2]  # both ranks were sent its ABORT
            if not held and attempt < 2:
                continue
            assert held, "no room was mid-transfer at the kill, three times"
            assert all(o.acked == (1,) for o in held), [o.acked for o in held]  # the live rank's
            assert max(o.released_at for o in failed) - killed < 2.0, statuses
            assert pair.settle() == (True, BIG.pages, BIG.slots)  # nothing landed after release
            pair.reply(pair.prefills[1])  # the live rank gives up the rooms no decode asks for
            pair.prefills[1].send(("stop",))
            live.join(30)
            pair.start_prefill()
            pair.submit(list(range(5001, 5021)), pages=4, window=4)
            for conn in pair.prefills:
                pair.reply(conn)
            _, outcomes = pair.reply(pair.decode)
            assert all(o.status == "Success" and o.verified for o in outcomes.values())
            return


def test_an_aborted_room_waits_for_its_silent_rank_and_is_released_when_that_rank_dies() -> None:
    """Rooms the decode aborts while rank 1 of their two-rank prefill is stopped: rank 0
    acknowledges each ABORT at once, rank 1 cannot, and may yet write, so the rooms wait;
    an ACK must not count for a rank other than its sender's.  Then rank 0 dies, and SGLang
    forgets the server's ranks; it had forgotten the rooms already (a failed receiver is
    cleared before its ABORT goes).  So only the watch of rooms awaiting ACKs sees rank 1
    die next: then they are released at once, not after 30 s."""
    with _two_rank_prefill() as pair:
        first, silent = pair.prefill_procs[0], pair.prefill_procs[1]
        assert first.pid is not None and silent.pid is not None
        os.kill(silent.pid, signal.SIGSTOP)
        rooms = list(range(1, 5))
        pair.submit(rooms, pages=4, window=4, abort=frozenset(rooms))
        time.sleep(2.0)  # the rooms are bootstrapped, aborted and acknowledged by rank 0
        os.kill(first.pid, signal.SIGKILL)
        time.sleep(0.5)  # the watcher fails the server, and forgets it
        killed = time.monotonic()  # before the kill: a release may come before we run again
        os.kill(silent.pid, signal.SIGKILL)
        _, outcomes = pair.reply(pair.decode)
        assert [o.status for o in outcomes.values()] == ["Failed"] * len(rooms), outcomes
        assert all(o.required_acks == 2 and o.acked == (0,) for o in outcomes.values())
        released = [o.released_at - killed for o in outcomes.values()]
        assert min(released) >= 0 and max(released) < 2.0, released
        assert pair.settle() == (True, BIG.pages, BIG.slots)


def test_awaited_aborts_are_bounded_and_a_room_armed_twice_is_left_to_sglang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With deferred release off SGLang never clears a room (no
    `clear_deferred_abort_state`), and room ids are random: the noted ABORTs of a decode
    whose prefills keep failing must not grow without end, and the newest (those in flight)
    stay.  A room id armed by a second receiver while the first's ABORT awaits its ACKs must
    not have the first's ACKs checked against the second's ranks: SGLang's count decides it."""
    from shmslots.sglang import backend

    monkeypatch.setattr(backend, "DEAD_ROOMS", 4)
    aborts = backend._Aborts()
    one, two = {"rank_port": 1}, {"rank_port": 2}
    aborts.note(1, 7, [one, two])
    assert aborts.get(1) == (7, [one, two]) and aborts.entries() == [one, two]
    aborts.note(1, 8, [one])  # the same room id, another receiver
    assert aborts.get(1) is None and aborts.entries() == []
    aborts.discard(1)  # released: the next receiver of the id is noted again
    aborts.note(1, None, [one])  # an ABORT that armed nothing, to a room not noted
    assert aborts.get(1) is None and aborts.entries() == []
    aborts.note(1, 9, [two])
    assert aborts.get(1) == (9, [two])
    aborts.note(1, None, [one])  # another receiver's, unarmed (SGLang's `_clear`)
    assert aborts.get(1) is None
    aborts.discard(1)
    aborts.note(1, 9, [two])
    for room in range(2, 10):
        aborts.note(room, room, [one])
    assert aborts.get(1) is None and aborts.get(9) == (9, [one]) and len(aborts.entries()) == 4


def test_a_room_id_with_several_receivers_is_released_early_only_once_each_ones_ranks_stopped() -> (
    None
):
    """Clients may choose room ids, and SGLang asks whether a room may be released by id:
    the ranks that may write it are those of every live receiver of the id, of one prefill
    server or several (attention DP: one server, other ranks).  A release is early only if
    each such rank is dead (by identity: an equal entry fetched afresh names another
    process), or was sent the noted ABORT and acked it (an ACK's rank number answers only
    for a rank that ABORT went to).  A receiver with no rank entries yet has nothing
    writing it, and one SGLang let go of counts no more.  The receivers holding a rank
    entry noted dead are found by identity too (their rooms are failed)."""
    import gc

    from shmslots.sglang import backend

    class Receiver:  # what the holders read of SGLang's receiver
        def __init__(self, infos: list[dict[str, int]] | None) -> None:
            self.bootstrap_infos = infos

    rank = backend.ACK_RANK
    a0, a1, b0 = ({"rank_port": p, rank: n} for p, n in ((1, 0), (2, 1), (3, 0)))
    holders = backend._Holders()
    on_a, on_b, idle = Receiver([a0, a1]), Receiver([b0]), Receiver(None)
    for receiver in (on_a, on_b, idle):
        holders.hold(receiver, 7)
    holders.hold(Receiver([dict(b0)]), 7)  # let go of at once
    del receiver
    writers = holders.writers(7)
    assert sorted(e["rank_port"] for e in writers) == [1, 2, 3]
    holders.hold(Receiver([b0]), 8)  # another room of b's, let go of
    assert holders.holding([a1]) == [on_a] and holders.holding([b0]) == [on_b]
    assert holders.holding([dict(a1)]) == []  # an equal entry fetched afresh: another rank
    dead = {id(a0): a0, id(a1): a1}
    assert not backend._known_dead(writers, dead)  # b0 may be writing on_b's pages
    assert not backend._known_dead(writers, dead | {id(c): c for c in [dict(b0)]})
    assert backend._known_dead(writers, dead | {id(b0): b0})  # both servers died
    one_dead = {id(a0): a0}
    assert backend._acked_or_dead([a0, a1], [a0, a1], {1}, one_dead)  # a1 acked, a0 dead
    assert not backend._acked_or_dead([a0, a1], [a0, a1], {0}, {})  # a1's ACK missing
    assert not backend._acked_or_dead([a0, a1], writers, {0, 1}, {})  # b0 was not aborted
    del on_b, writers
    gc.collect()
    assert backend._acked_or_dead([a0, a1], holders.writers(7), {1}, one_dead)
    assert backend._known_dead(holders.writers(7), dead)
    del on_a, idle
    gc.collect()
    assert holders.writers(7) == []
    for room in range(8, 2000):  # receivers let go of are not remembered without end
        holders.hold(Receiver(None), room)
    assert len(holders._held) < 200


def test_a_rank_restarted_under_its_name_is_alive_and_one_gone_stays_dead() -> None:
    """The watcher tells ranks apart by registry, not by name: a prefill restarted at the
    same address (same name, new registry) is alive, or the rooms bootstrapped to it would
    be released while it writes them; a rank seen alive whose registry is then removed (it
    exited, or a sweep came) is dead, not "never seen"."""
    from shmslots.sglang import backend, samehost
    from shmslots.sglang.samehost.registry import Registry

    name = f"{samehost.PREFIX}ranks-test-{os.getpid()}"
    ranks = backend._Ranks()
    try:
        assert ranks.alive(name)  # never seen: not this host's, or not up yet
        first = Registry(name)
        assert ranks.alive(name)
        first.close()  # exits: its registry goes with it
        assert not ranks.alive(name) and not ranks.alive(name)
        again = Registry(name)  # restarted at the same address
        assert ranks.alive(name)
        again.close()
        restarted = Registry(name)  # died and restarted between two looks
        assert ranks.alive(name)
        ranks.keep_only(())
        restarted.close()
    finally:
        ranks.keep_only(())


def test_a_rank_let_go_of_and_then_removed_is_dead_and_one_unreadable_is_looked_at_again() -> None:
    """The watcher lets go of the ranks of servers SGLang forgot; if such a live rank is
    then killed and swept before its next look, it is dead, not "never seen" (a room
    awaiting its ACK would wait out SGLang's 30 s).  But only a missing file says so: a
    registry there that cannot be read now (descriptors or maps run out, a foreign file)
    is looked at again, never taken for dead."""
    from shmslots.segment import SHM_DIR
    from shmslots.sglang import backend, samehost
    from shmslots.sglang.samehost.registry import Registry

    name = f"{samehost.PREFIX}let-go-test-{os.getpid()}"
    ranks = backend._Ranks()
    try:
        live = Registry(name)
        assert ranks.alive(name)
        ranks.keep_only(())  # its server failed: no longer watched
        live.close()  # killed, and swept, before its next look
        assert not ranks.alive(name)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # unreadable as a
        os.close(fd)  # registry: not 0600, no size
        assert ranks.alive(name)
        os.unlink(path)
        assert not ranks.alive(name)
    finally:
        ranks.keep_only(())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


def test_decode_sigkilled_mid_transfer_prefill_fails_its_rooms_and_serves_a_new_decode() -> None:
    with Pair(BIG) as pair:
        pair.start_prefill()
        pair.start_decode()
        pair.submit(list(range(1, 2001)), pages=4, window=6)
        _kill_mid_transfer(pair, "decode")
        _, sent, refused, _ = pair.reply(pair.prefill)
        assert "Failed" in sent.values() and refused == 0
        pair.start_decode()  # a restarted decode: a new registry, a new session
        more = list(range(5001, 5041))
        pair.submit(more, pages=4, window=4)
        _, sent, _, _ = pair.reply(pair.prefill)
        _, outcomes = pair.reply(pair.decode)
        assert set(sent.values()) == {"Success"}
        assert all(o.status == "Success" and o.verified for o in outcomes.values())
        assert pair.settle() == (True, BIG.pages, BIG.slots)


@pytest.mark.timeout(240)  # five processes started one after another
def test_one_decode_rank_of_two_sigkilled_mid_transfer_fails_its_rooms_on_both_sides() -> None:
    """Decode at attention TP 2, its rank 1 SIGKILLed while the prefill (paused) has rooms
    whose halves it has yet to write: the prefill's write into the dead rank fails, and so
    does the room, on the prefill and on the live rank 0 (told so even if its own half
    landed: SGLang concludes a room only with every rank's), which releases it at the
    prefill's ACK, not
    SGLang's 30 s timeout; nothing lands in rank 0's released pages after.  Then the decode
    server comes back whole (SGLang's launcher takes it down when a rank dies) and is
    served."""
    shape = dataclasses.replace(BIG, state="", decode_tp=2)
    with Pair(shape) as pair:
        pair.start_prefill()
        pair.start_decode()
        pair.submit(list(range(1, 2001)), pages=4, window=6)
        # the prefill paused around the kill, so that the rooms whose page indices rank 1
        # sent before it died are written after (a transfer here takes about a millisecond:
        # a kill alone may land between them)
        pair.wait_until(pair.sent, 20)
        prefill = pair.prefill_procs[0].pid
        assert prefill is not None
        os.kill(prefill, signal.SIGSTOP)
        try:  # (no read of pair.sent here: the prefill may be stopped holding its lock)
            time.sleep(0.2)  # the decode ranks send their page indices for rooms in flight
            rank1 = pair.decode_procs[1]
            assert rank1.pid is not None
            os.kill(rank1.pid, signal.SIGKILL)
            killed = time.monotonic()
            rank1.join(10)
        finally:
            os.kill(prefill, signal.SIGCONT)
        _, sent, refused, sent_at = pair.reply(pair.prefill)
        assert refused == 0
        # sent, then failed: the writes into the dead rank (the rooms never sent failed at
        # the prefill's stall, waiting for rank 1's page indices)
        broken = {room for room in sent_at if sent[room] == "Failed"}
        assert broken, "the kill landed after every transfer"
        pair.decodes = pair.decodes[:1]  # rank 0's: rank 1 is gone
        # rooms rank 0 began after the kill wait for SGLang's timeouts: the prefill waits for
        # rank 1's page indices too
        pair.give_up()
        _, outcomes = pair.reply(pair.decode)
        statuses = Counter(o.status for o in outcomes.values())
        assert set(statuses) <= {"Success", "Failed", "NotStarted"}, statuses
        assert all(o.verified for o in outcomes.values() if o.status == "Success")
        for room in broken:
            o = outcomes[room]
            assert o.status == "Failed" and not o.given_up, o
            assert o.failed_at - killed < 10, o  # told by the prefill, not by a timeout
        for o in outcomes.values():
            if o.status == "Failed":  # released at the prefill's ACK, not after 30 s
                assert o.released_at - o.failed_at < 2.0, o
        assert pair.settle() == (True, shape.pages, shape.slots)  # nothing landed after
        pair.decodes[0].send(("stop",))
        pair.decode_procs[0].join(30)
        pair.start_decode()
        more = list(range(5001, 5021))
        pair.submit(more, pages=4, window=4)
        _, sent, _, _ = pair.reply(pair.prefill)
        assert set(sent.values()) == {"Success"}
        for conn in pair.decodes:
            _, outcomes = pair.reply(conn)
            assert all(o.status == "Success" and o.verified for o in outcomes.values())


def _registries_held(procs: list[Any]) -> set[str]:
    """The same-host registries `procs` hold open: each engine its own (its lock), and the
    peers' it watches."""
    from shmslots.segment import SHM_DIR
    from shmslots.sglang.samehost import PREFIX

    held = set()
    for proc in procs:
        fds = f"/proc/{proc.pid}/fd"
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):  # closed meanwhile
                path = os.readlink(os.path.join(fds, fd))
                if path.startswith(os.path.join(SHM_DIR, PREFIX)):
                    held.add(os.path.basename(path))
    return held


def test_a_pd_role_switch_serves_the_other_way_over_the_same_pools() -> None:
    """SGLang's PD role switch (`--enable-pd-role-switch`) flips an idle instance in place:
    `teardown_disaggregation` drops its manager, metadata buffers and allocator, and the other
    role is built over the same KV pools; each instance keeps its own bootstrap server, and its
    managers' receiving threads poll, so the teardown can stop them.  Here two instances swap
    roles, each in its own process: the old decode's table is unlinked, both old registries
    are removed and each side has a new one, and rooms go the other way, every byte checked.
    The harness calls `teardown_disaggregation` itself, as SGLang's `handle_pd_role_switch`
    does once its checks pass (its checks and its scheduler rebuild need a model)."""
    from shmslots.segment import SHM_DIR

    shape = Shape(state="mamba", role_switch=True)
    with Pair(shape) as pair:
        pair.start_switching()
        for first in (1000, 2000):
            rooms = list(range(first, first + 30))
            pair.submit(rooms, pages=3, window=4)
            _, sent, refused, _ = pair.reply(pair.prefill)
            _, outcomes = pair.reply(pair.decode)
            assert set(sent.values()) == {"Success"} and refused == 0
            assert sorted(outcomes) == rooms
            assert all(o.status == "Success" and o.verified for o in outcomes.values())
            assert pair.settle() == (True, shape.pages, shape.slots)
            if first == 1000:
                table, before = pair.decode_table, _registries_held(pair.procs)
                pair.switch_roles()
                assert not os.path.exists(os.path.join(SHM_DIR, table))
                assert pair.prefill_receives is False  # the new prefill's engine only sends
                assert len(before) == 2, before
                assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in before)
        after = _registries_held(pair.procs)
        assert len(after) == 2 and after.isdisjoint(before), (before, after)


def test_decode_abort_mid_transfer_is_acknowledged_at_once() -> None:
    with Pair(BIG) as pair:
        pair.start_prefill()
        pair.start_decode()
        rooms = list(range(1, 61))
        aborted = set(rooms[5::7])
        pair.submit(rooms, pages=4, window=6, abort=frozenset(aborted))
        pair.reply(pair.prefill)
        _, outcomes = pair.reply(pair.decode)
        for room, o in outcomes.items():
            if room in aborted:
                # released on prefill's drain ACK, not after SGLang's 30 s deferred timeout
                assert o.status == "Failed" and o.released_at - o.failed_at < 2.0
            else:
                assert o.status == "Success" and o.verified
        assert pair.settle() == (True, BIG.pages, BIG.slots)


def test_page_indices_out_of_range_are_refused_and_nothing_is_written() -> None:
    with Pair(Shape()) as pair:
        pair.start_prefill()
        pair.start_decode()
        rooms = list(range(1, 41))
        bad = frozenset(rooms[3::9])
        pair.submit(rooms, pages=3, window=4, bad=bad)
        _, _, refused, _ = pair.reply(pair.prefill)
        _, outcomes = pair.reply(pair.decode)
        assert refused == len(bad)
        for room, o in outcomes.items():
            if room in bad:
                assert o.status == "Failed" and o.released_at - o.failed_at < 2.0
            else:
                assert o.status == "Success" and o.verified
        # the bad rooms' real pages hold the canary written at their release: untouched
        assert pair.settle() == (True, Shape().pages, Shape().slots)
