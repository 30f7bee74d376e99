"""Spawned producers and consumers move rows through one table; every row is checked."""

from __future__ import annotations

import pytest
from conftest import SPAWN, Children
from stress import SCHEMA, ConsumerReport, ProducerReport, consume, produce

from shmslots import SlotTable

ROWS = 20_000


@pytest.mark.timeout(240)
def test_two_producers_two_consumers_every_row_accounted(name: str, children: Children) -> None:
    producer_results = SPAWN.Queue()
    consumer_results = SPAWN.Queue()
    done = SPAWN.Event()
    half = ROWS // 2
    with SlotTable.create(name, SCHEMA, slots=16) as table:
        for c in range(2):
            children.start(consume, name, c, 7, done, consumer_results)
        for p in range(2):
            tags = range(1 + p * half, 1 + (p + 1) * half)
            children.start(produce, name, p, tags, 11, producer_results)
        producers: list[ProducerReport] = [producer_results.get(timeout=200) for _ in range(2)]
        done.set()
        consumers: list[ConsumerReport] = [consumer_results.get(timeout=60) for _ in range(2)]
        children.join_all(timeout=30)

        published = sorted(t for r in producers for t in r.published)
        aborted_by_producers = [t for r in producers for t in r.aborted]
        handled = sorted(t for r in consumers for t in r.consumed + r.aborted)
        assert len(published) + len(aborted_by_producers) == ROWS
        assert len(aborted_by_producers) > 0
        assert handled == published  # each published row handled exactly once
        assert sum(len(r.aborted) for r in consumers) > 0
        assert [t for r in consumers for t in r.corrupted] == []
        stats = table.stats()
        assert stats.owned == 0 and stats.queued == 0
        assert table.check_consistency() == []
        assert stats.counters["publishes"] == len(published)
        assert stats.counters["takes"] == len(published)
