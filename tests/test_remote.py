"""Remote writers through the real transfer engines (Mooncake over TCP, NIXL over UCX), on
loopback and across network namespaces: every test that moves rows runs on both.  An
engine's tests are skipped, with the reason, only where it cannot be imported."""

from __future__ import annotations

import ctypes
import gc
import mmap
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import SMALL, row_bytes, small_row
from shmslots.workers import eagle
from shmslots.workers.launcher import SPAWN
from shmslots.workers.netns import Namespace, NamespaceUnavailable, veth_namespace
from shmslots.workers.remote_flow import (
    RemoteFlowConfig,
    RemoteFlowResult,
    grant_batch,
    native_stderr_to,
    remote_writer,
    run_remote_flow,
)

from shmslots import (
    Field,
    InvalidArgument,
    SchemaError,
    SlotsExhausted,
    SlotTable,
    TableClosed,
    row_hash,
)
from shmslots.layout import VERSION
from shmslots.remote import (
    ENGINES,
    Engine,
    EngineError,
    Grant,
    GrantError,
    GrantListener,
    RemoteServer,
    RemoteUnavailable,
    RemoteWriter,
    Settled,
    connect,
    mooncake,
    nixl,
    open_engine,
)
from shmslots.remote import grant as grant_module
from shmslots.remote.engine import address_of
from shmslots.remote.grant import COMMIT, row_format
from shmslots.schema import RowSchema


def _missing(load: Callable[[], object]) -> str:
    """Why an engine cannot be used here, or "" where it can."""
    try:
        load()
    except RemoteUnavailable as exc:
        return str(exc)
    return ""


MISSING = {"mooncake": _missing(mooncake.load), "nixl": _missing(nixl.load)}


@pytest.fixture(params=ENGINES)
def kind(request: pytest.FixtureRequest) -> str:
    """Each engine in turn; skipped, saying why, where it cannot be imported."""
    kind: str = request.param
    if MISSING[kind]:
        pytest.skip(MISSING[kind])
    return kind


@pytest.fixture(scope="module")
def mooncake_pair() -> tuple[Engine, Engine]:
    """One Mooncake pair per module: Mooncake engines have no close."""
    return open_engine("mooncake"), open_engine("mooncake")


@pytest.fixture
def engines(kind: str, request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine]]:
    """An owner's and a writer's engine of `kind`."""
    if kind == "mooncake":
        yield request.getfixturevalue("mooncake_pair")
        return
    pair = (open_engine(kind), open_engine(kind))
    yield pair
    for engine in pair:
        engine.close()


@contextmanager
def served(
    name: str,
    engines: tuple[Engine, Engine],
    *,
    slots: int,
    commit_timeout_s: float = 10.0,
    late_write_window_s: float = 10.0,
    batch: int = 64,
) -> Iterator[tuple[SlotTable, RemoteServer, RemoteWriter]]:
    """A table, its RemoteServer on the owner engine, and a RemoteWriter on the other."""
    owner, remote = engines
    with (
        SlotTable.create(name, SMALL, slots=slots) as table,
        RemoteServer(
            table,
            owner,
            commit_timeout_s=commit_timeout_s,
            late_write_window_s=late_write_window_s,
        ) as server,
        RemoteWriter(remote, table.schema, batch=batch) as writer,
    ):
        writer.connect(server.contact())
        yield table, server, writer


def _poll_until(
    server: RemoteServer, done: Callable[[RemoteServer, Settled], object], timeout: float = 10.0
) -> Settled:
    """Poll until `done(server, settled so far)`; fails the test after `timeout` s."""
    settled = Settled()
    deadline = time.monotonic() + timeout
    while not done(server, settled):
        assert time.monotonic() < deadline, f"remote server stuck at {server.stats}"
        settled.extend(server.poll())
        time.sleep(0.005)
    return settled


# -- no engine needed -------------------------------------------------------------------


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",
        Grant("h:1", (1,), (64,), (2,), 3, 4, 5, 6, 7).encode()[:-1],
        msgpack.packb(["h:1", [1], [64], [2], 3, 2**32, 5, 6, 7]),  # generation out of range
        msgpack.packb(["h:1", [-1], [64], [2], 3, 4, 5, 6, 7]),
        msgpack.packb(["h:1", [1], [64], [2], 3, 4, 5, 6, True]),
        msgpack.packb(["h:1", 1, 64, 2, 3, 4, 5, 6, 7]),  # one column, not a list of them
        msgpack.packb(["h:1", [], [], [], 3, 4, 5, 6, 7]),  # no field
        msgpack.packb(["h:1", [1, 2], [64, 64], [2], 3, 4, 5, 6, 7]),  # lengths for fewer fields
        msgpack.packb(["h:1", [1], [64], [65], 3, 4, 5, 6, 7]),  # a field longer than its item
        msgpack.packb(["h:1", [2**64 - 255], [64], [8], 3, 4, 5, 6, 7]),  # slot 3 past 64 bits
        msgpack.packb(["h:1", [1], [2**27], [2**27], 3, 4, 5, 6, 7]),  # longer than any row
        msgpack.packb(["h:1", [1] * 65, [64] * 65, [2] * 65, 3, 4, 5, 6, 7]),  # too many fields
        msgpack.packb(["h:1", [1.0], [64], [2], 3, 4, 5, 6, 7]),
    ],
)
def test_a_malformed_grant_is_refused(blob: bytes) -> None:
    with pytest.raises(GrantError):
        Grant.decode(blob)


def test_a_grant_survives_its_encoding() -> None:
    grant = Grant(
        "10.0.0.1:15000",
        (0x7F00_0000_1000, 0x7F00_0000_9000, 2**64 - 256),
        (64, 128, 64),
        (8, 128, 64),
        3,
        2**32 - 1,
        2**64 - 1,
        12345,
        2**63,
    )
    assert Grant.decode(grant.encode()) == grant
    assert grant.targets == (0x7F00_0000_1000 + 192, 0x7F00_0000_9000 + 384, 2**64 - 64)
    assert grant.commit(0xABC) == f"3:{2**32 - 1}:{2**63:016x}:00000abc"


def test_a_link_takes_only_a_peer_with_its_token() -> None:
    listener = GrantListener()
    try:
        intruder = connect(listener.address, "not-the-token")
        with pytest.raises(TimeoutError):
            listener.accept(timeout=1.0)
        writer = connect(listener.address, listener.token)
        link = listener.accept(timeout=10.0)  # the intruder before it is dropped
        writer.send({"hello": 1})
        assert link.recv(10.0) == {"hello": 1}
        for end in (intruder, writer, link):
            end.close()
    finally:
        listener.close()


def test_a_slow_peer_cannot_hold_accept_past_its_deadline() -> None:
    listener = GrantListener()
    try:
        host, port = listener.address.split(":")
        with socket.create_connection((host, int(port))) as slow:
            slow.sendall(b"\x10\x00\x00\x00")  # a 16-byte token frame that never comes
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                listener.accept(timeout=1.0)
            assert time.monotonic() - started < 2.0
    finally:
        listener.close()


# -- one process, two real engines -------------------------------------------------------


def test_ref_fields_cannot_be_written_remotely(name: str, engines: tuple[Engine, Engine]) -> None:
    fields = [Field("x", "float32", (None,), kind="ref")]
    with SlotTable.create(name, fields, slots=2, arena_bytes=1 << 16) as table:
        with pytest.raises(SchemaError, match="ref fields"):
            RemoteServer(table, engines[0])
        with pytest.raises(SchemaError, match="ref fields"):
            RemoteWriter(engines[1], table.schema)


def test_a_remote_row_lands_in_place_exactly_as_packed(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    with served(name, engines, slots=4) as (table, server, writer):
        ptrs, _, item_lens = table.buffer_infos()
        grants = [server.grant(tag) for tag in (11, 12, 13)]
        for g in grants:  # the table's columns; each field's own bytes, not the padding
            assert (list(g.ptrs), list(g.item_lens)) == (ptrs, item_lens)
            assert g.lengths == tuple(f.nbytes for f in SMALL)
        writer.write([(g, small_row(g.tag)) for g in grants])
        settled = _poll_until(server, lambda s, got: len(got.published) == 3)
        assert settled.published == [11, 12, 13]
        for g in grants:
            lease = table.take()
            assert lease is not None
            with lease:
                assert (lease.tag, lease.slot) == (g.tag, g.slot) and lease.verify()
                assert int(lease.view("id")) == g.tag
                h = lease.view("h")
                assert torch.equal(h, small_row(g.tag)["h"])
                assert h.data_ptr() == g.targets[2]  # where the engine wrote it: no copy
                del h
        assert server.stats.committed == 3 and server.held == 0


def test_rows_in_adjacent_slots_each_land_in_their_own_row(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    """Rows in slots side by side go as one engine entry per field, padding and all: each
    still lands in its own row, in whatever order they were given, and a slot between two
    runs that this batch does not write keeps its bytes."""
    with served(name, engines, slots=6, batch=8) as (table, server, writer):
        grants = [server.grant(tag) for tag in range(1, 7)]
        assert [g.slot for g in grants] == list(range(6))
        skipped = grants.pop(2)
        before = row_bytes(table, skipped.slot)
        writer.write([(g, small_row(g.tag)) for g in reversed(grants)])  # runs 0-1 and 3-5
        settled = _poll_until(server, lambda s, got: len(got.published) == 5)
        assert sorted(settled.published) == [1, 2, 4, 5, 6]
        assert row_bytes(table, skipped.slot) == before
        for _ in grants:
            lease = table.take()
            assert lease is not None
            with lease:
                assert lease.verify() and lease.item("id") == lease.tag
                assert torch.equal(lease.view("p"), small_row(lease.tag)["p"])
                assert torch.equal(lease.view("h"), small_row(lease.tag)["h"])
        assert server.abort(skipped)


def test_a_writer_checks_every_row_before_sending(
    name: str, engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    with served(name, engines, slots=4, commit_timeout_s=0.2) as (table, server, writer):
        good, other = server.grant(1), server.grant(2)
        foreign = Grant(**{**good.__dict__, "fingerprint": good.fingerprint ^ 1})
        # an owner of another table format (another checksum): the same schema, refused
        monkeypatch.setattr(grant_module, "VERSION", VERSION - 1)
        older = Grant(**{**good.__dict__, "fingerprint": row_format(table.schema)})
        monkeypatch.undo()
        assert older.fingerprint != good.fingerprint
        shorter = Grant(**{**good.__dict__, "lengths": (*good.lengths[:-1], 16)})
        strided = Grant(**{**good.__dict__, "item_lens": (*good.item_lens[:-1], 128)})
        bad_dtype = {**small_row(2), "p": torch.zeros(4, dtype=torch.float64)}
        missing = {k: v for k, v in small_row(2).items() if k != "h"}
        for rows, error in [
            ([(good, small_row(1)), (foreign, small_row(1))], GrantError),
            ([(good, small_row(1)), (older, small_row(1))], GrantError),
            ([(good, small_row(1)), (shorter, small_row(1))], GrantError),
            ([(good, small_row(1)), (strided, small_row(1))], GrantError),
            ([(good, small_row(1)), (other, bad_dtype)], SchemaError),
            ([(good, small_row(1)), (other, missing)], SchemaError),
        ]:
            with pytest.raises(error):
                writer.write(rows)
        # nothing was sent, not even the good row: both grants expire unpublished
        settled = _poll_until(server, lambda s, got: s.pending == 0)
        assert settled.published == [] and sorted(settled.expired) == [1, 2]
        assert table.take() is None and table.stats().owned == server.held == 2  # held back


def _end(server: RemoteServer, grant: Grant, fate: str) -> None:
    """End a grant unpublished: the owner aborts it, or it expires without a commit."""
    if fate == "aborted":
        assert server.abort(grant) and not server.abort(grant)
    else:
        assert _poll_until(server, lambda s, got: s.pending == 0).expired == [grant.tag]


@pytest.mark.parametrize("fate", ["aborted", "expired"])
@pytest.mark.parametrize("window_s", [0.0, 1.0])
def test_a_late_write_never_reaches_a_later_owner(
    name: str, engines: tuple[Engine, Engine], fate: str, window_s: float
) -> None:
    """One slot, so the next grant gets the very row the late write targets.  With the
    quarantine's window the slot is no one else's while the late bytes land, and the next
    owner's row stays its own; with no window (the bug the quarantine exists for) they
    land in the next owner's row while a reader holds it."""
    one_slot = served(name, engines, slots=1, commit_timeout_s=0.2, late_write_window_s=window_s)
    with one_slot as (table, server, writer):
        late = server.grant(1)
        _end(server, late, fate)
        if not window_s:  # the bug: the slot is reused at once
            victim = server.grant(2)
            assert victim.slot == late.slot and victim.targets == late.targets
            writer.write([(victim, small_row(2))])
            assert _poll_until(server, lambda s, got: got.published).published == [2]
            lease = table.take()
            assert lease is not None and lease.verify()
            writer.write([(late, small_row(1))])  # request 1's write, late
            deadline = time.monotonic() + 10
            while lease.item("id") != 1:  # the reader's row turns into request 1's
                assert time.monotonic() < deadline, "the late write never landed"
                time.sleep(0.005)
            assert not lease.verify()
            lease.release()
            _poll_until(server, lambda s, got: s.stats.late == 1)  # its commit: discarded
            return
        assert server.held == 1 and table.stats().owned == 1
        with pytest.raises(SlotsExhausted):
            server.grant(2, timeout=0.05)  # held back, not reused
        writer.write([(late, small_row(1))])  # lands in the held row: no one owns it
        assert server.held == 1
        _poll_until(server, lambda s, got: s.stats.late == 1)  # its commit: discarded
        assert table.take() is None
        victim = _poll_grant(server, 2, window_s + 5)  # once the window has passed
        assert victim.slot == late.slot and server.held == 0
        writer.write([(victim, small_row(2))])
        assert _poll_until(server, lambda s, got: got.published).published == [2]
        lease = table.take()
        assert lease is not None
        with lease:
            time.sleep(0.1)  # room for any byte still on its way
            assert lease.verify() and lease.item("id") == 2
            assert torch.equal(lease.view("h"), small_row(2)["h"])
        stats = server.stats
        assert (stats.late, stats.quarantined, stats.committed) == (1, 1, 1)
        assert table.stats().owned == 0


def _poll_grant(server: RemoteServer, tag: int, timeout: float) -> Grant:
    """A grant as soon as a slot comes free (held-back slots are freed by poll or grant)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return server.grant(tag, timeout=0.01)
        except SlotsExhausted:
            assert time.monotonic() < deadline, f"no slot freed in {timeout} s: {server.stats}"
            server.poll()


def test_a_commit_whose_row_does_not_hash_to_it_is_rejected_and_held(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    with served(name, engines, slots=2, late_write_window_s=0.3) as (table, server, writer):
        torn = server.grant(3)
        writer.write([(torn, small_row(3))], commit=False)
        wrong = torn.commit(row_hash([b"not", b"this", b"row"]))
        writer.engine.write(torn.session, [], [], [], (COMMIT, wrong))
        assert _poll_until(server, lambda s, got: got.rejected).rejected == [3]
        assert server.held == 1 and table.take() is None  # refused, and its slot kept back
        writer.engine.write(torn.session, [], [], [], (COMMIT, wrong))  # again: late now
        foreign = (COMMIT, "garbage;4:x;²:0:0000000000000000:00000000;3:0:" + "9" * 5000)
        writer.engine.write(torn.session, [], [], [], foreign)
        _poll_until(server, lambda s, got: s.stats.malformed == 4 and s.stats.late == 1)
        # a commit without its checksum names no grant: malformed too
        fresh = server.grant(4)
        writer.write([(fresh, small_row(4))], commit=False)
        writer.engine.write(fresh.session, [], [], [], (COMMIT, fresh.commit_key))
        _poll_until(server, lambda s, got: s.stats.malformed == 5)
        assert server.pending == 1  # still the real writer's
        writer.write([(fresh, small_row(4))])
        assert _poll_until(server, lambda s, got: got.published).published == [4]
        _poll_until(server, lambda s, got: s.held == 0)  # the window passed
        stats = server.stats
        assert (stats.committed, stats.rejected, stats.quarantined) == (1, 1, 1)
        lease = table.take()
        assert lease is not None and lease.verify() and lease.item("id") == 4
        lease.release()
        assert table.stats().owned == 0


def test_a_row_the_table_refuses_after_the_servers_check_is_held_back_not_freed(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    """The row changed between the server's checksum and the table's own (a write still
    landing): the slot was aborted to FREE at once and granted again (#24, defect 3).  The
    table's check is reached here with a checksum the row does not hash to, as it would be
    by a row that changed after the server's matched."""
    with served(name, engines, slots=1, late_write_window_s=0.3) as (table, server, writer):
        grant = server.grant(6)
        writer.write([(grant, small_row(6))], commit=False)
        reservation = server._pending[grant.commit_key].reservation
        started = time.monotonic()  # before the window starts: a stall cannot shorten it
        assert not server._publish(reservation, row_hash([b"changed", b"since"]))
        assert server.held == 1 and table.stats().states["QUARANTINED"] == 1  # closed to all
        with pytest.raises(SlotsExhausted):
            server.grant(7, timeout=0.05)  # its slot is not granted again within the window
        again = server.grant(8, timeout=5.0)  # the grant's own reserve frees it in time
        assert time.monotonic() - started >= 0.29 and again.slot == grant.slot
        assert server.held == 0 and table.stats().counters["quarantines_ended"] == 1
        server.abort(again)


def test_a_stray_commit_cannot_use_up_a_grant(name: str, engines: tuple[Engine, Engine]) -> None:
    with served(name, engines, slots=2) as (table, server, writer):
        grant = server.grant(5)
        stray = Grant(**{**grant.__dict__, "nonce": grant.nonce ^ 1})  # right slot and gen
        guessed = stray.commit(row_hash([b"\0" * f.nbytes for f in SMALL]))
        writer.engine.write(grant.session, [], [], [], (COMMIT, guessed))
        _poll_until(server, lambda s, got: s.stats.late == 1)
        assert server.pending == 1  # still the real writer's
        writer.write([(grant, small_row(5))])
        assert _poll_until(server, lambda s, got: got.published).published == [5]
        lease = table.take()
        assert lease is not None and lease.verify()
        lease.release()


def test_every_row_is_checked_before_the_first_batch_leaves(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    with served(name, engines, slots=4, commit_timeout_s=0.3, batch=2) as (table, server, writer):
        grants = [server.grant(tag) for tag in (1, 2, 3, 4)]
        rows = [(g, small_row(g.tag)) for g in grants]
        rows[3] = (grants[3], {**small_row(4), "p": torch.zeros(5)})  # in the second batch
        with pytest.raises(SchemaError):
            writer.write(rows)
        settled = _poll_until(server, lambda s, got: s.pending == 0)
        assert settled.published == [] and sorted(settled.expired) == [1, 2, 3, 4]
        assert table.take() is None and table.stats().owned == server.held == 4


def test_a_server_owns_its_engine_and_refuses_work_once_closed(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    owner, remote = engines
    with (
        SlotTable.create(name, SMALL, slots=2) as table,
        RemoteWriter(remote, table.schema) as writer,
    ):
        server = RemoteServer(table, owner)
        writer.connect(server.contact())
        with pytest.raises(ValueError, match="one RemoteServer per Engine"):
            RemoteServer(table, owner)
        server.grant(1)
        aborted = server.grant(2)
        assert server.abort(aborted)
        assert server.held == 1 and table.stats().owned == 2
        server.close()
        # the pending grant was aborted and the held-back slot freed, since the engine no
        # longer writes into the table: a late write now is refused by the owner's engine
        # (Mooncake) or finds it closed (NIXL, whose owner side cannot refuse one)
        assert table.stats().owned == 0 and server.stats.aborted == 2
        before = row_bytes(table, aborted.slot)
        with pytest.raises(EngineError):
            writer.write([(aborted, small_row(2))])
        assert row_bytes(table, aborted.slot) == before
        for call in (lambda: server.grant(2), server.poll, server.contact):
            with pytest.raises(ValueError, match="closed"):
                call()
        if owner.refuses_unregistered:
            RemoteServer(table, owner).close()  # the engine is free again
        else:
            with pytest.raises(EngineError, match="closed"):
                RemoteServer(table, owner)


def test_a_table_closed_before_its_server_stays_mapped_for_the_engine(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    """The engine writes into the table's mapping until the server unregisters it: a table
    closed first must not unmap it under a write (which would land in whatever is mapped
    there next, or crash the owner)."""
    owner, remote = engines
    with RemoteWriter(remote, RowSchema(SMALL)) as writer:
        table = SlotTable.create(name, SMALL, slots=2)
        server = RemoteServer(table, owner)
        writer.connect(server.contact())
        grant = server.grant(7)
        table.close()  # the table leaves; its server is still serving
        table.unlink()
        writer.write([(grant, small_row(7))])  # lands in the mapping the server keeps
        assert ctypes.c_int64.from_address(grant.targets[0]).value == 7
        with pytest.raises(TableClosed):
            server.poll()
        server.close()
        assert server.stats.aborted == 1


def test_a_writer_killed_mid_transfer_costs_only_its_own_grants(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    """A writer process SIGKILLed while rows are on the wire: its grants expire and are
    held back, nothing torn is published, every slot comes back, and the owner's engine
    goes on serving another writer.  The writer is stopped wherever it is before its last
    grants are sent, so those (at least) are still unserved when it dies: a fast writer
    cannot finish them first and leave nothing to expire."""
    owner, survivor = engines
    shape = eagle.RowShape()
    with (
        SlotTable.create(name, shape.fields(), slots=32) as table,
        RemoteServer(table, owner, commit_timeout_s=0.5, late_write_window_s=0.3) as server,
    ):
        with remote_writer(server, options=("--batch", "8")) as writer:
            tag = 1
            deadline = time.monotonic() + 30
            while server.stats.committed < 16:  # rows are landing: kill it mid-stream
                assert time.monotonic() < deadline, f"the writer never committed: {server.stats}"
                grants = grant_batch(server, tag, 10_000, 24, 8)
                tag += len(grants)
                if grants:
                    writer.link.send({"grants": [g.encode() for g in grants]})
                server.poll()
                while (lease := table.take()) is not None:
                    with lease:
                        assert lease.verify() and lease.item("output_id") == eagle.output_id(
                            lease.tag
                        )
            writer.process.send_signal(signal.SIGSTOP)  # mid-stream, maybe mid-write
            grants = grant_batch(server, tag, 10_000, 32, 8)  # in flight as it dies
            writer.link.send({"grants": [g.encode() for g in grants]})
            writer.process.send_signal(signal.SIGKILL)
            assert writer.process.wait(10) == -signal.SIGKILL
        settled = _poll_until(server, lambda s, got: s.pending == 0 and s.held == 0)
        assert grants and {g.tag for g in grants} <= set(settled.expired)
        while (lease := table.take()) is not None:  # what it committed before it died
            with lease:
                assert lease.verify() and lease.item("output_id") == eagle.output_id(lease.tag)
        stats = server.stats
        assert stats.granted == stats.committed + stats.expired + stats.rejected
        assert stats.expired > 0 and table.stats().owned == 0
        assert table.check_consistency() == []
        with RemoteWriter(survivor, table.schema) as writer2:  # the owner's engine still serves
            writer2.connect(server.contact())
            grant = server.grant(99_999)
            writer2.write([(grant, eagle.row_values(grant.tag, shape, time.monotonic_ns()))])
            assert _poll_until(server, lambda s, got: got.published).published == [99_999]
            lease = table.take()
            assert lease is not None
            with lease:
                assert lease.verify() and lease.item("output_id") == eagle.output_id(99_999)


def test_a_nixl_writer_must_load_the_owners_contact_first(name: str) -> None:
    """NIXL peers find each other only by the contact: a write to a peer never connected is
    refused before anything is sent, and the grant is not used up."""
    if MISSING["nixl"]:
        pytest.skip(MISSING["nixl"])
    owner, remote = open_engine("nixl"), open_engine("nixl")
    try:
        with (
            SlotTable.create(name, SMALL, slots=2) as table,
            RemoteServer(table, owner) as server,
            RemoteWriter(remote, table.schema) as writer,
        ):
            grant = server.grant(1)
            with pytest.raises(EngineError, match="connect"):
                writer.write([(grant, small_row(1))])
            writer.connect(server.contact())
            writer.write([(grant, small_row(1))])
            assert _poll_until(server, lambda s, got: got.published).published == [1]
            table.take().release()  # type: ignore[union-attr]
    finally:
        remote.close()
        owner.close()


def test_a_bad_contact_is_refused(engines: tuple[Engine, Engine]) -> None:
    for contact in (b"\xff\xfe", b"", b"no-port", b"host:99999", b"\x00" * 64):
        with pytest.raises(EngineError):
            engines[1].connect(contact)


def test_notifies_under_other_names_are_dropped_and_counted(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    """Any peer can send the owner notifies: those under names the server does not listen
    for (NIXL's without a name among them) are counted and dropped, not kept forever."""
    with served(name, engines, slots=2) as (table, server, writer):
        grant = server.grant(1)
        for i in range(200):
            writer.engine.write(grant.session, [], [], [], (f"junk-{i}", "x" * 100))
        _poll_until(server, lambda s, got: s.stats.foreign == 200)
        assert list(server.engine._inbox) == [COMMIT]  # nothing else is kept
        writer.write([(grant, small_row(1))])
        assert _poll_until(server, lambda s, got: got.published).published == [1]
        table.take().release()  # type: ignore[union-attr]


def test_a_nixl_write_that_fails_to_post_leaves_no_transfer_behind(name: str) -> None:
    """A write to an owner that has gone fails; its transfer request is released all the
    same, so the writer's agent goes when its engine closes (a request left behind holds
    it, and its UCX worker, for as long as the error is kept)."""
    if MISSING["nixl"]:
        pytest.skip(MISSING["nixl"])
    owner, remote = open_engine("nixl"), open_engine("nixl")
    with SlotTable.create(name, SMALL, slots=2) as table:
        server = RemoteServer(table, owner)
        with RemoteWriter(remote, table.schema) as writer:
            writer.connect(server.contact())
            grant = server.grant(1)
            server.close()  # closes the owner's NIXL engine
            errors = []
            for _ in range(3):
                with pytest.raises(EngineError) as caught:
                    writer.write([(grant, small_row(1))])
                errors.append(caught.value)  # kept, with their tracebacks
        agent = weakref.ref(remote._agent.agent)  # type: ignore[attr-defined]
        remote.close()
        gc.collect()
        assert agent() is None and len(errors) == 3


def _stalled_owner(contact_out: Connection, size: int) -> None:
    """An owner whose memory a writer may target, stopped by the test (SIGSTOP)."""
    buffer = mmap.mmap(-1, size)
    with open_engine("nixl") as engine:
        engine.register(address_of(buffer), size)
        contact_out.send((engine.contact(), address_of(buffer)))
        time.sleep(120)  # killed long before


def test_a_nixl_write_to_a_stalled_owner_times_out_saying_it_may_still_land() -> None:
    if MISSING["nixl"]:
        pytest.skip(MISSING["nixl"])
    with pytest.raises(InvalidArgument):
        nixl.NixlEngine(transfer_timeout_s=0)
    size = 128 << 20
    ours, theirs = SPAWN.Pipe()
    owner = SPAWN.Process(target=_stalled_owner, args=(theirs, size))
    owner.start()
    try:
        assert ours.poll(60)
        contact, target = ours.recv()
        source = mmap.mmap(-1, size)
        with nixl.NixlEngine(transfer_timeout_s=1.0) as writer:
            writer.register(address_of(source), size)
            session = writer.connect(contact)
            assert owner.pid is not None
            os.kill(owner.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(EngineError, match=r"timed out after 1\.0 s.*may still land"):
                writer.write(session, [address_of(source)], [target], [size])
            assert time.monotonic() - started < 10
    finally:
        if owner.pid is not None:
            os.kill(owner.pid, signal.SIGCONT)
        owner.kill()
        owner.join(10)


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="mooncake, nixl"):
        open_engine("carrier-pigeon")


def test_a_process_that_used_an_engine_exits_cleanly(kind: str, tmp_path: Path) -> None:
    """Both engines' libraries start threads and load transports; the process that used one
    must still exit with its own status (NIXL's wheel crashed every such exit until its
    InfiniBand modules were kept out on machines without a device)."""
    script = tmp_path / "use_engine.py"
    script.write_text(
        "import mmap, sys\n"
        "from shmslots.remote import open_engine\n"
        "from shmslots.remote.engine import address_of\n"
        f"a, b = open_engine({kind!r}), open_engine({kind!r})\n"
        "src, dst = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)\n"
        "src[:5] = b'hello'\n"
        "a.register(address_of(dst), 4096); b.register(address_of(src), 4096)\n"
        "b.write(b.connect(a.contact()), [address_of(src)], [address_of(dst)], [5])\n"
        "assert dst[:5] == b'hello'\n"
        "sys.exit(7)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}  # as a user starts it
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 7, done.stderr[-2000:]


# -- the flow: spawned remote writer, decode worker, owner --------------------------------


REQUESTS = RemoteFlowConfig.requests


def _check_flow(result: RemoteFlowResult, requests: int) -> None:
    settled, remote, decode = result.settled, result.remote, result.decode
    published, aborted = set(settled.published), set(result.aborted)
    uncommitted = set(result.uncommitted)
    assert len(published) == len(settled.published)
    # every grant has exactly one fate
    fates = published | aborted | set(settled.expired) | set(settled.rejected)
    assert len(fates) == requests == remote.granted
    assert remote.granted == (remote.committed + remote.aborted + remote.expired + remote.rejected)
    # every published row reached the decode worker and verified; nothing else did
    handled = decode.consumed + decode.aborted
    assert sorted(handled) == sorted(published)
    assert decode.corrupted == 0 and decode.verified == len(decode.consumed) >= 2000
    # rows the writer never committed expired, and so did any it was slower to commit than
    # the commit timeout (a writer stalled on a loaded machine)
    never, expired = uncommitted - aborted, set(settled.expired)
    assert never <= expired and never
    # a write for an aborted or slow-expired grant came anyway: discarded, counted
    assert remote.late == len(aborted - uncommitted) + len(expired - never)
    assert aborted - uncommitted
    # every grant that ended unpublished had its slot held back for late writes, and freed
    # by the end
    assert remote.quarantined == len(aborted) + len(settled.expired) + len(settled.rejected)
    assert result.final.owned == 0 and result.final.queued == 0
    assert result.consistency == []


@pytest.mark.timeout(180)
def test_remote_flow_on_loopback(name: str, kind: str) -> None:
    config = RemoteFlowConfig(
        requests=REQUESTS, never_commit_every=97, commit_timeout_s=1.0, engine=kind
    )
    _check_flow(run_remote_flow(config, name), REQUESTS)


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    try:
        with veth_namespace("shmslots-t") as ns:
            yield ns
    except NamespaceUnavailable as exc:
        pytest.skip(str(exc))


def _flow_in_a_fresh_process(config: RemoteFlowConfig, name: str) -> RemoteFlowResult:
    """`run_remote_flow` in a process of its own: UCX takes the machine's interfaces once
    per process, so an owner that made a NIXL engine before the namespace existed cannot
    reach into it."""
    results: mp.Queue[RemoteFlowResult] = SPAWN.Queue()
    owner = SPAWN.Process(target=_run_flow_into, args=(config, name, results))
    owner.start()
    try:
        return results.get(timeout=170)
    finally:
        owner.join(10)
        if owner.is_alive():
            owner.kill()
            owner.join(5)


def _run_flow_into(
    config: RemoteFlowConfig, name: str, results: mp.Queue[RemoteFlowResult]
) -> None:
    results.put(run_remote_flow(config, name))


@pytest.mark.timeout(180)
def test_remote_flow_across_network_namespaces(name: str, kind: str, namespace: Namespace) -> None:
    config = RemoteFlowConfig(
        engine=kind,
        requests=REQUESTS,
        never_commit_every=97,
        commit_timeout_s=1.0,
        owner_host=namespace.outside_ip,
        writer_host=namespace.inside_ip,
        writer_prefix=namespace.prefix,
    )
    _check_flow(_flow_in_a_fresh_process(config, name), REQUESTS)


@pytest.mark.skipif(bool(MISSING["mooncake"]), reason=MISSING["mooncake"])
@pytest.mark.timeout(180)
def test_the_engines_log_goes_to_the_file_chosen(
    name: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "engine.log"
    with native_stderr_to(str(log)):
        result = run_remote_flow(RemoteFlowConfig(requests=200), name)
    print("python's own stderr still shows", file=sys.stderr)
    err = capfd.readouterr().err
    assert "Transfer Engine" not in err and "python's own stderr still shows" in err
    assert log.read_text().count("listening on") == 2  # our engine and the writer's
    assert len(result.settled.published) + len(result.aborted) + len(result.settled.expired) > 0
    assert result.final.owned == 0


@pytest.mark.skipif(bool(MISSING["nixl"]), reason=MISSING["nixl"] or "")
def test_nixl_sets_its_ucx_settings_only_while_its_agent_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX_TLS, UCX_MODULES and NIXL_LOG_LEVEL are set around the agent's start and only
    where the user has not set them: every other UCX user in the process sees its own (#36)."""
    monkeypatch.setenv("UCX_TLS", "^cma,rc")  # the user's own
    monkeypatch.delenv("UCX_MODULES", raising=False)
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)
    with nixl.NixlEngine() as engine:
        assert engine.session
        assert os.environ["UCX_TLS"] == "^cma,rc"
        assert "UCX_MODULES" not in os.environ and "NIXL_LOG_LEVEL" not in os.environ
