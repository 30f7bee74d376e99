# python examples/reservation.py [TABLE]
"""Reservation: decode books a slot first, and the producer fills exactly that slot."""

import multiprocessing as mp
import sys

import torch

from shmslots import Field, OwnershipError, SlotTable

FIELDS = [Field("output_id", "int64"), Field("hidden", "bfloat16", (8,))]


def producer(name: str, slot: int, generation: int) -> None:
    """Prefill: it was handed (slot, generation) by decode, by any channel."""
    with SlotTable.attach(name, "prefill") as table:
        ws = table.open_reserved(slot, generation)  # RESERVED -> WRITING (owned by us)
        ws.write(output_id=7, hidden=torch.ones(8, dtype=torch.bfloat16))
        ws.publish()  # WRITING -> READY


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "prefill-decode"
    with SlotTable.create(name, FIELDS, slots=4) as table:
        booked = table.reserve(tag=42)  # FREE -> RESERVED (owned by decode)
        prefill = mp.get_context("spawn").Process(
            target=producer, args=(name, booked.slot, booked.generation)
        )
        prefill.start()
        prefill.join(60)
        lease = table.take(timeout=5.0)
        if lease is None:
            sys.exit("no row within 5 s")
        with lease:  # releases at the end of the block
            print(f"slot {lease.slot} tag {lease.tag}: output_id {lease.item('output_id')}")
        try:  # the slot has moved on: its old generation opens nothing
            table.open_reserved(booked.slot, booked.generation)
        except OwnershipError as exc:
            print(f"stale reservation refused: {exc}")
    return 0 if prefill.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
