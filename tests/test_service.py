"""Start, stop and restart like a service: create over an orphan, attach while it is being
created, close after an outside unlink, a creator that leaves rows says so (#28)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import posix_ipc
import pytest
from conftest import SMALL, small_row

from shmslots import (
    Field,
    IncompatibleTable,
    InvalidArgument,
    RowsLeftWarning,
    SchemaError,
    SlotTable,
    TableExists,
    TableNotFound,
    TableNotReady,
)
from shmslots.participants import hold_gate
from shmslots.segment import unlink

CREATOR = """
import signal, sys, time
from conftest import SMALL, small_row
from shmslots import SlotTable
from shmslots import TableExists
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a service killed by its manager
deadline = time.monotonic() + 30
while True:  # a consumer still attached to the dead creator's table keeps it: retry
    try:
        t = SlotTable.create(sys.argv[1], SMALL, slots=4, replace_orphaned=True)
        break
    except TableExists:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.01)
ws = t.claim()
ws.write(**small_row(int(sys.argv[2])))
ws.publish()
print("up", flush=True)
time.sleep(60)
"""


def _creator(name: str, generation: int) -> subprocess.Popen[str]:
    # conftest through PYTHONPATH, not the cwd: a relative sys.executable (PATH=.venv/bin)
    # must still be found
    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", CREATOR, name, str(generation)],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


@pytest.mark.timeout(90)
def test_a_creator_killed_and_restarted_under_the_same_name_while_a_consumer_attaches(
    name: str,
) -> None:
    seen: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def consumer() -> None:
        while not stop.is_set():
            try:
                with SlotTable.attach(name, "decode", timeout=5, expect=SMALL) as t:
                    lease = t.take(timeout=0.05)
                    if lease is not None:
                        seen.append(int(lease.item("id")))
                        lease.abort()
            except TableNotFound:
                pass  # between a death and the restart: the one documented outcome
            except BaseException as exc:
                errors.append(exc)
                return
            time.sleep(0.02)  # a service polling for its table

    reader = threading.Thread(target=consumer)
    proc = _creator(name, 1)
    reader.start()
    try:
        for generation, sig in ((2, signal.SIGKILL), (3, signal.SIGTERM), (4, signal.SIGKILL)):
            time.sleep(0.3)
            proc.send_signal(sig)
            proc.wait(10)
            # without replace: says who uses it (the reader, when it is attaching just then)
            with pytest.raises(
                TableExists,
                match=r"already exists: (it is orphaned|1 live|a process is creating it or att)",
            ):
                SlotTable.create(name, SMALL, slots=4)
            proc = _creator(name, generation)  # replace_orphaned=True
        time.sleep(0.3)
    finally:
        stop.set()
        reader.join(30)
        proc.kill()
        proc.wait(10)
        unlink(name)
    assert errors == []
    assert {1, 2, 3, 4} & set(seen)  # rows of the restarted creators reached the consumer


def test_an_orphan_is_named_as_such_and_replaced(name: str) -> None:
    proc = _creator(name, 1)
    proc.kill()
    proc.wait(10)
    with pytest.raises(TableExists, match=rf"orphaned.*`shmslots unlink {name}`.*replace_orphaned"):
        SlotTable.create(name, SMALL, slots=2)
    with SlotTable.create(name, SMALL, slots=2, replace_orphaned=True) as t:
        assert t.take() is None  # a new table: the dead creator's row went with its table


def test_replace_orphaned_refuses_a_table_with_a_live_participant(name: str) -> None:
    live = rf"live participant.*pid {os.getpid()}"
    with SlotTable.create(name, SMALL, slots=2), pytest.raises(TableExists, match=live):
        SlotTable.create(name, SMALL, slots=2, replace_orphaned=True)


@pytest.mark.timeout(30)
def test_attach_waits_through_missing_and_being_created(name: str) -> None:
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600)  # not sized yet
    os.close(shm.fd)
    started = time.monotonic()
    with pytest.raises(TableNotReady) as info:  # a creator that never finishes
        SlotTable.attach(name)
    assert isinstance(info.value, IncompatibleTable) and time.monotonic() - started >= 1.9
    unlink(name)

    made: list[SlotTable] = []

    def create_later() -> None:
        time.sleep(0.3)
        made.append(SlotTable.create(name, SMALL, slots=2))

    maker = threading.Thread(target=create_later)
    maker.start()
    with SlotTable.attach(name, "decode", timeout=10, expect=SMALL) as t:
        assert t.schema.fields == tuple(SMALL)
    maker.join(10)
    with made[0]:
        pass
    with pytest.raises(TableNotFound):
        SlotTable.attach(name, timeout=0.2)


def test_attach_states_the_fields_it_expects(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2):
        with pytest.raises(InvalidArgument, match="expect="):
            SlotTable.attach(name, list(SMALL))  # type: ignore[arg-type]
        with pytest.raises(SchemaError, match="not the expected"):
            SlotTable.attach(name, expect=[Field("id", "int64")])
        other = [Field("id", "int32"), *SMALL[1:]]
        with pytest.raises(SchemaError, match="dtype or shape"):
            SlotTable.attach(name, expect=other)
        for bad in (-1, float("inf"), True, "1"):
            with pytest.raises(InvalidArgument, match="timeout"):
                SlotTable.attach(name, timeout=bad)  # type: ignore[arg-type]


def test_a_table_unlinked_from_outside_closes_cleanly(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as t:
        unlink(name)  # `shmslots unlink --force` while the creator runs
        t.claim().write(**small_row(1)).abort()  # the mapping still works
    assert t.closed


def test_a_creator_that_leaves_rows_queued_says_so(name: str) -> None:
    left = r"1 row\(s\) queued and 0 held"
    with pytest.warns(RowsLeftWarning, match=left), SlotTable.create(name, SMALL, slots=2) as t:
        t.claim().write(**small_row(1)).publish()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RowsLeftWarning)
        with SlotTable.create(name, SMALL, slots=2) as t:  # nothing left: nothing said
            t.claim().write(**small_row(2)).publish()
            lease = t.take()
            assert lease is not None
            lease.release()


def test_peers_and_unlinked_tell_a_consumer_its_producer_has_gone(name: str) -> None:
    proc = _creator(name, 1)
    with SlotTable.attach(name, "decode") as t:
        assert [p.pid for p in t.peers()] == [proc.pid] and not t.unlinked
        proc.kill()
        proc.wait(10)
        assert t.peers() == []  # its lock went with it
        unlink(name)
        assert t.unlinked


def test_a_table_being_attached_is_not_replaced_as_an_orphan(name: str) -> None:
    """A process between opening a table and registering was invisible, and a restart's
    replace_orphaned unlinked the table under it (review of #28)."""
    proc = _creator(name, 1)
    proc.kill()
    proc.wait(10)
    shm = posix_ipc.SharedMemory("/" + name)  # an attacher, not registered yet
    try:
        hold_gate(shm.fd, name, time.monotonic() + 1)
        with pytest.raises(TableExists, match="creating it or attaching to it"):
            SlotTable.create(name, SMALL, slots=2, replace_orphaned=True)
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        os.close(shm.fd)  # its gate goes with it
    with SlotTable.create(name, SMALL, slots=2, replace_orphaned=True):
        pass


def test_creator_attached_tells_each_of_two_consumers_the_producer_died(name: str) -> None:
    proc = _creator(name, 1)
    with SlotTable.attach(name, "a") as a, SlotTable.attach(name, "b") as b:
        assert a.creator_attached() and b.creator_attached()
        proc.kill()
        proc.wait(10)
        assert not a.creator_attached() and not b.creator_attached()
        assert [p.role for p in a.peers()] == ["b"]  # the other consumer is still there
        assert a.identity == b.identity
    unlink(name)


def test_rows_left_warning_as_an_error_leaks_nothing_and_hides_no_exception(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RowsLeftWarning)
        with pytest.raises(RowsLeftWarning), SlotTable.create(name, SMALL, slots=2) as t:
            t.claim().write(**small_row(1)).publish()
        assert t.closed and not os.path.exists(f"/dev/shm/{name}")
        with pytest.raises(KeyError), SlotTable.create(name, SMALL, slots=2) as t:
            t.claim().write(**small_row(2)).publish()
            raise KeyError("the block's own error")
        assert not os.path.exists(f"/dev/shm/{name}")


def test_attach_refuses_an_expect_that_is_not_fields(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2):
        for bad in (["id"], SMALL[0], 5):
            with pytest.raises(InvalidArgument, match="sequence of Fields"):
                SlotTable.attach(name, expect=bad)  # type: ignore[arg-type]
        fields = (f for f in SMALL)
        with SlotTable.attach(name, expect=fields) as t:  # type: ignore[arg-type]
            assert t.schema.fields == tuple(SMALL)


@pytest.mark.timeout(30)
def test_a_table_sized_but_never_finished_is_not_ready_not_corrupt(name: str) -> None:
    """A creator that died after sizing its table, before its header: TableNotReady."""
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=1 << 16)
    os.close(shm.fd)
    try:
        with pytest.raises(TableNotReady, match="not finished making it"):
            SlotTable.attach(name)
    finally:
        unlink(name)
