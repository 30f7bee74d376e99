"""Remote writers through the real Mooncake Transfer Engine (TCP), on loopback and across
network namespaces.  Skipped, with the reason, only where the engine cannot be imported."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import SMALL, small_row

from shmslots import Field, SchemaError, SlotTable
from shmslots.remote import (
    Engine,
    Grant,
    GrantError,
    GrantListener,
    RemoteServer,
    RemoteUnavailable,
    RemoteWriter,
    Settled,
    connect,
)
from shmslots.remote.engine import _mooncake
from shmslots.remote.grant import COMMIT
from workers.netns import Namespace, NamespaceUnavailable, veth_namespace
from workers.remote_flow import (
    RemoteFlowConfig,
    RemoteFlowResult,
    native_stderr_to,
    run_remote_flow,
)

try:
    _mooncake()
    SKIP = ""
except RemoteUnavailable as exc:
    SKIP = str(exc)

needs_engine = pytest.mark.skipif(bool(SKIP), reason=SKIP)


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    """An owner's and a writer's engine (one pair per module: engines have no close)."""
    return Engine(), Engine()


@contextmanager
def served(
    name: str,
    engines: tuple[Engine, Engine],
    *,
    slots: int,
    commit_timeout_s: float = 10.0,
    batch: int = 64,
) -> Iterator[tuple[SlotTable, RemoteServer, RemoteWriter]]:
    """A table, its RemoteServer on the owner engine, and a RemoteWriter on the other."""
    owner, remote = engines
    with (
        SlotTable.create(name, SMALL, slots=slots) as table,
        RemoteServer(table, owner, commit_timeout_s=commit_timeout_s) as server,
        RemoteWriter(remote, table.schema, batch=batch) as writer,
    ):
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
        Grant("h:1", 1, 2, 3, 4, 5, 6, 7).encode()[:-1],
        msgpack.packb(["h:1", 1, 2, 3, 2**32, 5, 6, 7]),  # generation out of range
        msgpack.packb(["h:1", -1, 2, 3, 4, 5, 6, 7]),
        msgpack.packb(["h:1", 1, 2, 3, 4, 5, 6, True]),
    ],
)
def test_a_malformed_grant_is_refused(blob: bytes) -> None:
    with pytest.raises(GrantError):
        Grant.decode(blob)


def test_a_grant_survives_its_encoding() -> None:
    grant = Grant("10.0.0.1:15000", 0x7F00_0000_1000, 8256, 3, 2**32 - 1, 2**64 - 1, 12345, 2**63)
    assert Grant.decode(grant.encode()) == grant


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


@needs_engine
def test_handle_fields_cannot_be_written_remotely(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    fields = [Field("x", "float32", (None,), kind="handle")]
    with SlotTable.create(name, fields, slots=2, arena_bytes=1 << 16) as table:
        with pytest.raises(SchemaError, match="handles"):
            RemoteServer(table, engines[0])
        with pytest.raises(SchemaError, match="handles"):
            RemoteWriter(engines[1], table.schema)


@needs_engine
def test_a_remote_row_arrives_exactly_as_packed(name: str, engines: tuple[Engine, Engine]) -> None:
    with served(name, engines, slots=4) as (table, server, writer):
        grants = [server.grant(tag) for tag in (11, 12, 13)]
        writer.write([(g, small_row(g.tag)) for g in grants])
        settled = _poll_until(server, lambda s, got: len(got.published) == 3)
        assert settled.published == [11, 12, 13]
        for tag in (11, 12, 13):
            lease = table.take()
            assert lease is not None
            with lease:
                assert lease.tag == tag and lease.verify()
                assert int(lease.view("id")) == tag
                assert torch.equal(lease.view("h"), small_row(tag)["h"])


@needs_engine
def test_a_writer_checks_every_row_before_sending(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    with served(name, engines, slots=4, commit_timeout_s=0.2) as (table, server, writer):
        good, other = server.grant(1), server.grant(2)
        foreign = Grant(**{**good.__dict__, "fingerprint": good.fingerprint ^ 1})
        bad_dtype = {**small_row(2), "p": torch.zeros(4, dtype=torch.float64)}
        missing = {k: v for k, v in small_row(2).items() if k != "h"}
        for rows, error in [
            ([(good, small_row(1)), (foreign, small_row(1))], GrantError),
            ([(good, small_row(1)), (other, bad_dtype)], SchemaError),
            ([(good, small_row(1)), (other, missing)], SchemaError),
        ]:
            with pytest.raises(error):
                writer.write(rows)
        # nothing was sent, not even the good row: both grants expire unpublished
        settled = _poll_until(server, lambda s, got: s.pending == 0)
        assert settled.published == [] and sorted(settled.expired) == [1, 2]
        assert table.take() is None and table.stats().owned == 0


@needs_engine
def test_late_writes_are_discarded_and_never_delivered(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    """One slot, so every grant reuses it: a late write can only hit a live reservation's
    row by way of the landing cells, and the generation check refuses it there."""
    with served(name, engines, slots=1, commit_timeout_s=0.2) as (table, server, writer):
        expired = server.grant(1)  # generation 0
        assert _poll_until(server, lambda s, got: s.pending == 0).expired == [1]
        aborted = server.grant(2)  # generation 1
        assert server.abort(aborted) and not server.abort(aborted)
        victim = server.grant(3)  # generation 2: the same landing cell as generation 0
        assert (expired.slot, aborted.slot, victim.slot) == (0, 0, 0)
        writer.write([(victim, small_row(3))])
        writer.write([(expired, small_row(1)), (aborted, small_row(2))])  # late, after it
        settled = _poll_until(server, lambda s, got: s.stats.late == 2 and not s.pending)
        # the late bytes clobbered the victim's cell: refused and reported, never delivered
        assert settled.published == [] and settled.rejected == [3]
        assert table.take() is None and table.stats().owned == 0
        # the slot serves the next grant normally
        fresh = server.grant(4)
        writer.write([(fresh, small_row(4))])
        assert _poll_until(server, lambda s, got: got.published).published == [4]
        lease = table.take()
        assert lease is not None
        with lease:
            assert int(lease.view("id")) == 4 and lease.verify()
        foreign = (COMMIT, "garbage;4:x;²:0:0000000000000000;" + "9" * 5000)
        writer.engine.write(fresh.session, [0], [0], [0], foreign)
        _poll_until(server, lambda s, got: s.stats.malformed == 4)
        assert server.stats.committed == 1 and server.stats.rejected == 1


@needs_engine
def test_a_stray_commit_cannot_use_up_a_grant(name: str, engines: tuple[Engine, Engine]) -> None:
    with served(name, engines, slots=2) as (table, server, writer):
        grant = server.grant(5)
        guessed = f"{grant.slot}:{grant.generation}:{grant.nonce ^ 1:016x}"  # right slot and gen
        writer.engine.write(grant.session, [0], [0], [0], (COMMIT, guessed))
        _poll_until(server, lambda s, got: s.stats.late == 1)
        assert server.pending == 1  # still the real writer's
        writer.write([(grant, small_row(5))])
        assert _poll_until(server, lambda s, got: got.published).published == [5]
        lease = table.take()
        assert lease is not None and lease.verify()
        lease.release()


@needs_engine
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
        assert table.take() is None and table.stats().owned == 0


@needs_engine
def test_a_server_owns_its_engine_and_refuses_work_once_closed(
    name: str, engines: tuple[Engine, Engine]
) -> None:
    owner, _ = engines
    with SlotTable.create(name, SMALL, slots=2) as table:
        server = RemoteServer(table, owner)
        with pytest.raises(ValueError, match="one RemoteServer per Engine"):
            RemoteServer(table, owner)
        server.grant(1)
        server.close()
        assert table.stats().owned == 0  # the pending grant was aborted
        for call in (lambda: server.grant(2), server.poll):
            with pytest.raises(ValueError, match="closed"):
                call()
        RemoteServer(table, owner).close()  # the engine is free again


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
    # a write for an aborted grant came anyway: discarded, counted
    assert remote.late == len(aborted - uncommitted) > 0
    # rows the writer never committed expired and were reclaimed
    assert set(settled.expired) == uncommitted - aborted and settled.expired
    assert result.final.owned == 0 and result.final.queued == 0
    assert result.consistency == []


@needs_engine
@pytest.mark.timeout(180)
def test_remote_flow_on_loopback(name: str) -> None:
    config = RemoteFlowConfig(requests=REQUESTS, never_commit_every=97, commit_timeout_s=1.0)
    _check_flow(run_remote_flow(config, name), REQUESTS)


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    try:
        with veth_namespace("shmslots-t") as ns:
            yield ns
    except NamespaceUnavailable as exc:
        pytest.skip(str(exc))


@needs_engine
@pytest.mark.timeout(180)
def test_remote_flow_across_network_namespaces(name: str, namespace: Namespace) -> None:
    config = RemoteFlowConfig(
        requests=REQUESTS,
        never_commit_every=97,
        commit_timeout_s=1.0,
        owner_host=namespace.outside_ip,
        writer_host=namespace.inside_ip,
        writer_prefix=namespace.prefix,
    )
    _check_flow(run_remote_flow(config, name), REQUESTS)


@needs_engine
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
