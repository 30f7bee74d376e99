"""The same-host engine's GPU path: KV pages written from one process's CUDA memory into
another's by CUDA IPC of the allocation's base plus offset, and what it refuses.  The CUDA
tests run where a GPU is lent (tools/gpu_check.sh), each CUDA process spawned apart (CUDA
started in the test process would keep every later test's host memory where it is); the
refusals of forged GPU regions run everywhere."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
import torch
from test_samehost import NAME, peer_process

from shmslots.errors import ShmSlotsError
from shmslots.sglang import cuda_kv
from shmslots.sglang.samehost import Region, SameHostEngine, TransferError, registry

MiB = 1 << 20
PAGE = 64 << 10
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _pattern(n: int, start: int = 0) -> torch.Tensor:
    """`n` bytes on the GPU, no two pages alike (251 is prime)."""
    return (torch.arange(n, device="cuda") % 251 + start).to(torch.uint8)


@contextlib.contextmanager
def _sender(role: str, kv: torch.Tensor) -> Iterator[SameHostEngine]:
    """A sender-only engine (as SGLang's prefill's) with `kv` registered and written."""
    with SameHostEngine(f"{NAME}-{role}-{os.getpid()}", receives=False) as engine:
        engine.batch_register([kv.data_ptr()], [kv.numel()])
        torch.cuda.synchronize()  # the engine's stream waits for no other: sources complete
        yield engine


def _gpu_decode(conn: Connection) -> None:
    """Two 'layers' inside one CUDA allocation, each registered at its offset in it."""
    pool = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    layers = [pool[1 * MiB : 3 * MiB], pool[4 * MiB : 6 * MiB]]
    with SameHostEngine(f"{NAME}-gpudec-{os.getpid()}") as engine:
        engine.batch_register([t.data_ptr() for t in layers], [t.numel() for t in layers])
        conn.send((engine.get_session_id(), [t.data_ptr() for t in layers]))
        conn.recv()
        torch.cuda.synchronize()
        conn.send(pool.cpu().numpy().tobytes())
        conn.recv()


def _gpu_prefill(conn: Connection, session: str, targets: list[int]) -> None:
    """Pages 0-1 of each source layer to the peer's pages 5-6, page 2 to page 9; then a
    block past the peer's registration, and one from host memory, both refused."""
    layers = [_pattern(2 * MiB, i) for i in range(2)]
    host = torch.ones(PAGE, dtype=torch.uint8)
    with SameHostEngine(f"{NAME}-gpupre-{os.getpid()}") as engine:
        engine.batch_register(
            [t.data_ptr() for t in layers] + [host.data_ptr()],
            [t.numel() for t in layers] + [host.numel()],
        )
        torch.cuda.synchronize()  # the engine's stream waits for no other: sources complete
        src, dst, n = [], [], []
        for layer, target in zip(layers, targets, strict=True):
            src += [layer.data_ptr(), layer.data_ptr() + 2 * PAGE]
            dst += [target + 5 * PAGE, target + 9 * PAGE]
            n += [2 * PAGE, PAGE]
        engine.transfer(session, src, dst, n)
        refusals = []
        for s, d in ((layers[0].data_ptr(), targets[0] + 2 * MiB), (host.data_ptr(), targets[0])):
            try:
                engine.transfer(session, [s], [d], [PAGE])
                refusals.append("")
            except TransferError as exc:
                refusals.append(str(exc))
        drv = cuda_kv.driver()
        assert drv is not None
        conn.send((refusals, [t.cpu().numpy().tobytes() for t in layers], drv.batched))
        conn.recv()


@pytest.fixture(params=[True, False], ids=["one-batch-call", "a-call-per-block"])
def batched(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """GPU blocks queued in one cuMemcpyBatchAsync, or a call per block."""
    monkeypatch.setenv("SHMSLOTS_CUDA_BATCH", "1" if request.param else "0")  # the spawned see it
    return bool(request.param)


@pytest.mark.cuda
@cuda
def test_gpu_pages_land_in_the_peers_gpu_memory_by_cuda_ipc(batched: bool) -> None:
    with (
        peer_process(_gpu_decode) as (dec, (session, targets), _),
        peer_process(_gpu_prefill, session, targets) as (_, (refusals, sources, used), _),
    ):
        if used != batched:
            pytest.skip("this CUDA driver has no cuMemcpyBatchAsync (before CUDA 12.8)")
        assert "not inside memory the peer" in refusals[0]
        assert "between host and GPU" in refusals[1]
        dec.send("check")
        pool = bytearray(dec.recv())
        expected = bytearray(8 * MiB)
        for i, (at, source) in enumerate(zip((1 * MiB, 4 * MiB), sources, strict=True)):
            expected[at + 5 * PAGE : at + 7 * PAGE] = source[: 2 * PAGE]
            expected[at + 9 * PAGE : at + 10 * PAGE] = source[2 * PAGE : 3 * PAGE]
            assert source[0] == i
        assert pool == expected  # every byte: the pages sent, nothing else


def _vmm_registrant(conn: Connection) -> None:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # before CUDA starts
    kv = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    with SameHostEngine(f"{NAME}-vmm-{os.getpid()}") as engine:
        try:
            engine.batch_register([kv.data_ptr()], [kv.numel()])
            refusal = ""
        except ShmSlotsError as exc:
            refusal = str(exc)
        conn.send((refusal, engine.registry.segment.mm[:8] == registry.MAGIC))
        conn.recv()


@pytest.mark.cuda
@cuda
def test_vmm_memory_is_refused_at_registration_not_at_transfer() -> None:
    with peer_process(_vmm_registrant) as (_, (refusal, _published), _):
        assert "CUDA IPC cannot share" in refusal and "VMM memory" in refusal


def _vmm_prefill(conn: Connection, session: str, targets: list[int]) -> None:
    """A sender-only engine (SGLang's prefill) sends from VMM memory, one block straddling
    the 20 MiB mark (torch maps an expandable segment's large pages 20 MiB at a time); a
    receiving engine refuses that memory."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # before CUDA starts
    kv = _pattern(48 * MiB)
    at = 20 * MiB - PAGE  # two pages over the first mapping's end
    with SameHostEngine(f"{NAME}-vmmrecv-{os.getpid()}") as receiving:
        try:
            receiving.batch_register([kv.data_ptr()], [kv.numel()])
            refusal = ""
        except ShmSlotsError as exc:
            refusal = str(exc)
    with _sender("vmmpre", kv) as engine:
        engine.transfer(
            session,
            [kv.data_ptr() + at, kv.data_ptr() + 40 * MiB],
            [targets[0] + 5 * PAGE, targets[1]],
            [2 * PAGE, PAGE],
        )
        sent = [kv[at : at + 2 * PAGE], kv[40 * MiB : 40 * MiB + PAGE]]
        conn.send((refusal, [t.cpu().numpy().tobytes() for t in sent]))
        conn.recv()


@pytest.mark.cuda
@cuda
def test_a_prefill_sends_from_vmm_memory_that_a_decode_could_not_share() -> None:
    with (
        peer_process(_gpu_decode) as (dec, (session, targets), _),
        peer_process(_vmm_prefill, session, targets) as (_, (refusal, sent), _),
    ):
        assert "CUDA IPC cannot share" in refusal  # the memory is VMM's indeed
        dec.send("check")
        pool = bytearray(dec.recv())
        expected = bytearray(8 * MiB)
        expected[1 * MiB + 5 * PAGE : 1 * MiB + 7 * PAGE] = sent[0]
        expected[4 * MiB : 4 * MiB + PAGE] = sent[1]
        assert sent[0] != bytes(2 * PAGE) and pool == expected


def _gpu_overlapper(conn: Connection, session: str, targets: list[int]) -> None:
    """24 blocks of two pages, each over the previous one's second page: the later must
    land last, batch call or not (a batch's copies run in no set order)."""
    kv = _pattern(2 * MiB)
    with _sender("overlap", kv) as engine:
        blocks = [(i * 3 * PAGE % (2 * MiB - 2 * PAGE), i * PAGE) for i in range(24)]
        engine.transfer(
            session,
            [kv.data_ptr() + at for at, _ in blocks],
            [targets[0] + to for _, to in blocks],
            [2 * PAGE] * len(blocks),
        )
        conn.send((blocks, kv.cpu().numpy().tobytes()))
        conn.recv()


@pytest.mark.cuda
@cuda
def test_gpu_blocks_whose_targets_overlap_land_in_call_order(batched: bool) -> None:
    with (
        peer_process(_gpu_decode) as (dec, (session, targets), _),
        peer_process(_gpu_overlapper, session, targets) as (_, (blocks, source), _),
    ):
        dec.send("check")
        pool = bytearray(dec.recv())
    expected = bytearray(8 * MiB)
    for at, to in blocks:  # one by one, in order, as the call listed them
        expected[1 * MiB + to : 1 * MiB + to + 2 * PAGE] = source[at : at + 2 * PAGE]
    assert pool == expected


def _gpu_pounder(conn: Connection, session: str, targets: list[int]) -> None:
    """Sends into the decode until a transfer fails; says so after its first, then how many
    went and how the first failure read, and whether its GPU still works after."""
    kv = _pattern(2 * MiB)
    with _sender("pound", kv) as engine:
        sent, failure = 0, ""
        deadline = time.monotonic() + 60
        while not failure and time.monotonic() < deadline:
            try:
                engine.transfer(session, [kv.data_ptr()] * 2, targets, [2 * MiB] * 2)
            except ShmSlotsError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            sent += 1
            if sent == 1:
                conn.send("sending")
        works = int((kv.to(torch.int64) + 1).sum().item()) > 0
        conn.send((sent, failure, works, len(engine._peers)))
        conn.recv()


@pytest.mark.cuda
@cuda
def test_a_decode_killed_under_gpu_writes_fails_the_next_transfer() -> None:
    with (
        peer_process(_gpu_decode) as (_, (session, targets), decode),
        peer_process(_gpu_pounder, session, targets) as (prefill, _, _),
    ):
        time.sleep(0.5)
        assert decode.pid is not None
        os.kill(decode.pid, signal.SIGKILL)
        decode.join(10)
        assert prefill.poll(60)
        sent, failure, works, peers = prefill.recv()
        assert sent > 1 and failure.startswith("PeerGone"), failure
        assert works and peers == 0  # its GPU serves on; the dead decode's mappings are gone


HANDLE = "ab" * 64
UUID = "cd" * 16


def _gpu_forger(conn: Connection) -> None:
    """A peer in its own process (a registry's list is read from its file only by other
    processes) publishing a GPU region over host memory of its own, then each forged GPU
    entry in turn; at the end it says whether that memory was written."""
    target = torch.zeros(PAGE, dtype=torch.uint8)
    base = target.data_ptr()
    lists = [
        Region(base, PAGE, offset=0, device=UUID, handle=HANDLE),
        Region(base, PAGE, device=UUID, handle="ab" * 8),  # a short handle
        Region(base, PAGE, device=UUID.upper(), handle=HANDLE),  # not as written here
        Region(base, PAGE, handle=HANDLE),  # a handle without its GPU
        Region(base, PAGE, memfd=3, device=UUID, handle=HANDLE),  # GPU memory in a memfd
    ]
    with SameHostEngine(f"{NAME}-gpur-{os.getpid()}") as engine:
        for region in lists:
            engine.registry.publish([region])
            conn.send((engine.get_session_id(), base))
            conn.recv()
        conn.send(bool(target.any()))
        conn.recv()


def test_a_gpu_region_takes_no_host_bytes_and_forged_gpu_regions_are_refused() -> None:
    """A peer's GPU region is written only from GPU memory registered here (a host source is
    refused before anything moves), and a region list with a malformed GPU entry is refused
    whole.  Runs without CUDA: the refusals come before any CUDA call."""
    src = torch.ones(PAGE, dtype=torch.uint8)
    with (
        SameHostEngine(f"{NAME}-gpuw-{os.getpid()}") as writer,
        peer_process(_gpu_forger) as (conn, (session, base), _),
    ):
        writer.batch_register([src.data_ptr()], [src.numel()])
        with pytest.raises(TransferError, match="between host and GPU"):
            writer.transfer(session, [src.data_ptr()], [base], [PAGE])
        for _ in range(4):
            conn.send("next")
            session, base = conn.recv()
            with pytest.raises(TransferError, match="malformed region"):
                writer.transfer(session, [src.data_ptr()], [base], [PAGE])
        conn.send("next")
        assert conn.recv() is False  # nothing was written
        conn.send("bye")
