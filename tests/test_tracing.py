"""Call sites of owners, hold-time histograms, and the prometheus_client collector."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from conftest import SMALL, SPAWN, Children, small_row
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_cli import cli

from shmslots import SlotsExhausted, SlotTable
from shmslots import layout as L
from shmslots.metrics import TableCollector
from shmslots.snapshot import TableView
from shmslots.tracing import TRACE_ENV

HERE = os.path.abspath(__file__)
GAP_S = 2.0  # between the holder's two calls: their ages differ by this much, and the
# --older-than check below has half of it for the CLI to start (slow on a loaded machine)
WAIT_S = 60


def _line_of(marker: str) -> int:
    with open(HERE) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}"))


def hold_writing(t: SlotTable) -> Any:
    return t.claim(tag=1)  # site: claim


def hold_lease(t: SlotTable) -> Any:
    return t.take(timeout=5.0)  # site: take


def holder(name: str, ready: Event, times: Queue[float], stop: Event) -> None:
    """Hold a WRITING slot from one function and a HELD one from another, then wait."""
    with SlotTable.attach(name, "holder") as t:
        t.claim(tag=2).write(**small_row(2)).publish()
        writing = hold_writing(t)
        times.put(time.monotonic())
        time.sleep(GAP_S)
        lease = hold_lease(t)
        times.put(time.monotonic())
        ready.set()
        stop.wait(WAIT_S)
        del writing, lease  # handed back by close()


def _expect_sites(
    doc: dict[str, Any], read_from: float, claimed: float, taken: float, alive: bool
) -> None:
    """`doc` is inspect's, read after `read_from`; the holder claimed and took at these times."""
    slots = {s["state"]: s for s in doc["slots"]}
    assert set(slots) == {"WRITING", "HELD"}
    for state, function, marker, since in (
        ("WRITING", "hold_writing", "site: claim", claimed),
        ("HELD", "hold_lease", "site: take", taken),
    ):
        s = slots[state]
        assert s["site"] == {"file": HERE, "line": _line_of(marker), "function": function}
        assert s["owner_role"] == "holder" and s["owner_alive"] is alive
        # the age was read after `read_from` and before this line: it lies between the two
        assert read_from - since - 0.05 <= s["age_s"] <= time.monotonic() - since + 0.05
    assert slots["WRITING"]["age_s"] - slots["HELD"]["age_s"] >= GAP_S - 0.05
    groups = {g["site"]["function"]: g for g in doc["by_site"]}
    assert set(groups) == {"hold_writing", "hold_lease"}
    for function, state in (("hold_writing", "WRITING"), ("hold_lease", "HELD")):
        g = groups[function]
        assert (g["count"], g["slots"], g["states"]) == (1, [slots[state]["slot"]], {state: 1})
        assert g["oldest_s"] == pytest.approx(slots[state]["age_s"], abs=0.05)
        assert [o["alive"] for o in g["owners"]] == [alive]


def test_inspect_attributes_slots_to_their_call_sites_alive_and_dead(
    name: str, children: Children
) -> None:
    with SlotTable.create(name, SMALL, slots=8, trace=True) as table:
        ready, stop = SPAWN.Event(), SPAWN.Event()
        times: Queue[float] = SPAWN.Queue()
        proc = children.start(holder, name, ready, times, stop)
        assert ready.wait(WAIT_S), "holder did not get ready"
        claimed, taken = times.get(timeout=WAIT_S), times.get(timeout=WAIT_S)

        read_from = time.monotonic()
        r = cli("inspect", name, "--json")
        assert r.returncode == 0, r.stderr
        _expect_sites(json.loads(r.stdout), read_from, claimed, taken, alive=True)
        grouped = cli("inspect", name, "--by-site")
        assert grouped.returncode == 0, grouped.stderr
        for function, marker in (("hold_writing", "site: claim"), ("hold_lease", "site: take")):
            assert f"{HERE}:{_line_of(marker)} in {function}" in grouped.stdout
        # just younger than the claim (stamped before `claimed` was read): the take, a gap
        # younger, stays out for as long as the CLI takes to read, up to the whole gap
        threshold = time.monotonic() - claimed - 0.05
        only_old = json.loads(cli("inspect", name, "--json", "--older-than", f"{threshold}").stdout)
        assert [s["state"] for s in only_old["slots"]] == ["WRITING"]

        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(WAIT_S)
        read_from = time.monotonic()
        dead = cli("inspect", name, "--json")
        assert dead.returncode == 1, dead.stderr  # a dead participant owns slots
        _expect_sites(json.loads(dead.stdout), read_from, claimed, taken, alive=False)
        assert "(dead)" in cli("inspect", name, "--by-site").stdout
        table.reap()


def test_slots_exhausted_names_the_top_holders(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=3, trace=True) as table:
        held = [hold_writing(table) for _ in range(2)]
        other = table.claim()
        with pytest.raises(SlotsExhausted) as exc:
            table.claim(timeout=0.01)
        message = str(exc.value)
        first = f"test_tracing.py:{_line_of('site: claim')} in hold_writing (2 slots, oldest "
        assert "top holders by call site: " + first in message
        assert "in test_slots_exhausted_names_the_top_holders (1 slots" in message
        for ws in [*held, other]:
            ws.abort()
        assert table.holdings() == []


def test_tracing_is_off_unless_asked(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with SlotTable.create(name, SMALL, slots=2) as table:
        ws = table.claim()
        doc = json.loads(cli("inspect", name, "--json").stdout)
        assert doc["header"]["traced"] is False and doc["slots"][0]["site"] is None
        assert "not traced" in cli("inspect", name, "--by-site").stdout
        with pytest.raises(SlotsExhausted) as exc:
            [table.claim(timeout=0.01) for _ in range(2)]
        assert "call site" not in str(exc.value)
        ws.abort()
    monkeypatch.setenv(TRACE_ENV, "1")  # a server restarted with it, code unchanged
    with SlotTable.create(name, SMALL, slots=2) as table:
        ws = table.claim()
        assert [h.site.function for h in table.holdings()] == ["test_tracing_is_off_unless_asked"]
        ws.abort()


def test_histograms_count_hold_and_wait_times(name: str) -> None:
    wait_s, hold_s = 0.02, 0.05
    with SlotTable.create(name, SMALL, slots=2) as table:
        ws = table.claim().write(**small_row(1))
        published = time.monotonic()  # before the publish: the wait can only be shorter
        ws.publish()
        time.sleep(wait_s)
        lease = table.take()
        taken = time.monotonic()
        assert lease is not None
        time.sleep(hold_s)
        lease.release()
        released = time.monotonic()
        table.claim().abort()  # a WRITING slot's end is no hold
        with TableView.open(name) as view:
            hists = view.snapshot().histograms
    # the compiled steps read CLOCK_MONOTONIC, as time.monotonic does
    for hist, at_least, at_most in (
        ("ready_wait", wait_s, taken - published),
        ("held", hold_s, released - published),
    ):
        counts = hists[hist].counts
        assert sum(counts) == hists[hist].count == 1
        bucket = counts.index(1)
        assert bucket == len(L.HIST_BOUNDS_NS) or L.HIST_BOUNDS_NS[bucket] >= at_least * 1e9
        assert at_least <= hists[hist].sum_s <= at_most
        low = L.HIST_BOUNDS_NS[bucket - 1] if bucket else 0
        assert low < hists[hist].sum_ns  # the one observation lies in its bucket
        if bucket < len(L.HIST_BOUNDS_NS):
            assert hists[hist].sum_ns <= L.HIST_BOUNDS_NS[bucket]


def test_histogram_sums_add_up_every_observation(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=4) as table:
        started = time.monotonic()
        for round_ in range(3):
            for tag in (1, 2):
                table.claim(tag=tag).write(**small_row(tag)).publish()
            leases = table.poll(2)
            time.sleep(0.01)
            if round_ == 2:
                table.abort_all(leases)  # an abort of a HELD slot ends a hold too
            else:
                table.release_all(leases)
        spent = time.monotonic() - started
        with TableView.open(name) as view:
            hists = view.snapshot().histograms
    assert hists["held"].count == hists["ready_wait"].count == 6
    assert 6 * 0.01 <= hists["held"].sum_s <= 6 * spent
    assert 0 < hists["ready_wait"].sum_s <= 6 * spent


HOLD_S = 0.05  # how long _busy_table holds its lease


def _busy_table(name: str) -> tuple[SlotTable, float]:
    """A traced table, one row taken, held HOLD_S, released, and one READY; and how long
    that took from the first publish (at least HOLD_S)."""
    table = SlotTable.create(name, SMALL, slots=4, trace=True)
    started = time.monotonic()
    for tag in (1, 2):
        table.claim(tag=tag).write(**small_row(tag)).publish()
    lease = table.take()
    assert lease is not None
    time.sleep(HOLD_S)
    lease.release()
    return table, time.monotonic() - started


def test_collector_in_a_fresh_registry(name: str) -> None:
    table, spent = _busy_table(name)
    with table:
        ws = table.claim(tag=3)  # site: collector
        registry = CollectorRegistry()
        registry.register(TableCollector(name))
        value = registry.get_sample_value
        t = {"table": name}
        assert value("shmslots_takes_total", t) == 1
        assert value("shmslots_publishes_total", t) == 2
        assert value("shmslots_slots", {**t, "state": "WRITING"}) == 1
        assert value("shmslots_slots", {**t, "state": "READY"}) == 1
        assert value("shmslots_dead_owned_slots", t) == 0
        for hist in ("shmslots_held_seconds", "shmslots_ready_wait_seconds"):
            assert value(hist + "_bucket", {**t, "le": "+Inf"}) == 1
            assert value(hist + "_count", t) == 1
        held, waited = (value(f"shmslots_{h}_seconds_sum", t) for h in ("held", "ready_wait"))
        assert held is not None and HOLD_S <= held <= spent
        assert waited is not None and 0 < waited <= spent
        site = {
            **t,
            "file": HERE,
            "line": str(_line_of("site: collector")),
            "function": "test_collector_in_a_fresh_registry",
        }
        assert value("shmslots_slots_held_by_site", site) == 1
        ws.abort()


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: lines.put(out.readline()), daemon=True).start()
    return lines.get(timeout=timeout)


def test_metrics_serve_over_http_parses_with_prometheus_client(name: str) -> None:
    table, spent = _busy_table(name)
    with table:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shmslots", "metrics", name, "--serve", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = _first_line(proc, WAIT_S)
            assert line.startswith("serving metrics on http://127.0.0.1:"), line
            url = line.split()[3]
            with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
                text = reply.read().decode()
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, err
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["shmslots_takes"].type == "counter"
    [takes] = families["shmslots_takes"].samples
    assert (takes.labels, takes.value) == ({"table": name}, 1)
    for hist in ("shmslots_held_seconds", "shmslots_ready_wait_seconds"):
        family = families[hist]
        assert family.type == "histogram"
        buckets = [s for s in family.samples if s.name == hist + "_bucket"]
        assert [s.labels["le"] for s in buckets][-1] == "+Inf"
        assert len(buckets) == L.HIST_BUCKETS
        values = [s.value for s in buckets]
        assert values == sorted(values) and values[-1] == 1
        [count] = [s for s in family.samples if s.name == hist + "_count"]
        [total] = [s for s in family.samples if s.name == hist + "_sum"]
        assert count.labels == total.labels == {"table": name} and count.value == 1
        # the one row held HOLD_S, the other waited less than the whole run
        at_least = HOLD_S if hist == "shmslots_held_seconds" else 1e-9
        assert at_least <= total.value <= spent
    by_state = {s.labels["state"]: s.value for s in families["shmslots_slots"].samples}
    assert by_state["READY"] == 1 and by_state["FREE"] == 3


def test_batch_calls_record_their_call_site_too(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=4, trace=True) as table:
        claimed = table.claim_n(2)
        (held,) = table.holdings()
        assert held.site.function == "test_batch_calls_record_their_call_site_too"
        assert sorted(held.slots) == sorted(ws.slot for ws in claimed) and held.states == {
            "WRITING": 2
        }
        for ws in claimed:
            ws.write(**small_row(ws.slot))
        table.publish_all(claimed)
        leases = table.poll(2)
        assert [h.states for h in table.holdings()] == [{"HELD": 2}]
        table.release_all(leases)
        assert table.holdings() == []
