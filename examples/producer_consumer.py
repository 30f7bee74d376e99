# python examples/producer_consumer.py [TABLE]
"""A producer and a consumer in two processes, handing EAGLE metadata rows over."""

import multiprocessing as mp
import sys

import torch

from shmslots import Field, SlotTable

FIELDS = [
    Field("output_id", "int64"),
    Field("topk_p", "float32", (16,)),
    Field("topk_index", "int64", (16,)),
    Field("hidden", "bfloat16", (4096,)),
]
REQUESTS = 8


def consumer(name: str) -> None:
    """The decode process: attach (every process that uses a table does), take, release."""
    with SlotTable.attach(name, "decode") as table:  # closes at the end; never unlinks
        for _ in range(REQUESTS):
            lease = table.take(timeout=5.0)  # READY -> HELD (owned by us)
            if lease is None:  # take() gives None when nothing was published in time
                sys.exit("consumer: no row within 5 s")
            token = lease.item("output_id")  # a scalar field as a Python int, no tensor
            hidden = lease.view("hidden")  # zero copy, valid while held
            ...  # much later, in process_prebuilt:
            print(f"request {lease.tag}: token {token}, hidden[0] {hidden[0].item()}")
            del hidden  # a view kept past release is reported (LeakedViewWarning)
            lease.release()  # HELD -> FREE, generation + 1


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "eagle-meta"
    # The producer creates the table; leaving this block closes and unlinks it, so it
    # lasts until the consumer is done.
    with SlotTable.create(name, FIELDS, slots=256) as table:
        decode = mp.get_context("spawn").Process(target=consumer, args=(name,))
        decode.start()
        for room_id in range(1, REQUESTS + 1):
            ws = table.claim(tag=room_id, timeout=1.0)  # FREE -> WRITING (owned by us)
            ws.write(
                output_id=100 + room_id,
                topk_p=torch.softmax(torch.randn(16), dim=0),
                topk_index=torch.randperm(32000)[:16],
                hidden=torch.full((4096,), room_id / 8, dtype=torch.bfloat16),
            )
            ws.publish()  # WRITING -> READY (queued)
        decode.join(60)
    return 0 if decode.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
