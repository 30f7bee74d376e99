"""Hand 64 MiB CUDA tensors from one process to another through a ref field; report GB/s.

The producer keeps each tensor alive until the consumer releases its slot;
the consumer opens the ref and reduces the tensor on the GPU (so the
bytes are really read).  Run by tools/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from shmslots import Field, SlotTable

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


if __name__ == "__main__":
    main()
