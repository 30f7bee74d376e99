"""Producers and consumers that move tagged, self-verifying rows through a table.

Every row's payload is derived from its tag, so a consumer proves on its own
that what it read is what was written for that tag — no side channel.
Used by the multiprocess tests and by the chaos run (tests/chaos.py, tools/chaos_soak.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import torch

from shmslots import Field, SlotTable

PAYLOAD = 32
SCHEMA = (
    Field("tag", "int64"),
    Field("producer", "int32"),
    Field("payload", "float32", (PAYLOAD,)),
)


def expected_payload(tag: int) -> torch.Tensor:
    return torch.arange(PAYLOAD, dtype=torch.float32) * float(tag % 9973 + 1)


@dataclass
class ProducerReport:
    producer: int
    published: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)


@dataclass
class ConsumerReport:
    consumer: int
    consumed: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    corrupted: list[int] = field(default_factory=list)
    redeliveries: int = 0


def produce(
    name: str, producer: int, tags: range, abort_every: int, results: Queue[ProducerReport]
) -> None:
    """Publish one row per tag; abort every `abort_every`-th before publishing."""
    report = ProducerReport(producer)
    with SlotTable.attach(name, "producer", label=f"producer-{producer}") as table:
        for i, tag in enumerate(tags):
            ws = table.claim(tag=tag, timeout=30.0)
            ws.write(tag=tag, producer=producer, payload=expected_payload(tag))
            if abort_every and i % abort_every == abort_every - 1:
                ws.abort()
                report.aborted.append(tag)
            else:
                ws.publish(timeout=30.0)
                report.published.append(tag)
    results.put(report)


def consume(
    name: str, consumer: int, abort_every: int, done: Event, results: Queue[ConsumerReport]
) -> None:
    """Take rows until producers are done and the queue is drained; verify each row."""
    report = ConsumerReport(consumer)
    with SlotTable.attach(name, "consumer", label=f"consumer-{consumer}") as table:
        n = 0
        while True:
            lease = table.take(timeout=0.05)
            if lease is None:
                if done.is_set() and table.stats().queued == 0:
                    break
                continue
            n += 1
            tag = lease.tag
            ok = lease.item("tag") == tag and torch.equal(
                lease.view("payload"), expected_payload(tag)
            )
            if lease.deliveries:
                report.redeliveries += 1
            if not ok:
                report.corrupted.append(tag)
            if abort_every and n % abort_every == 0:
                lease.abort()
                report.aborted.append(tag)
            else:
                lease.release()
                report.consumed.append(tag)
    results.put(report)
