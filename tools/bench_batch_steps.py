"""Where a batch of 64 rows spends its time, step by step, in one process (no IPC wait).

    python tools/bench_batch_steps.py [--rounds N]

Each step of the batch path (claim_n, 64 writes, publish_all, poll, gather of the id,
release_all) is timed on its own over N rounds; the median per round is printed, in µs, with
µs per row.  The number that explains a missed throughput target is the largest one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import SMALL, unique_name
from bench_shm import BATCH, created_table, record_values

from shmslots import Lease, WriteSlot

STEPS = (
    "claim_n(64)",
    "64 x write(3 fields)",
    "publish_all(64)",
    "poll(64)",
    "gather(64, id).tolist()",
    "release_all(64)",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    rounds = parser.parse_args().rounds
    torch.set_num_threads(1)
    values = record_values(SMALL)
    steps: dict[str, list[float]] = {}
    with created_table(unique_name("steps"), SMALL) as table:
        for _ in range(rounds):
            marks = [time.perf_counter_ns()]
            slots: list[WriteSlot] = table.claim_n(BATCH, tag=1)
            marks.append(time.perf_counter_ns())
            for i, ws in enumerate(slots):
                ws.write(id=i, **values)
            marks.append(time.perf_counter_ns())
            table.publish_all(slots)
            marks.append(time.perf_counter_ns())
            leases: list[Lease] = table.poll(BATCH)
            marks.append(time.perf_counter_ns())
            table.gather(leases, "id").tolist()
            marks.append(time.perf_counter_ns())
            table.release_all(leases)
            marks.append(time.perf_counter_ns())
            assert len(leases) == BATCH
            for name, before, after in zip(STEPS, marks[:-1], marks[1:], strict=True):
                steps.setdefault(name, []).append((after - before) / 1e3)
    total = 0.0
    for name, samples in steps.items():
        median = statistics.median(samples[len(samples) // 10 :])  # after a warmup
        total += median
        print(f"{name:28} {median:8.2f} us  {median / BATCH * 1e3:7.0f} ns/row")
    print(f"{'total':28} {total:8.2f} us  {total / BATCH * 1e3:7.0f} ns/row")


if __name__ == "__main__":
    main()
