"""Trust boundaries (#36): a table is trusted for who owns its file, a creator is known by its
registry entry's identity (never its pid number), and a held gate never outlasts a bound."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import time
from multiprocessing.connection import Connection

import pytest
from conftest import SPAWN, Children
from test_errors import _header_field_offset

from shmslots import Field, SlotTable, TableNotReady, TablePermissionError
from shmslots.participants import GATE, _lock_request

FIELDS = [Field("x", "int64")]
OTHER_UID = 65534  # nobody


def _forge_header(name: str, field: str, value: int) -> None:
    """Write `value` into the header field, as anyone who can write the file could."""
    with open(f"/dev/shm/{name}", "r+b") as f:
        f.seek(_header_field_offset(field))
        f.write(struct.pack("<I", value))


def _make_as_other_user(name: str) -> None:
    """A forked child that drops to another uid, makes a table and opens it to everyone."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            table = SlotTable.create(name, FIELDS, slots=2)
            os.chmod(f"/dev/shm/{name}", 0o666)
            table.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to make a table as another uid")
def test_a_table_another_user_made_is_refused_whatever_uid_its_header_claims(name: str) -> None:
    _make_as_other_user(name)
    try:
        _forge_header(name, "creator_uid", os.geteuid())  # it claims to be ours
        with pytest.raises(TablePermissionError, match=f"owned by uid {OTHER_UID}"):
            SlotTable.attach(name, "decode")
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_a_wider_mode_than_expected_is_refused_unless_named(name: str) -> None:
    with SlotTable.create(name, FIELDS, slots=2):
        os.chmod(f"/dev/shm/{name}", 0o640)
        with pytest.raises(TablePermissionError, match="mode 640, wider than 600"):
            SlotTable.attach(name, "decode")
        with SlotTable.attach(name, "decode", mode=0o640) as table:
            assert table.creator_attached()


def _create_and_leave(name: str) -> None:
    """A creator that goes away without unlinking (as one killed would)."""
    SlotTable.create(name, FIELDS, slots=2).close()


def _attach_and_wait(name: str, conn: Connection) -> None:
    with SlotTable.attach(name, "peer"):
        conn.send(os.getpid())
        conn.recv()


def test_a_dead_creator_is_not_taken_for_a_live_process_with_its_pid_number(
    name: str, children: Children
) -> None:
    """Two containers sharing /dev/shm both run their process as pid 1: here a live peer's
    pid stands where the dead creator's was."""
    creator = children.start(_create_and_leave, name)
    creator.join(60)
    parent, child = SPAWN.Pipe()
    children.start(_attach_and_wait, name, child)
    assert parent.poll(60)
    peer_pid = parent.recv()
    _forge_header(name, "creator_pid", peer_pid)
    try:
        with SlotTable.attach(name, "decode") as table:
            assert not table.creator_attached()
    finally:
        parent.send("done")
        children.join_all(30)
        os.unlink(f"/dev/shm/{name}")


def test_a_live_creator_is_known_from_another_process(name: str, children: Children) -> None:
    with SlotTable.create(name, FIELDS, slots=2) as table:
        assert table.creator_attached()
        parent, child = SPAWN.Pipe()
        children.start(_check_creator, name, child)
        assert parent.poll(60)
        assert parent.recv() is True


def _check_creator(name: str, conn: Connection) -> None:
    with SlotTable.attach(name, "decode") as table:
        conn.send(table.creator_attached())


def _hold_gate_stopped(name: str, conn: Connection) -> None:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_WRLCK, GATE))
    conn.send("held")
    os.kill(os.getpid(), signal.SIGSTOP)  # a debugger, a frozen cgroup


@pytest.mark.timeout(30)
def test_attach_keeps_its_bound_behind_a_gate_held_by_a_stopped_process(
    name: str, children: Children
) -> None:
    with SlotTable.create(name, FIELDS, slots=2):
        parent, child = SPAWN.Pipe()
        holder = children.start(_hold_gate_stopped, name, child)
        assert parent.poll(60) and parent.recv() == "held"
        start = time.monotonic()
        with pytest.raises(TableNotReady, match="holds its gate"):
            SlotTable.attach(name, "decode", timeout=0.5)
        assert time.monotonic() - start < 5  # INIT_WAIT_S (2 s), not for ever
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        with SlotTable.attach(name, "decode"):  # the gate went with the holder
            pass


def test_sglang_buffers_close_quietly_when_their_table_was_removed_first(name: str) -> None:
    """A scheduler's exit after its table's name went (a start-up cleanup of another
    scheduler of the same server and rank, an operator's `unlink --force`)."""
    import torch

    from shmslots.sglang import MetadataBuffers, ReqToMetadataIdxAllocator

    ReqToMetadataIdxAllocator(4)
    buffers = MetadataBuffers(4, 64, torch.bfloat16, 16, table_name=name)
    os.unlink(f"/dev/shm/{name}")
    buffers.close()  # no TableNotFound


def test_sglang_buffers_unlink_their_table_before_leaving_it(name: str) -> None:
    """So no instant exists in which the table has no live participant and still its name."""
    import torch

    from shmslots.sglang import MetadataBuffers, ReqToMetadataIdxAllocator

    ReqToMetadataIdxAllocator(4)
    buffers = MetadataBuffers(4, 64, torch.bfloat16, 16, table_name=name)
    seen: list[bool] = []
    leave = buffers.table._member.leave

    def leave_checking() -> bool:
        seen.append(os.path.exists(f"/dev/shm/{name}"))
        return leave()

    buffers.table._member.leave = leave_checking  # type: ignore[method-assign]
    buffers.close()
    assert seen == [False]
