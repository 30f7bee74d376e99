"""Two CUDA figures, each between two processes, run by tools/gpu_check.sh on a GPU machine.

1. 64 MiB CUDA tensors handed over through a ref field: the producer keeps each tensor alive
   until the consumer releases its slot; the consumer opens the ref and reduces the tensor
   on the GPU (so the bytes are really read).
2. KV pages written by the same-host PD engine (CUDA IPC, `shmslots.sglang.cuda_kv`): 256 MiB
   a call in 128 KiB pages (a Llama-3-8B layer's K or V page of 64 tokens), scattered over a
   decode's pool in runs of 16 pages and one page at a time, the engine's copies queued in
   one batch call and one call per block; against the same blocks copied within one process
   by torch (cudaMemcpy device to device, a call per block).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection

import torch

from shmslots import Field, SlotTable
from shmslots.sglang import cuda_kv
from shmslots.sglang.samehost import SameHostEngine

N = 40
MiB = 1 << 20
SIZE = 64 * MiB
FIELDS = (Field("id", "int64"), Field("x", "uint8", (None,), kind="ref"))


def produce(name: str) -> None:
    with SlotTable.attach(name, "producer") as t:
        tensors = [torch.full((SIZE,), i % 251, dtype=torch.uint8, device="cuda") for i in range(4)]
        torch.cuda.synchronize()
        for i in range(N):
            t.claim(tag=i + 1, timeout=30).write(id=i, x=tensors[i % 4]).publish()
        while t.stats().states["FREE"] != t.slots:
            time.sleep(0.001)


def main() -> None:
    name = f"shmslots-gpu-{os.getpid()}"
    ctx = mp.get_context("spawn")
    with SlotTable.create(name, FIELDS, slots=4) as t:
        proc = ctx.Process(target=produce, args=(name,))
        proc.start()
        try:
            first = t.take(timeout=60)
            assert first is not None
            first.release()
            start = time.perf_counter()
            for _ in range(N - 1):
                lease = t.take(timeout=30)
                assert lease is not None
                x = lease.tensor("x")
                assert int(x[:1].item()) == (lease.tag - 1) % 4 % 251
                x.sum(dtype=torch.int64).item()
                del x
                lease.release()
            seconds = time.perf_counter() - start
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    print(
        f"{N - 1} x 64 MiB CUDA tensors by ref: {(N - 1) / seconds:.1f} tensors/s, "
        f"{(N - 1) * SIZE / seconds / 1e9:.1f} GB/s read on {torch.cuda.get_device_name(0)}"
    )


POOL = 512 * MiB
KV_PAGE = 128 << 10
CALLS = 20


def decode(conn: Connection) -> None:
    """A decode's KV pool on the GPU, registered; kept until told."""
    pool = torch.zeros(POOL, dtype=torch.uint8, device="cuda")
    with SameHostEngine(f"shmslots-pd-gpubw-{os.getpid()}") as engine:
        engine.batch_register([pool.data_ptr()], [POOL])
        conn.send((engine.get_session_id(), pool.data_ptr()))
        conn.recv()


def _blocks(source: int, target: int, run: int) -> tuple[list[int], list[int], list[int]]:
    """Half the pool in blocks of `run` bytes, from the source's first half to scattered
    target blocks."""
    order = torch.randperm(POOL // run, generator=torch.Generator().manual_seed(0)).tolist()
    targets = order[: POOL // run // 2]
    return (
        [source + i * run for i in range(len(targets))],
        [target + j * run for j in targets],
        [run] * len(targets),
    )


def prefill(run: int, result: Connection) -> None:
    """GB/s of the engine's transfers of `run`-byte blocks into a spawned decode, and of the
    same blocks copied in this process by torch."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode, args=(child,))
    proc.start()
    child.close()  # so that the decode's death is an EOF here, not a wait
    try:
        session, target = parent.recv()
        kv = torch.ones(POOL, dtype=torch.uint8, device="cuda")
        with SameHostEngine(f"shmslots-pd-gpubwp-{os.getpid()}", receives=False) as engine:
            engine.batch_register([kv.data_ptr()], [POOL])
            torch.cuda.synchronize()  # the engine's stream waits for no other
            src, dst, n = _blocks(kv.data_ptr(), target, run)
            engine.transfer(session, src, dst, n)  # opens the peer's allocation
            start = time.perf_counter()
            for _ in range(CALLS):
                engine.transfer(session, src, dst, n)
            ours = CALLS * sum(n) / (time.perf_counter() - start) / 1e9
        local = torch.zeros_like(kv)
        src, dst, n = _blocks(0, 0, run)
        pairs = [(kv[s : s + k], local[d : d + k]) for s, d, k in zip(src, dst, n, strict=True)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            for a, b in pairs:
                b.copy_(a)
            torch.cuda.synchronize()
        floor = CALLS * sum(n) / (time.perf_counter() - start) / 1e9
    finally:
        with contextlib.suppress(OSError):  # a dead decode has no ear for it
            parent.send("bye")
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    drv = cuda_kv.driver()
    result.send((ours, floor, drv is not None and drv.batched))


def samehost() -> None:
    ctx = mp.get_context("spawn")
    for run in (16 * KV_PAGE, KV_PAGE):
        for batched in ("1", "0"):
            os.environ["SHMSLOTS_CUDA_BATCH"] = batched  # read by the spawned prefill's driver
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=prefill, args=(run, child))
            proc.start()
            child.close()  # so that the prefill's death is an EOF here, not a wait
            try:
                ours, floor, used = parent.recv()
            finally:
                proc.join(120)
                if proc.is_alive():
                    proc.kill()
            how = "one batch call" if used else "a call per block"
            print(
                f"same-host PD engine, GPU to GPU by CUDA IPC, {POOL // 2 // run} blocks of "
                f"{run >> 10} KiB, {how}: {ours:.1f} GB/s; the same blocks copied in one "
                f"process: {floor:.1f} GB/s ({floor / ours:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
    samehost()
