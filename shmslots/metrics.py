"""A prometheus_client collector for shmslots tables, for a server's own registry.

    from prometheus_client import REGISTRY
    from shmslots.metrics import TableCollector
    REGISTRY.register(TableCollector("my-table"))

Each scrape maps the tables read-only (shmslots.snapshot.TableView: looking never
changes a table, and never registers as a participant) and yields counters, gauges
per state, dead-owned slots, the oldest slot's age, slots held per call site (traced
tables) and the HELD / READY-wait histograms.  A table that is missing or unreadable
at scrape time is counted in `shmslots_scrape_errors` instead of failing the scrape.
This module is torch-free; `shmslots metrics` prints and serves the same collector.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from . import layout as L
from .errors import ShmSlotsError
from .snapshot import SlotSnapshot, TableSnapshot, TableView, oldest, slot_holdings

COUNTER_HELP = {
    "claims": "Slots claimed for writing (FREE -> WRITING).",
    "reserves": "Slots reserved for a producer (FREE -> RESERVED).",
    "publishes": "Rows published (WRITING -> READY), or kept by their writer (-> HELD).",
    "takes": "Rows taken by a consumer (READY -> HELD), or kept by their writer.",
    "releases": "Leases released after consumption (HELD -> FREE).",
    "aborts": "Slots aborted by their owner (WRITING, RESERVED or HELD -> FREE).",
    "cancels": "READY slots cancelled by request tag before pickup.",
    "leaked_views": "Field views still referenced when their slot was handed back.",
    "reclaimed_writing": "WRITING slots of dead participants returned to FREE.",
    "reclaimed_reserved": "RESERVED slots of dead participants returned to FREE.",
    "reclaimed_held_dropped": "HELD slots of dead consumers dropped (on_consumer_death=drop).",
    "redelivered": "HELD slots of dead consumers queued again as READY.",
    "participants_reaped": "Dead participants whose registry entries were reaped.",
    "quarantined": "Slots of aborted transfers closed until their late-write window ended.",
    "quarantines_ended": "QUARANTINED slots returned to FREE (window ended, owner closed or died).",
}
HISTOGRAM_HELP = {
    "held": "How long slots stayed HELD: take to release or abort.",
    "ready_wait": "How long published rows waited READY: publish to take.",
}
_BOUNDS = [f"{ns / 1e9:g}" for ns in L.HIST_BOUNDS_NS] + ["+Inf"]


def families(
    snaps: Iterable[tuple[TableSnapshot, Sequence[SlotSnapshot]]], errors: int = 0
) -> list[Metric]:
    """Every metric family of these (snapshot, dead-owned slots) pairs."""
    labels = ["table"]
    counters = {
        name: CounterMetricFamily(f"shmslots_{name}", help_, labels=labels)
        for name, help_ in COUNTER_HELP.items()
    }
    slots = GaugeMetricFamily("shmslots_slots", "Slots per state.", labels=["table", "state"])
    capacity = GaugeMetricFamily("shmslots_slot_capacity", "Slots in the table.", labels=labels)
    queued = GaugeMetricFamily("shmslots_queued", "Published rows waiting.", labels=labels)
    participants = GaugeMetricFamily(
        "shmslots_participants", "Registered participants, by liveness.", labels=["table", "alive"]
    )
    dead = GaugeMetricFamily(
        "shmslots_dead_owned_slots",
        "Slots owned by participants that are no longer alive (run shmslots reap).",
        labels=labels,
    )
    age = GaugeMetricFamily(
        "shmslots_oldest_slot_age_seconds",
        "Age of the oldest slot that is not FREE (0 if none).",
        labels=labels,
    )
    by_site = GaugeMetricFamily(
        "shmslots_slots_held_by_site",
        "Owned slots per call site that took them (tables made with trace=True).",
        labels=["table", "file", "line", "function"],
    )
    site_age = GaugeMetricFamily(
        "shmslots_oldest_by_site_seconds",
        "Age of the oldest slot each call site holds (tables made with trace=True).",
        labels=["table", "file", "line", "function"],
    )
    hists = {
        name: HistogramMetricFamily(f"shmslots_{name}_seconds", help_, labels=labels)
        for name, help_ in HISTOGRAM_HELP.items()
    }
    for snap, dead_slots in snaps:
        t = snap.name
        for name, family in counters.items():
            family.add_metric([t], snap.counters.get(name, 0))
        for state, n in snap.states.items():
            slots.add_metric([t, state], n)
        capacity.add_metric([t], snap.slots)
        queued.add_metric([t], snap.queued)
        for alive in (True, False):
            n = sum(p.alive is alive for p in snap.participants)
            participants.add_metric([t, str(alive).lower()], n)
        dead.add_metric([t], len(dead_slots))
        s = oldest(snap)
        age.add_metric([t], s.age_s if s else 0.0)
        for h in slot_holdings(snap.slot_states):
            site = [t, h.site.file, str(h.site.line), h.site.function]
            by_site.add_metric(site, len(h.slots))
            site_age.add_metric(site, h.oldest_s)
        for name, histogram in hists.items():
            hist, cumulative, total = snap.histograms[name], [], 0
            for bound, n in zip(_BOUNDS, hist.counts, strict=True):
                total += n
                cumulative.append((bound, float(total)))
            # _count is the +Inf bucket's; _sum the observed nanoseconds, in seconds
            histogram.add_metric([t], cumulative, sum_value=hist.sum_s)
    scrape_errors = GaugeMetricFamily(
        "shmslots_scrape_errors", "Tables that could not be read in this scrape."
    )
    scrape_errors.add_metric([], errors)
    return [
        *counters.values(), slots, capacity, queued, participants, dead, age, by_site,
        site_age, *hists.values(), scrape_errors,
    ]  # fmt: skip


class TableCollector(Collector):
    """Figures of the named tables, read afresh at every scrape."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def collect(self) -> Iterator[Metric]:
        found, errors = [], 0
        for name in self.names:
            try:
                with TableView.open(name) as view:
                    snap = view.snapshot()
                    found.append((snap, view.dead_owned(snap)))
            except (ShmSlotsError, OSError):
                errors += 1  # gone or unreadable: the scrape still answers
        yield from families(found, errors)


def registry_for(*names: str) -> CollectorRegistry:
    """A fresh registry holding only these tables' collector (for `shmslots metrics`)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(TableCollector(*names))
    return registry
