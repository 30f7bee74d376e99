# python examples/ref_fields.py [TABLE]
"""A ref field: a big tensor of variable length, copied once into the arena, read zero copy."""

import multiprocessing as mp
import sys

import torch

from shmslots import Field, SlotTable

FIELDS = [Field("id", "int64"), Field("hidden", "bfloat16", (None, 4096), kind="ref")]


def reader(name: str) -> None:
    with SlotTable.attach(name, "decode") as table:
        lease = table.take(timeout=5.0)
        if lease is None:
            sys.exit("reader: no row within 5 s")
        with lease:
            h = lease.tensor("hidden")  # zero copy: a view of the arena
            print(f"id {lease.item('id')}: hidden {tuple(h.shape)}, sum {h.sum().item():.0f}")
            del h


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "prefix-states"
    with SlotTable.create(name, FIELDS, slots=64, arena_bytes=64 << 20) as table:
        h = torch.ones(100, 4096, dtype=torch.bfloat16)  # (n, 4096) on CPU or CUDA
        table.claim(tag=1).write(id=1, hidden=h).publish()
        other = mp.get_context("spawn").Process(target=reader, args=(name,))
        other.start()
        other.join(60)
    return 0 if other.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
