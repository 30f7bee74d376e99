"""Start producers and consumers on one table, show it live, and always clean up.

Every child is reaped and the table unlinked on any exit: normal end,
Ctrl-C, or a child's death.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shmslots import SlotTable, Stats
from workers.stress import SCHEMA, ConsumerReport, ProducerReport, consume, produce

SPAWN = mp.get_context("spawn")


@dataclass
class DemoResult:
    published: int
    handled: int
    aborted: int
    corrupted: int
    seconds: float
    final: Stats


def _view(stats: Stats, progress: Progress, rate: float) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_row(progress)
    states = Table("state", "slots", title="slot table", title_justify="left")
    for state, count in stats.states.items():
        if count or state in ("FREE", "READY", "HELD", "WRITING"):
            states.add_row(state, str(count))
    c = stats.counters
    flow = Table("measure", "value", title="flow", title_justify="left")
    flow.add_row("rows/s", f"{rate:,.0f}")
    for key in ("claims", "publishes", "takes", "releases", "aborts", "leaked_views"):
        flow.add_row(key, f"{c[key]:,}")
    row = Table.grid(padding=(0, 4))
    row.add_row(states, flow)
    grid.add_row(row)
    return grid


def run_demo(
    name: str, rows: int, producers: int, consumers: int, slots: int, console: Console
) -> DemoResult:
    """Move `rows` rows through a fresh table and show progress until all are handled."""
    producer_results = SPAWN.Queue()
    consumer_results = SPAWN.Queue()
    done = SPAWN.Event()
    procs: list[SpawnProcess] = []
    started = time.monotonic()
    with SlotTable.create(name, SCHEMA, slots=slots) as table:
        try:
            for c in range(consumers):
                procs.append(
                    SPAWN.Process(target=consume, args=(name, c, 0, done, consumer_results))
                )
            per = rows // producers
            for p in range(producers):
                tags = range(1 + p * per, 1 + (p + 1) * per)
                procs.append(
                    SPAWN.Process(target=produce, args=(name, p, tags, 50, producer_results))
                )
            for proc in procs:
                proc.start()
            progress = Progress(
                TextColumn("rows"),
                BarColumn(),
                TextColumn("{task.completed:,}/{task.total:,}"),
                TimeElapsedColumn(),
            )
            task = progress.add_task("rows", total=per * producers)
            reports: list[ProducerReport] = []
            last_n, last_t = 0, started
            with Live(console=console, refresh_per_second=4, transient=False) as live:
                while True:
                    stats = table.stats()
                    handled = stats.counters["publishes"] + stats.counters["aborts"]
                    now = time.monotonic()
                    rate = (stats.counters["releases"] - last_n) / max(now - last_t, 1e-9)
                    last_n, last_t = stats.counters["releases"], now
                    progress.update(task, completed=min(handled, per * producers))
                    live.update(_view(stats, progress, rate))
                    while not producer_results.empty():
                        reports.append(producer_results.get())
                    if len(reports) == producers:
                        break
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"worker {dead[0].pid} died (exit {dead[0].exitcode})")
                    time.sleep(0.25)
                done.set()
                results: list[ConsumerReport] = [
                    consumer_results.get(timeout=60) for _ in range(consumers)
                ]
                for proc in procs:
                    proc.join(30)
                live.update(_view(table.stats(), progress, 0.0))
        finally:
            done.set()
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        return DemoResult(
            published=sum(len(r.published) for r in reports),
            handled=sum(len(r.consumed) for r in results),
            aborted=sum(len(r.aborted) for r in reports),
            corrupted=sum(len(r.corrupted) for r in results),
            seconds=time.monotonic() - started,
            final=table.stats(),
        )
