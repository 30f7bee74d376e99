"""The same-host engine's trust boundary, with real processes and real registries: a write
lands only inside memory the peer registered, from memory registered here, into a peer this
user owns; anything else is refused before a byte moves."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

import shmslots.sglang.samehost.engine as engine_code
from shmslots.errors import ShmSlotsError
from shmslots.segment import SHM_DIR
from shmslots.sglang import backend, samehost
from shmslots.sglang.samehost import (
    EngineClosed,
    PeerGone,
    Region,
    SameHostEngine,
    TransferError,
)
from shmslots.sglang.samehost.memfd import share
from shmslots.sglang.samehost.peer import Peer
from shmslots.sglang.samehost.regions import mappings

NAME = "shmslots-pd-test"


def _victim(conn: Connection) -> None:
    """A peer that registers `shown` and not `hidden`, then reports both when asked.
    `shown` starts inside a page, so it holds no whole page and stays on the heap (written by
    process_vm_writev); a page-aligned one, as the allocator gives at times, would move onto
    a memfd."""
    shown = torch.zeros(4096 + 64, dtype=torch.uint8)[8 : 8 + 4096]
    hidden = torch.zeros(4096, dtype=torch.uint8)
    with SameHostEngine(f"{NAME}-victim-{os.getpid()}") as engine:
        engine.batch_register([shown.data_ptr()], [shown.numel()])
        conn.send((engine.get_session_id(), shown.data_ptr(), hidden.data_ptr()))
        if conn.recv() == "report":  # else "bye": a test that asked for no report
            conn.send((shown.tolist(), hidden.tolist()))
            conn.recv()


@contextlib.contextmanager
def peer_process(
    target: Callable[..., None], *args: object
) -> Iterator[tuple[Connection, Any, mp.process.BaseProcess]]:
    """A spawned peer that sends what it registered first; reaped, and its registry swept,
    whatever happens."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    child.close()  # so that a peer's death is an EOF here, not a wait
    try:
        assert parent.poll(60)
        yield parent, parent.recv(), proc
    finally:
        with contextlib.suppress(OSError):
            parent.send("bye")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        samehost.sweep()


@pytest.fixture
def victim() -> Iterator[tuple[Connection, tuple[str, int, int], mp.process.BaseProcess]]:
    with peer_process(_victim) as got:
        yield got


@pytest.fixture
def writer() -> Iterator[tuple[SameHostEngine, torch.Tensor]]:
    src = torch.arange(256, dtype=torch.uint8).repeat(16)
    with SameHostEngine(f"{NAME}-writer-{os.getpid()}") as engine:
        engine.batch_register([src.data_ptr()], [src.numel()])
        yield engine, src


def test_writes_land_only_inside_what_the_peer_registered(victim, writer) -> None:  # type: ignore[no-untyped-def]
    conn, (session, shown, hidden), _ = victim
    engine, src = writer
    assert engine.batch_transfer_sync(session, [src.data_ptr()], [shown + 8], [16]) == 0
    # another buffer of the peer's, an overrun of its region, a source not registered here,
    # and a good block beside a bad one, and lengths that are not integers (16.9 bytes, a
    # string): each refused whole, nothing written
    bad: list[tuple[list[Any], list[Any], list[Any]]] = [
        ([src.data_ptr()], [hidden], [16]),
        ([src.data_ptr()], [shown + 4090], [16]),
        ([src.data_ptr() + 4090], [shown], [16]),
        ([src.data_ptr(), src.data_ptr()], [shown + 100, hidden], [4, 4]),
        ([src.data_ptr()], [shown + 100], [16.9]),
        ([src.data_ptr()], [shown + 100], ["16"]),
    ]
    for sources, targets, lengths in bad:
        assert engine.batch_transfer_sync(session, sources, targets, lengths) == -1
        with pytest.raises(TransferError, match="not"):
            engine.transfer(session, sources, targets, lengths)
    assert engine.refused == len(bad)
    conn.send("report")
    got_shown, got_hidden = conn.recv()
    assert got_shown[8:24] == list(range(16)) and not any(got_shown[100:104])
    assert not any(got_hidden) and not any(got_shown[:8]) and not any(got_shown[24:])


def test_an_engine_that_only_sends_lets_no_peer_write_into_it(victim, writer) -> None:  # type: ignore[no-untyped-def]
    """SGLang's prefill only sends: its engine publishes none of what it registers (a peer's
    write into it is refused) and moves none of it onto a memfd, yet sends from all of it."""
    conn, (session, shown, _), _ = victim
    other, other_src = writer
    src = torch.arange(64 << 10, dtype=torch.int64).to(torch.uint8)  # 64 KiB: whole pages
    with SameHostEngine(f"{NAME}-sender-{os.getpid()}", receives=False) as sender:
        sender.batch_register([src.data_ptr()], [src.numel()])
        assert [(r.base, r.memfd) for r in sender._own.regions] == [(src.data_ptr(), -1)]
        end = src.data_ptr() + src.numel()
        assert not [
            m
            for m in mappings()
            if m[5].startswith("/memfd:") and m[0] < end and m[1] > src.data_ptr()
        ]
        sender.transfer(session, [src.data_ptr() + 4000], [shown + 8], [16])
        with pytest.raises(TransferError, match="not inside memory the peer"):
            other.transfer(sender.get_session_id(), [other_src.data_ptr()], [src.data_ptr()], [16])
    assert src.tolist() == [i % 256 for i in range(64 << 10)]  # nothing written into it
    conn.send("report")
    got_shown, _ = conn.recv()
    assert got_shown[8:24] == [(4000 + i) % 256 for i in range(16)]


def test_a_dead_or_restarted_peer_is_gone_by_its_lock_and_inode(victim, writer) -> None:  # type: ignore[no-untyped-def]
    _, (session, shown, _), proc = victim
    engine, src = writer
    assert engine.send_probe(session) == 0
    proc.kill()
    proc.join(10)
    with pytest.raises(PeerGone):
        engine.transfer(session, [src.data_ptr()], [shown], [8])
    assert engine.send_probe(session) == -1
    # a new engine under the dead one's name is another session: the old id stays gone
    name = samehost.parse_session(session)[0]
    with SameHostEngine(name) as again:
        assert again.get_session_id() != session
        with pytest.raises(PeerGone, match="replaced"):  # by its inode, not its name
            engine.transfer(session, [src.data_ptr()], [shown], [8])


_KEPT: list[SameHostEngine] = []  # referenced until exit, as SGLang's scheduler keeps its own


def _engine_never_closed(conn: Connection) -> None:
    """An engine this process never closes; a child forked from it exits normally first."""
    engine = SameHostEngine(f"{NAME}-exit-{os.getpid()}")
    _KEPT.append(engine)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # runs the exit handlers it inherited: the registry is not the child's
    os.waitpid(pid, 0)
    conn.send((engine.registry.name, os.path.exists(os.path.join(SHM_DIR, engine.registry.name))))
    conn.recv()


def test_a_registry_goes_with_its_owners_exit_not_a_forked_childs() -> None:
    """SGLang's scheduler exits in userspace on a graceful shutdown without closing its
    manager, which it still holds: its registry goes then, not only if its server's own exit
    lives to sweep it."""
    with peer_process(_engine_never_closed) as (conn, (name, kept), proc):
        assert kept
        conn.send("exit")
        proc.join(30)
        assert proc.exitcode == 0
        assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_sweep_waits_while_another_process_removes_or_makes_a_registry() -> None:
    """A sweep that found a dead engine's registry must not unlink, by name, the live one a
    restarted engine made there after its look: a sweep and the making of a registry hold
    one host-wide lock.  Here this process holds it; another's sweep waits for it."""
    from shmslots.sglang.samehost import registry

    code = "import sys; from shmslots.sglang import samehost; print('go', flush=True); "
    code += "samehost.sweep(); print('swept', flush=True)"
    with registry._removals():
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline() == "go\n"
            time.sleep(0.5)
            assert child.poll() is None  # waiting on the lock this process holds
        except BaseException:
            child.kill()
            child.wait(30)
            raise
    out, _ = child.communicate(timeout=60)
    assert out == "swept\n" and child.returncode == 0


@pytest.mark.parametrize("dropped", [False, True], ids=["in-use", "dropped-by-a-failure"])
def test_a_transfer_that_outlives_close_keeps_the_engine_alive_to_peers_until_it_ends(
    victim: Any, monkeypatch: pytest.MonkeyPatch, dropped: bool
) -> None:
    """close() waits `wait_s` for running transfers; one still writing then keeps the
    registry locked (peers see the engine alive, so they do not release what it may still
    write) until it ends, and only then is the registry gone.  So too where another
    transfer's failure dropped the peer the held one writes through."""
    conn, (session, shown, _), _ = victim
    held, go = threading.Event(), threading.Event()
    real = Peer.write
    calls = itertools.count()

    def write(peer: Peer, blocks: list[tuple[int, int, int]]) -> None:
        if next(calls):
            raise OSError("a write that failed with its peer alive")
        held.set()
        assert go.wait(10)
        real(peer, blocks)

    monkeypatch.setattr(Peer, "write", write)  # the victim's 4 KiB is heap: by writev
    src = torch.full((64,), 7, dtype=torch.uint8)
    name = f"{NAME}-outlived-{os.getpid()}"
    engine = SameHostEngine(name)
    engine.batch_register([src.data_ptr()], [src.numel()])
    failure: list[BaseException] = []

    def transfer() -> None:
        try:
            engine.transfer(session, [src.data_ptr()], [shown], [64])
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=transfer)
    thread.start()
    try:
        assert held.wait(10)
        if dropped:
            with pytest.raises(TransferError, match="failed with its peer alive"):
                engine.transfer(session, [src.data_ptr()], [shown], [64])
            assert session not in engine._peers
        engine.close(wait_s=0.05)  # returns with the transfer still held
        seen = samehost.PeerRegistry(name, None)
        try:
            assert seen.alive() and seen.named()  # still the engine's, and locked
            go.set()
            thread.join(10)
            assert not thread.is_alive() and not failure
            assert not seen.alive() and not seen.named()  # its end let the registry go
        finally:
            seen.close()
    finally:
        go.set()
        thread.join(10)
    conn.send("report")
    written, _ = conn.recv()
    assert written[:64] == [7] * 64  # the write that outlived close() landed whole


def test_a_registry_that_is_not_this_users_0600_is_refused(writer) -> None:  # type: ignore[no-untyped-def]
    engine, _ = writer
    name = f"{NAME}-wide-{os.getpid()}"
    with SameHostEngine(name) as other:
        path = os.path.join(SHM_DIR, name)
        os.chmod(path, 0o644)
        with pytest.raises(TransferError, match="mode 644"):
            engine.transfer(other.get_session_id(), [], [], [])
        os.chmod(path, 0o600)
        if os.geteuid() == 0:  # root can give the file to another uid, as that user could
            os.chown(path, 65534, 65534)
            with pytest.raises(TransferError, match="owned by uid 65534"):
                engine.transfer(other.get_session_id(), [], [], [])
            os.chown(path, 0, 0)


def test_bad_registrations_and_an_empty_file_region_are_clear_errors(writer) -> None:  # type: ignore[no-untyped-def]
    """Registering unequal lists, or lengths that are not integers, or on a closed engine,
    and a peer's region in a file too short to hold it (an empty /dev/shm file here) are
    this package's errors, nothing registered or written."""
    engine, src = writer
    buf = torch.zeros(4096, dtype=torch.uint8)
    name = f"{NAME}-empty-{os.getpid()}"
    with SameHostEngine(f"{NAME}-short-{os.getpid()}") as peer:
        with pytest.raises(TransferError, match="2 addresses and 1 lengths"):
            peer.batch_register([buf.data_ptr(), buf.data_ptr() + 64], [64])
        for length in (64.9, "64"):  # cut to 64 before, and registered
            with pytest.raises(TransferError, match="must be integers"):
                peer.batch_register([buf.data_ptr()], [length])  # type: ignore[list-item]
        assert peer._own.regions == ()
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            region = Region(1 << 40, 4096, name, os.fstat(fd).st_ino, 0)
            peer.registry.publish([region])
            with pytest.raises(TransferError, match="lies past its end"):
                engine.transfer(peer.get_session_id(), [src.data_ptr()], [1 << 40], [64])
            assert os.fstat(fd).st_size == 0
        finally:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
    with pytest.raises(EngineClosed):
        peer.batch_register([buf.data_ptr()], [64])
    with pytest.raises(EngineClosed):
        peer.batch_deregister([0])


def test_deregistering_what_was_not_registered_is_minus_one_and_withdraws_nothing(writer) -> None:  # type: ignore[no-untyped-def]
    """As Mooncake's engine answers (SGLang only logs it): -1, and a range registered
    beside the unknown address stays writable; a second deregistration is -1 too."""
    engine, src = writer
    pool = torch.zeros(4096, dtype=torch.uint8)
    with SameHostEngine(f"{NAME}-undereg-{os.getpid()}") as peer:
        base = pool.data_ptr()
        peer.batch_register([base], [pool.numel()])
        session = peer.get_session_id()
        for unknown in ([base, base + 64], [base + 64], ["nowhere"]):
            assert peer.batch_deregister(unknown) == -1  # type: ignore[arg-type]
            assert engine.batch_transfer_sync(session, [src.data_ptr()], [base], [64]) == 0
        assert torch.equal(pool[:64], src[:64])
        assert peer.batch_deregister([base, base]) == 0  # named twice: withdrawn once
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [base], [64]) == -1
        assert peer.batch_deregister([base]) == -1
        # an address is read as batch_register reads it: a 0-d tensor was "not registered"
        # (the range left shared), a 0-d array raised TypeError into the caller
        kinds: tuple[Callable[[int], Any], ...] = (torch.tensor, np.array)
        for kind in kinds:
            peer.batch_register([kind(base)], [pool.numel()])
            assert peer.batch_deregister([kind(base)]) == 0
            assert peer.batch_deregister([kind(base)]) == -1
        assert peer.batch_deregister([1.5]) == -1  # type: ignore[list-item]


def test_a_fifo_or_symlink_under_a_registry_name_is_no_registry(writer: Any, tmp_path: Any) -> None:
    """Anyone may put a FIFO or a symlink under a name in /dev/shm.  Opening a FIFO waits
    for a writer, forever: the sweep (under the host-wide lock every engine takes to start)
    and a transfer naming it hung.  A symlink gave a bare OSError.  Each is now no registry:
    skipped by the sweep, a clear refusal to a transfer, -1 to a probe.  A region listed in
    a true registry under such a name is refused too, and nothing is written through it."""
    engine, src = writer
    fifo = f"{NAME}-fifo-{os.getpid()}"
    link = f"{NAME}-link-{os.getpid()}"
    outside = tmp_path / "outside"
    outside.write_bytes(bytes(4096))
    os.mkfifo(os.path.join(SHM_DIR, fifo), 0o600)
    os.symlink(outside, os.path.join(SHM_DIR, link))
    try:
        samehost.sweep()
        with SameHostEngine(f"{NAME}-after-{os.getpid()}") as other:
            assert other.get_session_id()
        for name in (fifo, link):
            session = f"{name}#{os.stat(os.path.join(SHM_DIR, name)).st_ino}:1"
            with pytest.raises(TransferError, match=r"not a regular file|not a shmslots table"):
                engine.transfer(session, [src.data_ptr()], [1 << 40], [64])
            assert engine.send_probe(session) == -1
        for name in (fifo, link):
            with SameHostEngine(f"{NAME}-lister-{os.getpid()}") as lister:
                inode = os.stat(os.path.join(SHM_DIR, name)).st_ino
                lister.registry.publish([Region(1 << 40, 4096, name, inode)])
                with pytest.raises(TransferError, match=r"not a shmslots table|not a shared-mem"):
                    engine.transfer(lister.get_session_id(), [src.data_ptr()], [1 << 40], [64])
        assert outside.read_bytes() == bytes(4096)
    finally:
        os.unlink(os.path.join(SHM_DIR, fifo))
        os.unlink(os.path.join(SHM_DIR, link))


def test_a_shared_mapping_of_a_file_in_a_dev_shm_subdirectory_goes_as_anonymous_memory(
    writer: Any,
) -> None:
    """A /dev/shm file region is named by its file's name, which peers check as a table
    name; one in a subdirectory has no such name, so its range is written as anonymous
    memory is (process_vm_writev), and its registry stays readable to peers."""
    import mmap

    engine, src = writer
    folder = os.path.join(SHM_DIR, f"{NAME}-dir-{os.getpid()}")
    os.mkdir(folder, 0o700)
    try:
        with open(os.path.join(folder, "f"), "w+b") as f:
            f.truncate(8192)
            mm = mmap.mmap(f.fileno(), 8192)
        target = torch.frombuffer(mm, dtype=torch.uint8)
        with SameHostEngine(f"{NAME}-subdir-{os.getpid()}") as decode:
            decode.batch_register([target.data_ptr()], [8192])
            assert [r.shm for r in decode._own.regions] == [None]
            session = decode.get_session_id()
            assert (
                engine.batch_transfer_sync(session, [src.data_ptr()], [target.data_ptr()], [64])
                == 0
            )
        assert torch.equal(target[:64], src[:64])
        del target
        mm.close()
    finally:
        os.unlink(os.path.join(folder, "f"))
        os.rmdir(folder)


def test_registries_of_either_lock_byte_are_live_to_a_sweep_of_either_format() -> None:
    """Format 5 moved the owner's lock off byte 0, where format 4's engines look.  A live
    engine holds both bytes, so a format 4 sweep on the host sees it live; and a sweep here
    removes only a registry no process holds any lock on (a live format 4 one holds byte 0),
    so engines of both formats on one host never remove each other's registries."""
    import fcntl
    import struct

    from shmslots.participants import _lock_request
    from shmslots.sglang.samehost import registry

    def held(fd: int, byte: int) -> bool:
        reply = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _lock_request(fcntl.F_WRLCK, byte))
        return bool(struct.unpack("hh", reply[:4])[0] != fcntl.F_UNLCK)

    with SameHostEngine(f"{NAME}-both-{os.getpid()}") as engine:
        fd = os.open(os.path.join(SHM_DIR, engine.registry.name), os.O_RDONLY)
        try:
            assert held(fd, 0) and held(fd, registry.LIVENESS_BYTE)
        finally:
            os.close(fd)
    old = os.path.join(SHM_DIR, f"{NAME}-format4-{os.getpid()}")
    fd = os.open(old, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, registry.REGISTRY_BYTES)
        os.pwrite(fd, registry.MAGIC, 0)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_WRLCK, 0))  # format 4's owner
        samehost.sweep()
        assert os.path.exists(old)
    finally:
        os.close(fd)  # its owner gone: the next sweep removes it
    samehost.sweep()
    assert not os.path.exists(old)


def test_a_shared_mapping_of_another_users_dev_shm_file_goes_as_anonymous_memory() -> None:
    """Peers open a /dev/shm file region by its name and refuse another user's file; one is
    published as anonymous memory (process_vm_writev) instead, not as a region every peer
    would refuse."""
    import mmap

    from shmslots.sglang.samehost.regions import classify_host

    if os.geteuid() != 0:
        pytest.skip("needs root, to give a file to another user")
    path = os.path.join(SHM_DIR, f"{NAME}-foreign-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    try:
        os.ftruncate(fd, 8192)
        mm = mmap.mmap(fd, 8192)
        view = torch.frombuffer(mm, dtype=torch.uint8)
        assert classify_host(view.data_ptr(), 4096)[0].shm is not None  # this user's: by name
        os.fchown(fd, 65534, 65534)
        assert classify_host(view.data_ptr(), 4096)[0].shm is None
        del view
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


def _republisher(conn: Connection) -> None:
    """A peer that rewrites its region list without pause, one region and forty in turn,
    until told to stop; then says how many times it did."""
    lists = [[Region(1 << 30, 4096)], [Region((1 << 30) + i * 8192, 4096) for i in range(40)]]
    with SameHostEngine(f"{NAME}-republish-{os.getpid()}") as engine:
        conn.send(engine.get_session_id())
        n = 0
        while not conn.poll():
            engine.registry.publish(lists[n % 2])
            n += 1
        conn.send(n)


def test_a_registry_read_while_its_owner_rewrites_it_is_read_whole() -> None:
    """A peer rewriting its registry in a loop: every read gives one of the lists it wrote,
    whole, and none fails (a read that meets a rewrite is read again).  Before, the header's
    bulk rewrite zeroed the sequence word: reads saw it even and the magic blank, and failed."""
    from shmslots.sglang.samehost.registry import PeerRegistry, parse_session

    with peer_process(_republisher) as (conn, session, _):
        reg = PeerRegistry(*parse_session(session))
        try:
            sizes: set[int] = set()
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                reg.refresh()
                sizes.add(len(reg.table.regions))
        finally:
            reg.close()
        conn.send("stop")
        assert conn.recv() > 100
    assert {1, 40} <= sizes <= {0, 1, 40}, sizes  # 0: the empty list an engine starts with


def test_a_publish_that_fails_leaves_the_registry_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish interrupted while the sequence number is odd makes it even again: peers
    read the registry after, and the next publish, instead of failing every read."""
    from shmslots.sglang.samehost import registry as registry_code
    from shmslots.sglang.samehost.registry import PeerRegistry, parse_session

    with SameHostEngine(f"{NAME}-parity-{os.getpid()}") as engine:
        reg = PeerRegistry(*parse_session(engine.get_session_id()))
        try:
            failing = engine.registry
            real_fence = registry_code.fence  # type: ignore[attr-defined]
            calls = []

            def fence_then_fail() -> None:  # the first fence: just after the odd store
                real_fence()
                calls.append(1)
                if len(calls) == 1:
                    raise MemoryError

            monkeypatch.setattr(registry_code, "fence", fence_then_fail)
            with pytest.raises(MemoryError):
                failing.publish([Region(1 << 30, 4096)])
            monkeypatch.setattr(registry_code, "fence", real_fence)
            assert failing.seq % 2 == 0
            reg.own = False  # read as another process reads it: from the file
            registry_code._mine.pop(reg.inode)
            reg.refresh()
            failing.publish([Region(1 << 31, 4096)])
            assert reg.refresh() and [r.base for r in reg.table.regions] == [1 << 31]
        finally:
            reg.close()


def test_registering_memory_that_is_not_writable_host_memory_is_refused() -> None:
    with SameHostEngine(f"{NAME}-reg-{os.getpid()}") as engine:
        with pytest.raises(TransferError, match="host memory"):
            engine.batch_register([4096], [4096])  # the zero page's neighbour: unmapped
        with pytest.raises(ShmSlotsError, match="session"):
            engine.transfer("127.0.0.1:1234", [], [], [])


def test_a_process_running_cuda_moves_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """CUDA can pin host pages (`cudaHostRegister`) without a mark in /proc: in a process
    that started it, a range is registered where it is."""
    t = torch.ones(2 << 20, dtype=torch.uint8)
    monkeypatch.setattr("shmslots.sglang.samehost.regions._cuda_runs", lambda: True)
    with SameHostEngine(f"{NAME}-cudaproc-{os.getpid()}") as engine:
        engine.batch_register([t.data_ptr()], [t.numel()])
        assert [r.memfd for r in engine._own.regions] == [-1]


def _shm_victim(conn: Connection, private: bool) -> None:
    """A peer whose registered region lies in a /dev/shm file, mapped shared (as a table's
    columns are) or privately (its own copy of the pages)."""
    import mmap

    name = f"{NAME}-file-{os.getpid()}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 20)
    mm = mmap.mmap(fd, 1 << 20, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED)
    view = torch.frombuffer(mm, dtype=torch.uint8)
    view.fill_(0xEE)  # written: a private mapping now holds its own copies of these pages
    with SameHostEngine(f"{NAME}-shmvictim-{os.getpid()}") as engine:
        engine.batch_register([view.data_ptr()], [view.numel()])
        conn.send((engine.get_session_id(), view.data_ptr()))
        conn.recv()
        conn.send(view[:16].tolist())
        conn.recv()
    os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("private", [False, True])
def test_a_privately_mapped_shm_file_is_written_where_the_peer_reads(
    writer: tuple[SameHostEngine, torch.Tensor], private: bool
) -> None:
    """A private mapping of a /dev/shm file keeps its own pages: writing the file would
    succeed and never reach the peer, so such a range goes as anonymous memory."""
    engine, src = writer
    with peer_process(_shm_victim, private) as (parent, (session, dst), _):
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [dst], [16]) == 0
        parent.send("report")
        assert parent.recv() == list(range(16))


def test_transfers_on_many_threads_survive_the_peer_dying_under_them(
    writer: tuple[SameHostEngine, torch.Tensor],
) -> None:
    """SGLang's manager writes one session from several threads at once (its queues, its
    executor futures per layer): a thread that finds the peer dead must not unmap what
    another is still copying into, and none may raise (#35 review)."""
    engine, src = writer
    results: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def pound(session: str, dst: int) -> None:
        try:
            while not stop.is_set():
                results.append(
                    engine.batch_transfer_sync(session, [src.data_ptr()] * 8, [dst] * 8, [4096] * 8)
                )
        except BaseException as exc:  # any escape is the failure
            errors.append(exc)

    try:
        with peer_process(_shm_victim, False) as (_, (session, dst), proc):
            threads = [threading.Thread(target=pound, args=(session, dst)) for _ in range(6)]
            for t in threads:
                t.start()
            _until(lambda: 0 in results)  # transfers land while it lives
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            _until(lambda: -1 in results)  # and are refused once it is dead
            stop.set()
            for t in threads:
                t.join(10)
        assert not errors and 0 in results and -1 in results
        assert set(results) <= {0, -1} and engine.refused == 0
    finally:
        stop.set()
        for leftover in os.listdir("/dev/shm"):  # the killed peer's file
            if leftover.startswith(f"{NAME}-file-"):
                os.unlink(f"/dev/shm/{leftover}")


def test_a_malformed_session_is_a_failed_transfer_not_an_exception(writer) -> None:  # type: ignore[no-untyped-def]
    engine, src = writer
    unicode_digit, too_long = "shmslots-pd-x#\u00b2:1", "shmslots-pd-x#" + "1" * 5000 + ":1"
    for session in (
        "a/b#1:7",
        "../x#1:2",
        "shmslots-pd-x#notanumber:1",
        "plain",
        unicode_digit,
        too_long,
    ):
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [4096], [8]) == -1
        assert engine.send_probe(session) == -1


def test_a_closed_engine_fails_transfers_quietly(victim, caplog) -> None:  # type: ignore[no-untyped-def]
    """SGLang's transfer threads, daemons, still start transfers after an exiting process
    retired its engines: each fails as a dead peer's would, with no warning logged."""
    _, (session, _, _), _ = victim
    src = torch.zeros(64, dtype=torch.uint8)
    engine = SameHostEngine(f"{NAME}-closed-{os.getpid()}")
    engine.batch_register([src.data_ptr()], [src.numel()])
    engine.close()
    with pytest.raises(EngineClosed):
        engine.transfer(session, [src.data_ptr()], [4096], [8])
    with caplog.at_level(logging.WARNING):
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [4096], [8]) == -1
    assert not caplog.records and engine.failed == 1 and engine.refused == 0


MOVED = (9 << 20) + 5000  # bytes registered: whole pages between two partial ones


def _moved_victim(conn: Connection) -> None:
    """A peer that registers an anonymous buffer whose ends share pages with other memory;
    it reports its bytes, how its pages are mapped, and whether its memfd can shrink."""
    block = torch.arange(10 << 18, dtype=torch.int32).view(torch.uint8)
    skip = (1000 - block.data_ptr()) % 4096  # the view starts 1000 bytes into a page
    view = block[skip : skip + MOVED]
    before = view.numpy().tobytes()
    with SameHostEngine(f"{NAME}-moved-{os.getpid()}") as engine:
        engine.batch_register([view.data_ptr()], [view.numel()])
        (memfd,) = [r.memfd for r in engine._own.regions if r.memfd >= 0]
        try:
            os.ftruncate(memfd, 4096)
            shrank = True
        except PermissionError:
            shrank = False
        moved = [m[:2] for m in mappings() if m[5].startswith("/memfd:shmslots-pd")]
        kept = view.numpy().tobytes() == before
        conn.send((engine.get_session_id(), view.data_ptr(), before, kept, moved, shrank))
        conn.recv()
        conn.send(view.numpy().tobytes())
        conn.recv()


def test_registered_anonymous_memory_moves_onto_a_sealed_memfd_in_place(writer) -> None:  # type: ignore[no-untyped-def]
    """SGLang's CPU pools are anonymous memory: registering one moves its whole pages onto
    a memfd (same addresses, same bytes), sealed so that a peer's mapping cannot fault, and
    blocks that cross between a private end page and the memfd land whole, a call large
    enough to be split over the copy threads too."""
    engine, src = writer
    whole = torch.randint(0, 256, (MOVED,), dtype=torch.uint8)
    engine.batch_register([whole.data_ptr()], [MOVED])
    with peer_process(_moved_victim) as (conn, got, _):
        session, start, before, kept, moved, shrank = got
        page = os.sysconf("SC_PAGESIZE")
        lo, hi = -(-start // page) * page, (start + MOVED) // page * page
        assert kept and not shrank
        assert moved == [(lo, hi)]  # every whole page, and nothing of its neighbours
        assert MOVED > engine_code.PARALLEL_BYTES
        assert engine.batch_transfer_sync(session, [whole.data_ptr()], [start], [MOVED]) == 0
        blocks = [(0, 16), (lo - start - 100, 200), (hi - start - 100, 400), (5 * page, 4096)]
        sources = [src.data_ptr()] * len(blocks)
        targets = [start + at for at, _ in blocks]
        assert engine.batch_transfer_sync(session, sources, targets, [n for _, n in blocks]) == 0
        assert engine.refused == 0
        conn.send("report")
        after = conn.recv()
    assert before != whole.numpy().tobytes()
    expected = bytearray(whole.numpy().tobytes())
    for at, n in blocks:
        expected[at : at + n] = src.numpy().tobytes()[:n]
    assert after == bytes(expected)


def test_a_forked_child_lets_go_of_its_parents_peers(writer) -> None:  # type: ignore[no-untyped-def]
    """A child forked from a prefill gets its parent's engines closed, and its copies of
    their peers' pidfds, registries and mappings closed with them: a child that lived on
    would otherwise keep a dead decode's memory mapped, and its pidfd open."""
    engine, src = writer
    with peer_process(_moved_victim) as (conn, (session, start, *_), _):
        start += 5 * os.sysconf("SC_PAGESIZE")  # on its memfd, mapped here by the first write
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [start], [64]) == 0
        peer = engine._peers[session]
        inodes = {inode for _, inode in peer.maps}
        fds = [peer.pidfd, peer.registry.segment.fd]
        assert inodes and all(fd >= 0 for fd in fds)

        def report() -> object:
            mapped = inodes & {m[4] for m in mappings()}
            held = [fd for fd in os.listdir("/proc/self/fd") if _inode_of(fd) in inodes]
            return sorted(mapped), held, [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]

        # (a descriptor of a decode's file keeps its memory as a mapping does: Python's mmap
        # kept one, and the child kept the mmap)
        assert _in_forked_child(report) == "([], [], [])"
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [start], [64]) == 0
        conn.send("report")  # the parent's engine still writes it
        assert conn.recv()[5 * os.sysconf("SC_PAGESIZE") :][:64] == src.numpy().tobytes()[:64]


def test_a_peers_file_mapped_by_another_thread_at_the_fork_is_not_the_childs(writer) -> None:  # type: ignore[no-untyped-def]
    """A mapping of a peer's file held only by a thread's locals at the fork (mapped, not
    yet kept; or taken out to be closed) is out of the fork hook's reach: a child that
    lived on kept the decode's memory mapped (the review's script: 5 children of 6,602
    forks).  No child inherits one (MADV_DONTFORK)."""
    engine, src = writer
    with peer_process(_moved_victim) as (_, (session, start, *_), _):
        start += 5 * os.sysconf("SC_PAGESIZE")  # on its memfd
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [start], [64]) == 0
        peer = engine._peers[session]
        [region] = [r for r in peer.registry.table.regions if r.memfd >= 0][:1]
        held = peer._map_file(region)  # as another thread holds one mid-way
        assert held is not None
        report = _in_forked_child(lambda: [m[4] for m in mappings() if m[4] == region.inode])
        held.close()
        assert report == "[]"


def test_a_prefill_engine_collected_unclosed_lets_go_of_its_decodes_files() -> None:
    """An engine dropped without close() (its pruner holds it weakly) unmaps its mappings
    of a decode's files when collected, as Python's mmap did: otherwise a dead decode's
    pool stayed mapped in the prefill until it exited."""
    src = torch.arange(256, dtype=torch.uint8).repeat(16)
    with peer_process(_moved_victim) as (_, (session, start, *_), _):
        start += 5 * os.sysconf("SC_PAGESIZE")  # on its memfd
        engine = SameHostEngine(f"{NAME}-unclosed-{os.getpid()}")
        engine.batch_register([src.data_ptr()], [src.numel()])
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [start], [64]) == 0
        inodes = {inode for _, inode in engine._peers[session].maps}
        assert inodes and inodes <= {m[4] for m in mappings()}
        gone = weakref.ref(engine)
        del engine
        gc.collect()
        assert gone() is None
        assert not inodes & {m[4] for m in mappings()}


def _inode_of(fd: str) -> int:
    try:
        return os.stat(f"/proc/self/fd/{fd}").st_ino
    except OSError:  # the listing's own descriptor, closed since
        return -1


def _in_forked_child(report: Callable[[], object]) -> str:
    """repr(report()) as a child forked now sees it (it leaves at once)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, repr(report()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        seen = f.read()
    os.waitpid(pid, 0)
    return seen


def _forging_victim(conn: Connection) -> None:
    """A peer whose registry names memfds a writer must refuse: one that could shrink under
    the writer's mapping (a SIGBUS there), one whose inode is not the file's, one not open."""
    import mmap

    fd = os.memfd_create("shmslots-pd-forged")
    os.ftruncate(fd, 1 << 16)
    mm = mmap.mmap(fd, 1 << 16)
    view = torch.frombuffer(mm, dtype=torch.uint8)
    base, inode = view.data_ptr(), os.fstat(fd).st_ino
    forged = {
        "not sealed": samehost.Region(base, 4096, None, inode, 0, fd),
        "no longer the file": samehost.Region(base, 4096, None, inode + 1, 0, fd),
        "not open": samehost.Region(base, 4096, None, inode, 0, 1000),
    }
    with SameHostEngine(f"{NAME}-forger-{os.getpid()}") as engine:
        for why, region in forged.items():
            engine.registry.publish([region])
            conn.send((engine.get_session_id(), why, base))
            conn.recv()
        conn.send(bool(view.any()))
        conn.recv()


def _named(pid: int) -> tuple[int, int, int, int]:
    """A registry's owner identity naming process `pid`."""
    from shmslots.participants import process_start_ticks
    from shmslots.sglang.samehost.registry import this_pidns

    return (pid, process_start_ticks(pid), this_pidns(), os.geteuid())


def _forger(conn: Connection, pid: int, target: int) -> None:
    """A peer whose registry names process `pid` as its owner, and `target` in it."""
    with SameHostEngine(f"{NAME}-forger-{os.getpid()}") as engine:
        engine.registry._identity = _named(pid)
        engine.registry.publish([Region(target, 4096)])
        conn.send(engine.get_session_id())
        conn.recv()


def test_a_registry_naming_another_process_is_refused_and_nothing_is_written(
    victim: Any, writer: Any
) -> None:
    """A registry's header is its owner's word: one that names another process (a peer's)
    is refused before any write, since that process does not hold the registry's lock; one
    that names the writer's own process, since it is not one of the writer's registries; so
    is one vouched for and then rewritten to name another."""
    conn, (_, _, hidden), proc = victim
    engine, src = writer
    mine = torch.zeros(4096, dtype=torch.uint8)  # the writer's, registered by no engine
    with SameHostEngine(f"{NAME}-liar-{os.getpid()}") as liar:
        liar.registry._identity = _named(proc.pid)
        liar.registry.publish([Region(hidden, 4096)])
        with pytest.raises(TransferError, match=f"names pid {proc.pid}, which does not hold"):
            engine.transfer(liar.get_session_id(), [src.data_ptr()], [hidden], [64])
    with peer_process(_forger, os.getpid(), mine.data_ptr()) as (forger, session, _):
        with pytest.raises(TransferError, match="names this very process"):
            engine.transfer(session, [src.data_ptr()], [mine.data_ptr()], [64])
        forger.send("bye")
    own = torch.zeros(4096, dtype=torch.uint8)
    with SameHostEngine(f"{NAME}-turncoat-{os.getpid()}") as turncoat:
        turncoat.batch_register([own.data_ptr()], [own.numel()])  # truthful: its own memory
        session = turncoat.get_session_id()
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [own.data_ptr()], [64]) == 0
        turncoat.registry._identity = _named(proc.pid)
        turncoat.registry.publish([Region(hidden, 4096)])
        with pytest.raises(TransferError, match="now names another owner process"):
            engine.transfer(session, [src.data_ptr()], [hidden], [64])
    assert not mine.any()
    conn.send("report")
    assert not any(conn.recv()[1])  # the victim's unregistered buffer: untouched


def test_a_refused_call_into_files_and_anonymous_memory_wrote_none_of_it(
    victim: Any, writer: Any
) -> None:
    """A call's blocks into anonymous memory go by process_vm_writev, whose refusals (the
    owner's pid not vouched for, ptrace access denied) come at the first write: one write
    runs before any copy into the peer's files, so a refused call wrote nothing there."""
    import mmap

    _, _, proc = victim
    engine, src = writer
    name = f"{NAME}-file-{os.getpid()}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        mm = mmap.mmap(fd, 4096)
        shared = torch.frombuffer(mm, dtype=torch.uint8)
        private = torch.zeros(4096 + 64, dtype=torch.uint8)[8 : 8 + 4096]  # inside a page
        with SameHostEngine(f"{NAME}-liar-{os.getpid()}") as liar:
            liar.batch_register([shared.data_ptr(), private.data_ptr()], [4096, 4096])
            liar.registry._identity = _named(proc.pid)  # a process that does not hold its lock
            liar.registry.publish(liar._own.regions)
            with pytest.raises(TransferError, match="which does not hold"):
                engine.transfer(
                    liar.get_session_id(), [src.data_ptr()] * 2,
                    [shared.data_ptr(), private.data_ptr()], [64, 64],
                )  # fmt: skip
        assert not shared.any() and not private.any()
        del shared
        mm.close()
    finally:
        os.close(fd)
        os.unlink(os.path.join(SHM_DIR, name))


def _table_holder(conn: Connection, name: str) -> None:
    """A process with no engine: a shmslots table's participant, and a private buffer."""
    import ctypes

    from shmslots import Field, SlotTable

    with SlotTable.create(name, [Field("x", "uint8", (8,))], slots=4):
        buf = ctypes.create_string_buffer(4096)
        conn.send((os.getpid(), ctypes.addressof(buf)))
        conn.recv()
        conn.send(buf.raw)
        conn.recv()


def test_a_tables_participant_lock_vouches_for_no_registry(writer: Any) -> None:
    """A table linked under a registry's name, grown to a registry's size and given a
    header naming its participant's process and lock descriptor: that process holds a
    write lock on the file, but not on the registry's lock byte, so nothing is written."""
    import json
    from pathlib import Path

    from shmslots.participants import process_start_ticks
    from shmslots.sglang.samehost import registry

    engine, src = writer
    table, evil = f"{NAME}-table-{os.getpid()}", f"{NAME}-evil-{os.getpid()}"
    with peer_process(_table_holder, table) as (conn, (pid, target), _):
        st = os.stat(os.path.join(SHM_DIR, table))
        file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        held = [
            int(fd)
            for fd in os.listdir(f"/proc/{pid}/fdinfo")
            if any(
                line.split()[2:7] == ["OFDLCK", "ADVISORY", "WRITE", "-1", file]
                for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                if line.startswith("lock:")
            )
        ]
        assert held
        path = os.path.join(SHM_DIR, evil)
        os.link(os.path.join(SHM_DIR, table), path)
        try:
            os.truncate(path, registry.REGISTRY_BYTES)
            payload = json.dumps([[target, 4096, None, 0, 0, -1, None, None]]).encode()
            header = registry._HEADER.pack(
                registry.MAGIC, registry.FORMAT, 0, 2, pid, process_start_ticks(pid),
                registry.this_pidns(), os.geteuid(), len(payload), held[0],
            )  # fmt: skip
            with open(path, "r+b") as f:
                f.write(header)
                f.seek(registry.PAYLOAD_AT)
                f.write(payload)
            session = f"{evil}#{st.st_ino}:1"
            assert engine.send_probe(session) == -1
            with pytest.raises(TransferError):
                engine.transfer(session, [src.data_ptr()], [target], [64])
        finally:
            os.unlink(path)
        conn.send("report")
        assert not any(conn.recv())


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    """A copy here of another process's descriptor `fd`: the same open file, locks and all."""
    import ctypes

    got = ctypes.CDLL(None, use_errno=True).syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd
    if got < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
    return int(got)


def _self_namer(conn: Connection, target: int) -> None:
    """A peer whose registry, once the writer's process holds a copy of the peer's lock
    descriptor, names the writer's process and that copy as its owner, and `target` in it."""
    with SameHostEngine(f"{NAME}-self-namer-{os.getpid()}") as engine:
        conn.send((engine.get_session_id(), engine.registry._lock_fd))
        pid, fd = conn.recv()
        engine.registry._identity = _named(pid)
        engine.registry._lock_fd = fd
        engine.registry.publish([Region(target, 4096)])
        conn.send("named")
        conn.recv()


def test_a_registry_naming_the_writers_own_process_is_refused(writer) -> None:  # type: ignore[no-untyped-def]
    """While a writer's process holds a copy of a peer's lock descriptor (the engine never
    takes one, below, but the process may have), the kernel says that the writer's process
    holds the peer's lock.  A registry naming the writer and that copy is still refused: a
    registry may name this very process only if it is one of this process's own, which are
    read from memory."""
    engine, src = writer
    mine = torch.zeros(4096, dtype=torch.uint8)  # the writer's, registered by no engine
    with peer_process(_self_namer, mine.data_ptr()) as (conn, (session, lock_fd), proc):
        assert proc.pid is not None
        pidfd = os.pidfd_open(proc.pid)
        copy = _pidfd_getfd(pidfd, lock_fd)  # the same open file: its lock held through it too
        try:
            conn.send((os.getpid(), copy))
            assert conn.recv() == "named"
            with pytest.raises(TransferError, match="names this very process"):
                engine.transfer(session, [src.data_ptr()], [mine.data_ptr()], [64])
        finally:
            os.close(copy)
            os.close(pidfd)
    assert not mine.any()


def _lock_lister(conn: Connection) -> None:
    """A peer whose registry lists its own lock's descriptor as a memfd region."""
    with SameHostEngine(f"{NAME}-lock-lister-{os.getpid()}") as engine:
        reg = engine.registry
        base = 1 << 40
        reg.publish([Region(base, 4096, None, reg.inode, 0, reg._lock_fd)])
        conn.send((engine.get_session_id(), base, reg.inode))
        conn.recv()


def test_a_peers_memfd_is_opened_anew_so_the_writer_never_holds_its_locks(
    writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memfd a peer lists is opened through /proc/<pid>/fd, a new open file of the
    writer's: a copy of the peer's descriptor (pidfd_getfd) would be the peer's open file,
    with its locks, so that while the writer checked what the file was, the kernel said the
    writer's process held the lock the peer listed (another writer could then be told, by a
    registry naming this one, that it owns that registry)."""
    from shmslots.sglang.samehost import peer as peer_code
    from shmslots.sglang.samehost.registry import holds_lock

    engine, src = writer
    seen: list[bool] = []
    real = peer_code._seals

    def looking(fd: int) -> int:
        seen.append(holds_lock(os.getpid(), fd, inode))
        return real(fd)

    monkeypatch.setattr(peer_code, "_seals", looking)
    with peer_process(_lock_lister) as (conn, (session, base, inode), _):
        with pytest.raises(TransferError, match="not sealed"):
            engine.transfer(session, [src.data_ptr()], [base], [64])
        conn.send("bye")
    assert seen == [False]


def _rewriter(conn: Connection, name: str, target: int) -> None:
    """Another process of this user rewriting registry `name`'s region list in its file (it
    is 0600, this user's) to list `target`, its header left as it was."""
    import json

    from shmslots.sglang.samehost import registry

    path = os.path.join(SHM_DIR, name)
    with open(path, "r+b") as f:
        header = bytearray(f.read(registry.PAYLOAD_AT))
        payload = json.dumps([[target, 4096, None, 0, 0, -1, None, None]]).encode()
        size_at = registry._HEADER.size - 8  # payload length, then the lock's descriptor
        header[size_at : size_at + 4] = len(payload).to_bytes(4, "little")
        seq = int.from_bytes(header[16:24], "little") + 2
        header[16:24] = seq.to_bytes(8, "little")
        f.seek(0)
        f.write(bytes(header) + payload)
    conn.send("rewritten")
    conn.recv()


def test_an_engines_own_registry_rewritten_by_another_process_is_not_believed(writer) -> None:  # type: ignore[no-untyped-def]
    """Any process of this user may rewrite an engine's registry file.  Rewritten to list the
    engine's own private memory, with its true owner (this process, which holds the lock)
    left in the header, the engine's transfer to its own session would write itself: the
    list of a registry of this process is read from memory, so the block is refused."""
    engine, src = writer
    mine = torch.zeros(4096, dtype=torch.uint8)
    with peer_process(_rewriter, engine.registry.name, mine.data_ptr()) as (conn, _, _):
        session = engine.get_session_id()
        with pytest.raises(TransferError, match="not inside memory the peer"):
            engine.transfer(session, [src.data_ptr()], [mine.data_ptr()], [64])
        conn.send("bye")
    assert not mine.any()


def test_a_transfer_that_meets_a_deregistration_fails_rather_than_lose_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer deregisters a pool (its pages go back to private memory, the memfd is let go)
    and registers it again between a transfer's plan and its copies: the copies land in the
    old memfd, which the pool no longer uses, so the call must fail, not report them landed."""
    pool = np.zeros(1 << 20, dtype=np.uint8)  # page-aligned: moved onto a memfd
    src = np.full(1 << 16, 7, dtype=np.uint8)
    with (
        SameHostEngine(f"{NAME}-rereg-d-{os.getpid()}") as decode,
        SameHostEngine(f"{NAME}-rereg-p-{os.getpid()}", receives=False) as prefill,
    ):
        base = pool.ctypes.data
        decode.batch_register([base], [pool.nbytes])
        prefill.batch_register([src.ctypes.data], [src.nbytes])
        session = decode.get_session_id()
        assert prefill.batch_transfer_sync(session, [src.ctypes.data], [base], [4096]) == 0
        planned = engine_code.plan  # type: ignore[attr-defined]

        def then_reregistered(*args: Any) -> Any:
            got = planned(*args)
            decode.batch_deregister([base])
            decode.batch_register([base], [pool.nbytes])
            return got

        monkeypatch.setattr(engine_code, "plan", then_reregistered)
        with pytest.raises(TransferError, match="deregistered the region"):
            prefill.transfer(session, [src.ctypes.data], [base + 8192], [4096])

        def then_reregistered_and_read(*args: Any) -> Any:  # by another of its threads
            got = then_reregistered(*args)
            assert prefill.send_probe(session) == 0
            return got

        monkeypatch.setattr(engine_code, "plan", planned)  # the new memfd mapped, then again
        assert prefill.batch_transfer_sync(session, [src.ctypes.data], [base], [4096]) == 0
        monkeypatch.setattr(engine_code, "plan", then_reregistered_and_read)
        with pytest.raises(TransferError, match="deregistered the region"):
            prefill.transfer(session, [src.ctypes.data], [base + 8192], [4096])
        monkeypatch.setattr(engine_code, "plan", planned)
        assert prefill.batch_transfer_sync(session, [src.ctypes.data], [base + 8192], [4096]) == 0
    assert set(pool[:4096].tolist()) == {7} and set(pool[8192 : 8192 + 4096].tolist()) == {7}


def test_a_memfd_the_peer_could_shrink_or_did_not_register_is_refused(writer) -> None:  # type: ignore[no-untyped-def]
    engine, src = writer
    with peer_process(_forging_victim) as (conn, (session, why, base), _):
        for _ in range(3):
            with pytest.raises(TransferError, match=why):
                engine.transfer(session, [src.data_ptr()], [base], [64])
            conn.send("next")
            got = conn.recv()
            if isinstance(got, tuple):
                session, why, base = got
        assert got is False  # nothing was written


def test_memory_pinned_by_another_holder_stays_where_it_is() -> None:
    """A CUDA host registration or an RDMA memory region marks its range MADV_DONTFORK and
    holds its physical pages: moving them onto a memfd would leave that holder on the old
    pages, so such a range is registered as it is (written by process_vm_writev)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    held = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)
    free = torch.ones(1 << 20, dtype=torch.uint8)
    address = ctypes.addressof(ctypes.c_char.from_buffer(held))
    assert libc.madvise(address, 1 << 20, 10) == 0  # MADV_DONTFORK
    try:
        with SameHostEngine(f"{NAME}-pinned-{os.getpid()}") as engine:
            engine.batch_register([address, free.data_ptr()], [1 << 20, 1 << 20])
            moved = {r.base for r in engine._own.regions if r.memfd >= 0}
            assert not any(address <= b < address + (1 << 20) for b in moved)
            assert any(free.data_ptr() <= b < free.data_ptr() + (1 << 20) for b in moved)
    finally:
        held.close()


def test_a_transfer_returns_only_once_every_copy_thread_has_ended() -> None:
    """A failing run must not leave the others writing after the call has failed, nor start
    any job after it."""
    started: list[int] = []
    ended: list[int] = []
    one_began = threading.Event()

    def fail() -> None:
        assert one_began.wait(10)
        raise OSError("first run failed")

    def slow(i: int) -> None:
        started.append(i)
        one_began.set()
        time.sleep(0.2)
        ended.append(i)

    with SameHostEngine(f"{NAME}-runs-{os.getpid()}") as engine:
        with pytest.raises(OSError, match="first run failed"):
            engine._run([fail, *(functools.partial(slow, i) for i in range(1, 9))])
        assert 1 in ended and sorted(ended) == sorted(started)
        assert len(started) < 8  # the copy threads, busy with the first, began no other
        time.sleep(0.3)
        assert sorted(ended) == sorted(started)


def test_a_jobs_blocks_are_copied_in_one_call_as_memmove() -> None:
    """A job's host blocks go in one compiled call, as memmove (a target may overlap its
    source); a malformed list copies nothing."""
    buf = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
    want = buf.clone()
    at = buf.data_ptr()
    blocks = [(at + 16, at, 64), (at, at + 4096, 100), (at + 8192, at + 8192 + 32, 4000)]
    engine_code._copy(blocks)
    for src, dst, n in blocks:
        want[dst - at : dst - at + n] = want[src - at : src - at + n].clone()
    assert torch.equal(buf, want)
    engine_code._copy([])
    for bad in ((at, at), (at, at, -1), [at, at, 1]):
        with pytest.raises((TypeError, OverflowError)):
            engine_code._copy([(at, at + 64, 64), bad])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        engine_code._copy(tuple(blocks))  # type: ignore[arg-type]
    assert torch.equal(buf, want)


def test_a_call_lets_the_gil_go_only_around_256_kib_or_more() -> None:
    """Letting the GIL go at each block made each wait to get it back behind any busy Python
    thread (SGLang's scheduler is one), up to a switch interval apiece: a 14-block aux row
    took milliseconds.  With a switch interval of half a second, a busy thread runs during
    a call only if the call lets the GIL go."""
    small = torch.zeros(1 << 16, dtype=torch.uint8)
    at = small.data_ptr()
    blocks = [(at + 8192 + 256 * i, at + 256 * i, 100) for i in range(14)]
    source, target = (
        torch.ones(32 << 20, dtype=torch.uint8),
        torch.zeros(32 << 20, dtype=torch.uint8),
    )
    counter, stop = [0], threading.Event()

    def busy() -> None:
        while not stop.is_set():
            counter[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    thread = threading.Thread(target=busy)
    try:
        thread.start()  # then this thread has the GIL for up to 0.5 s, unless it lets it go
        before = counter[0]
        for _ in range(100):
            engine_code._copy(blocks)
        kept = counter[0] == before
        engine_code._copy([(source.data_ptr(), target.data_ptr(), source.numel())])  # 4 ms or so
        let_go = counter[0] != before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
    assert kept and let_go
    assert bool(target.all())


def _copy_threads(engine: SameHostEngine) -> ThreadPoolExecutor:
    """The engine's copy threads, made by a parallel run of two jobs that do nothing."""
    engine._run([lambda: None, lambda: None])
    assert engine._threads is not None
    return engine._threads


def test_jobs_no_copy_thread_takes_run_on_the_calling_thread() -> None:
    """Copy threads held by another call's jobs do not hold this call up: it runs its jobs
    itself."""
    release = threading.Event()
    ran_on: list[int] = []
    with SameHostEngine(f"{NAME}-steal-{os.getpid()}") as engine:
        threads = _copy_threads(engine)
        blockers = [threads.submit(release.wait, 10) for _ in range(engine_code.COPY_THREADS)]
        try:
            engine._run([lambda: ran_on.append(threading.get_ident())] * 4)
            assert ran_on == [threading.get_ident()] * 4
        finally:
            release.set()
            for blocker in blockers:
                blocker.result(10)


def test_a_job_failing_on_a_copy_thread_stops_the_call_starting_more() -> None:
    started: list[float] = []
    failed_at: list[float] = []

    def first() -> None:
        time.sleep(0.3)  # while the copy thread's job fails

    def fail() -> None:
        time.sleep(0.05)
        failed_at.append(time.monotonic())
        raise OSError("a copy thread's job failed")

    def other() -> None:
        started.append(time.monotonic())

    with SameHostEngine(f"{NAME}-cfail-{os.getpid()}") as engine:
        with pytest.raises(OSError, match="copy thread's job failed"):
            engine._run([first, fail, *[other] * 8])
        assert failed_at and all(t < failed_at[0] for t in started)


def test_jobs_offered_to_copy_threads_shut_down_by_close_run_on_the_calling_thread() -> None:
    """close() shuts the copy threads down once it has waited long enough for a transfer
    begun before it; that transfer's jobs then all run on its own thread.  One retired
    before it had copy threads makes none after (nothing would shut them down)."""
    ran_on: list[int] = []
    with SameHostEngine(f"{NAME}-shut-{os.getpid()}") as engine:
        _copy_threads(engine).shutdown()
        engine._run([lambda: ran_on.append(threading.get_ident())] * 4)
        assert ran_on == [threading.get_ident()] * 4
    with SameHostEngine(f"{NAME}-retired-{os.getpid()}") as engine:
        engine._retire(0.0)
        engine._run([lambda: ran_on.append(threading.get_ident())] * 4)
        assert engine._threads is None and ran_on == [threading.get_ident()] * 8


def test_a_copy_thread_that_cannot_start_fails_the_call_before_any_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only close()'s shutdown sends a call's jobs to its own thread; any other refusal to
    queue a job (a thread that cannot start) fails the call, with nothing run."""
    ran: list[int] = []
    with SameHostEngine(f"{NAME}-nothread-{os.getpid()}") as engine:
        threads = _copy_threads(engine)

        def refuse(*args: object) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threads, "submit", refuse)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            engine._run([lambda: ran.append(0), lambda: ran.append(1)])
        assert ran == []


def test_overlapping_targets_of_a_call_big_enough_for_copy_threads_land_in_call_order() -> None:
    """A call of PARALLEL_BYTES or more is cut over the copy threads unless its targets
    overlap: then the later block lands last, as in a small call."""
    size = engine_code.PARALLEL_BYTES * 3 // 4
    src = torch.cat(
        [torch.full((size,), 1, dtype=torch.uint8), torch.full((size,), 2, dtype=torch.uint8)]
    )
    target = torch.zeros(size, dtype=torch.uint8)
    with (
        SameHostEngine(f"{NAME}-ordw-{os.getpid()}") as writer,
        SameHostEngine(f"{NAME}-ordr-{os.getpid()}") as peer,
    ):
        writer.batch_register([src.data_ptr()], [src.numel()])
        peer.registry.publish([Region(target.data_ptr(), size)])  # written by process_vm_writev
        session = peer.get_session_id()
        s, t = src.data_ptr(), target.data_ptr()
        for _ in range(10):
            target.zero_()
            writer.transfer(session, [s, s + size], [t, t], [size, size])
            assert bool((target == 2).all())


def _lock_sharer(conn: Connection) -> None:
    """An engine whose lock's open file is shared with a process that outlives it (a child
    that kept the descriptor): its lock says alive after its death; its threads do not.  It
    registers a pool, whose whole pages move onto a memfd (a writer's mapping of that outlives
    it too), and gives an address among them."""
    import subprocess

    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    with SameHostEngine(f"{NAME}-sharer-{os.getpid()}") as engine:
        engine.batch_register([pool.data_ptr()], [pool.numel()])
        fd = engine.registry.ownership.lock_fd
        keeper = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=[fd]
        )
        threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
        conn.send((engine.get_session_id(), keeper.pid, pool.data_ptr() + (64 << 10)))
        conn.recv()


def test_an_owner_that_began_to_exit_is_gone_before_its_lock_goes(writer) -> None:  # type: ignore[no-untyped-def]
    """A SIGKILLed process keeps its lock until its memory is torn down (100s of ms with
    GiBs mapped): its threads' exit flags say it is gone before that, and a transfer that
    ends then fails (PeerGone) rather than report bytes landed in a dying process's pool."""
    engine, src = writer
    with peer_process(_lock_sharer) as (_, (session, keeper, pool), proc):
        reg = samehost.PeerRegistry(*samehost.parse_session(session))
        try:
            reg.refresh()
            assert reg.alive() and not reg.owner_gone() and not reg.exiting()
            assert engine.batch_transfer_sync(session, [src.data_ptr()], [pool], [64]) == 0
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not reg.owner_gone():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert reg.alive() and reg.exiting()  # the keeper holds the lock: threads tell
            with pytest.raises(PeerGone, match="died during the transfer"):
                engine.transfer(session, [src.data_ptr()], [pool], [64])
            assert engine.send_probe(session) == -1  # as SGLang's blacklist asks it
            proc.join(10)
            assert reg.owner_gone() and reg.exiting()  # reaped
        finally:
            os.kill(keeper, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while reg.alive():  # until the keeper's files are closed: then it is swept
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reg.close()


def _many_threads(conn: Connection) -> None:
    """An engine in a process of 65 threads, whose exit reaps them one by one."""
    with SameHostEngine(f"{NAME}-threads-{os.getpid()}") as engine:
        for _ in range(64):
            threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
        conn.send(engine.get_session_id())
        conn.recv()


def test_an_owner_once_seen_exiting_stays_gone_while_its_threads_are_reaped() -> None:
    """A SIGKILLed process's threads leave /proc one by one: a thread reaped between the
    two listings of its tasks is one that exited, not a sign of life (it made a dying peer
    read as alive again, in 3 of 4 tries)."""
    for _ in range(4):
        with peer_process(_many_threads) as (_, session, proc):
            reg = samehost.PeerRegistry(*samehost.parse_session(session))
            try:
                reg.refresh()
                assert proc.pid is not None and not reg.owner_gone()
                os.kill(proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while not reg.owner_gone():
                    assert time.monotonic() < deadline
                seen = 0
                while proc.exitcode is None:  # until reaped, each look says gone
                    assert reg.owner_gone() and reg.exiting(), f"alive again after {seen} looks"
                    seen += 1
                    assert time.monotonic() < deadline
            finally:
                reg.close()


def _big_exiter(conn: Connection, writer: Connection) -> None:
    """An engine in a process with 256 MiB of shared memory mapped (its teardown takes
    ms), and a pipe's writing end, which closes with its other descriptors."""
    import mmap

    mm = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    mm.write(b"x" * (256 << 20))
    with SameHostEngine(f"{NAME}-exiter-{os.getpid()}", receives=False) as engine:
        conn.send(engine.get_session_id())
        conn.recv()
    del writer


def test_an_owner_has_exited_whole_only_once_its_descriptors_are_closed() -> None:
    """A decode that takes copies into GPU memory may release a dead prefill's pages only
    once the prefill's descriptors, its GPU driver's among them, are closed: its GPU may
    run the copies it queued until then.  `exited` says so only then (here a pipe's end,
    closed with them), later than `owner_gone`, and before the process is reaped."""
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    with peer_process(_big_exiter, writer) as (_, session, proc):
        writer.close()
        reg = samehost.PeerRegistry(*samehost.parse_session(session))
        try:
            reg.refresh()
            ranks = backend._Ranks()  # the decode's watcher's view, for a decode with GPU KV
            assert not reg.exited() and not reg.owner_gone()
            assert ranks.alive(reg.name, until_exited=True)
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while ranks.alive(reg.name, until_exited=True):
                assert time.monotonic() < deadline
            assert reg.exited()  # (not reaped: nothing here waits for it yet)
            assert reader.poll(0), "exited before its descriptors were closed"
            with pytest.raises(EOFError):
                reader.recv()
            assert reg.owner_gone() and os.path.exists(f"/proc/{proc.pid}")  # a zombie
        finally:
            reg.close()
            reader.close()


def _thread_churner(conn: Connection) -> None:
    """An engine in a process whose threads come and go, as any server's pools do."""

    def churn() -> None:
        while True:
            one = threading.Thread(target=int)
            one.start()
            one.join()

    with SameHostEngine(f"{NAME}-churn-{os.getpid()}", receives=False) as engine:
        for _ in range(2):
            threading.Thread(target=churn, daemon=True).start()
        conn.send(engine.get_session_id())
        conn.recv()


def test_an_owner_whose_threads_come_and_go_is_never_read_as_gone() -> None:
    """A thread released between the open and the read of its /proc stat file gives ESRCH,
    which was taken for the whole process reaped: a live prefill read as gone about 500
    times a second, and the decode's watcher would fail its rooms and release their pages
    while it still wrote them."""
    with peer_process(_thread_churner) as (_, session, proc):
        reg = samehost.PeerRegistry(*samehost.parse_session(session))
        try:
            reg.refresh()
            looks, until = 0, time.monotonic() + 3
            while time.monotonic() < until:
                assert not reg.owner_gone(), f"read as gone at look {looks}"
                looks += 1
            assert proc.is_alive() and reg.alive() and looks > 1000
        finally:
            reg.close()


def test_memory_the_engine_lets_go_is_private_again() -> None:
    """Deregistered (here: the engine closed), a moved range goes back onto private pages
    with its bytes and leaves the memfd: a child forked afterwards copies it on write instead
    of sharing it (a shared heap page would let the child's malloc write the parent's)."""
    t = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    before = t.clone()
    end = t.data_ptr() + t.numel()

    def moved() -> list[tuple[int, int]]:
        return [
            m[:2]
            for m in mappings()
            if m[5].startswith("/memfd:shmslots-pd") and m[0] < end and m[1] > t.data_ptr()
        ]

    import ctypes

    def in_child(act: Callable[[], bool]) -> None:
        pid = os.fork()
        if pid == 0:  # no torch in the child: its thread pool is the parent's
            os._exit(0 if act() else 1)
        assert os.waitpid(pid, 0)[1] == 0

    def writes() -> bool:
        ctypes.memset(t.data_ptr(), 0, t.numel())
        return not moved()

    with SameHostEngine(f"{NAME}-back-{os.getpid()}") as engine:
        engine.batch_register([t.data_ptr()], [t.numel()])
        got = moved()
        assert got
        # registered, the moved pages are not the child's at all (MADV_DONTFORK), neither
        # shared with it nor copied at every fork
        in_child(lambda: not [m for m in mappings() if m[:2] in got])
        assert moved() == got
        memfd = os.dup(next(r.memfd for r in engine._own.regions if r.memfd >= 0))
    try:
        assert not moved() and torch.equal(t, before)
        assert os.fstat(memfd).st_blocks == 0  # its pages left the file as they moved back
    finally:
        os.close(memfd)
    in_child(writes)  # private again: the child writes its own copy
    assert torch.equal(t, before)


def test_a_range_that_cannot_all_move_stays_private(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A move that fails part way (here: a chunk it cannot read) puts the chunks it had
    moved back onto private pages, bytes kept, so the range is what the caller is told:
    private, written by process_vm_writev."""
    import ctypes
    import mmap

    monkeypatch.setattr("shmslots.sglang.samehost.memfd.SHARE_CHUNK", 1 << 20)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mm = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    mm[:] = bytes(range(256)) * (4 << 12)
    assert libc.mprotect(base + (2 << 20), 1 << 20, 0) == 0  # PROT_NONE
    try:
        with pytest.raises(OSError):
            share(samehost.Region(base, 4 << 20))
        shared = [m for m in mappings() if m[5].startswith("/memfd:shmslots-pd")]
        assert not [m for m in shared if m[0] < base + (4 << 20) and m[1] > base]
    finally:
        assert libc.mprotect(base + (2 << 20), 1 << 20, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    assert mm[: 2 << 20] == bytes(range(256)) * (2 << 12)
    mm.close()


def _freed_before_close(conn: Connection) -> None:
    """Registers a block malloc took from its heap, frees it, then closes the engine: the
    move back must not copy through a heap buffer, which malloc may place in that block."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert libc.mallopt(-3, 32 << 20) == 1  # M_MMAP_THRESHOLD (its most): blocks from the heap
    assert libc.mallopt(-1, 1 << 30) == 1  # M_TRIM_THRESHOLD: a freed block stays mapped
    n = 16 << 20
    block = libc.malloc(n)
    ctypes.memset(block, 7, n)
    engine = SameHostEngine(f"{NAME}-freed-{os.getpid()}")
    engine.batch_register([block], [n])
    moved = bool([m for m in mappings() if m[5].startswith("/memfd:shmslots-pd")])
    libc.free(block)
    engine.close()
    blocks = [libc.malloc(1 << 20) for _ in range(64)]  # the heap is whole: malloc checks
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
    shared = [m for m in mappings() if m[5].startswith("/memfd:shmslots-pd")]
    conn.send((moved, shared))
    conn.recv()


def test_memory_freed_before_the_engine_closes_goes_back_to_malloc_whole() -> None:
    with peer_process(_freed_before_close) as (_, (moved, shared), proc):
        assert moved and not shared
    assert proc.exitcode == 0


def _deregistering_victim(conn: Connection) -> None:
    """A peer whose moved range is deregistered when asked, while its engine lives on."""
    pool = torch.zeros(2 << 20, dtype=torch.uint8)
    with SameHostEngine(f"{NAME}-dereg-{os.getpid()}") as engine:
        engine.batch_register([pool.data_ptr()], [pool.numel()])
        conn.send((engine.get_session_id(), pool.data_ptr()))
        conn.recv()
        engine.batch_deregister([pool.data_ptr()])
        conn.send("deregistered")
        conn.recv()


def _peer_files() -> int:
    """Mappings of this process of a peer's memfds (a writer's own moved ranges are not
    mapped from its peers' files: the writer fixture's source has no whole page)."""
    return len([m for m in mappings() if m[5].startswith("/memfd:shmslots-pd")])


def test_a_peers_files_are_unmapped_once_deregistered_or_dead(writer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each mapping of a peer's memfd holds that file's memory: it goes when the peer no
    longer registers the range, and when the peer dies (a restarted decode is a new session,
    and nothing probes the old one)."""
    monkeypatch.setattr(engine_code, "PRUNE_EVERY_S", 0.05)
    engine, src = writer
    before = _peer_files()
    with peer_process(_deregistering_victim) as (conn, (session, pool), _):
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [pool + 8192], [64]) == 0
        assert _peer_files() == before + 1
        conn.send("deregister")
        assert conn.recv() == "deregistered"
        _until(lambda: _peer_files() == before)  # by the pruner: no call is needed
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [pool + 8192], [64]) == -1
    with peer_process(_moved_victim) as (conn, (session, start, *_), proc):
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [start + 8192], [64]) == 0
        assert _peer_files() == before + 1
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        _until(lambda: _peer_files() == before)  # an idle writer lets a dead peer's memory go
        assert session not in engine._peers


def _until(done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


def test_a_peer_that_dies_while_its_pages_are_written_fails_the_transfer(
    writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write into a dead peer's shared pages succeeds (the mapping is this process's);
    the liveness check after the copies still fails the call, as a write into a dead
    process's private memory does."""
    engine, src = writer
    real = engine_code._copy
    with peer_process(_moved_victim) as (_, (session, start, *_), proc):
        assert proc.pid is not None
        pid = proc.pid

        def copy_into_the_dead(blocks: list[tuple[int, int, int]]) -> None:
            os.kill(pid, signal.SIGKILL)
            proc.join(10)
            seen = samehost.PeerRegistry(samehost.parse_session(session)[0], None)
            try:
                _until(lambda: not seen.alive())
            finally:
                seen.close()
            real(blocks)  # lands in the dead peer's memfd, through this process's mapping

        monkeypatch.setattr(engine_code, "_copy", copy_into_the_dead)
        with pytest.raises(PeerGone, match="died during the transfer"):
            engine.transfer(session, [src.data_ptr()], [start + 8192], [64])


def test_a_new_session_first_lets_go_of_dead_peers(writer: Any, monkeypatch: Any) -> None:
    """A restarted decode is a new session: the old one's mappings (its memory) go before
    the new one is opened, whenever the pruner last ran."""
    monkeypatch.setattr(engine_code, "PRUNE_EVERY_S", 3600.0)
    engine, src = writer
    before = _peer_files()
    with peer_process(_moved_victim) as (_, (session, start, *_), proc):
        assert engine.batch_transfer_sync(session, [src.data_ptr()], [start + 8192], [64]) == 0
        assert _peer_files() == before + 1
        proc.kill()
        proc.join(10)
        with peer_process(_victim) as (_, (other, shown, _), _):
            assert engine.batch_transfer_sync(other, [src.data_ptr()], [shown], [8]) == 0
            assert _peer_files() == before and session not in engine._peers


def test_every_block_is_placed_before_any_is_written_one_region_or_across_two() -> None:
    """Blocks inside one region on each side (placed by array lookups) and blocks across two
    adjacent regions of the peer's (placed piece by piece) in one transfer land byte for
    byte; a transfer with one block past any address, out of int64, malformed or negative
    among good ones writes nothing."""
    src = torch.arange(64, dtype=torch.uint8).repeat(64)  # 4 KiB
    target = torch.zeros(4096, dtype=torch.uint8)
    with (
        SameHostEngine(f"{NAME}-planw-{os.getpid()}") as writer,
        SameHostEngine(f"{NAME}-planr-{os.getpid()}") as peer,
    ):
        writer.batch_register([src.data_ptr()], [src.numel()])
        base, s = target.data_ptr(), src.data_ptr()
        peer.registry.publish([Region(base, 1000), Region(base + 1000, 3096)])
        session = peer.get_session_id()
        bad: list[tuple[Any, Any, Any]] = [
            ([s, s], [base, base + (1 << 63) - 8], [8, 8]),  # past any address
            ([s, s], [base, 1 << 64], [8, 8]),  # not an int64
            ([s, -(1 << 70)], [base, base + 8], [8, 8]),  # before any address
            ([s, s], [base, base + 4090], [8, 8]),  # past the peer's regions
            ([s, s], [base, base + 8], [8, -8]),  # negative
            ([s, "x"], [base, base + 8], [8, 8]),  # not a number
            ([[s, s]], [[base, base + 8]], [[8, 8]]),  # not flat
            (np.array([np.nan, s]), [base, base + 8], np.array([0.0, 8.0])),  # NaN, if empty
            ([s, s], [base], [8, 8]),  # columns of different lengths
        ]
        for sources, targets, lengths in bad:
            with pytest.raises(TransferError):  # refused in words, not by an accident
                writer.transfer(session, sources, targets, lengths)
            assert writer.batch_transfer_sync(session, sources, targets, lengths) == -1
        assert not target.any()  # nothing was written
        # 16 blocks inside one region each, one across the regions' seam, one empty
        sources = [s + 64 * i for i in range(16)] + [s + 3000, s]
        targets = [base + 2000 + 64 * i for i in range(16)] + [base + 990, base]
        lengths = [64] * 16 + [20, 0]
        writer.transfer(session, sources, targets, lengths)
        expected = torch.zeros(4096, dtype=torch.uint8)
        expected[2000:3024] = src[:1024]
        expected[990:1010] = src[3000:3020]
        assert torch.equal(target, expected)
        # overlapping targets, the first block across the seam: the later block lands last
        writer.transfer(session, [s, s + 100], [base + 990, base + 1000], [20, 8])
        expected[990:1010] = src[:20]
        expected[1000:1008] = src[100:108]
        assert torch.equal(target, expected)
