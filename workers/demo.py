"""`shmslots demo`: transfer -> decode workers on one table, with a live view.

The launcher does the work; this module only turns its progress into a
terminal view and a summary table.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from workers import eagle
from workers.decode import Policy
from workers.launcher import FlowConfig, FlowProgress, FlowResult, run_flow


def flow_table(progress: FlowProgress, title: str) -> Table:
    c = progress.stats.counters if progress.stats else {}
    rate = progress.rate
    table = Table("measure", "value", title=title, title_justify="left")
    table.add_row("policy", progress.config.policy)
    table.add_row("rows/s consumed", f"{rate:,.0f}")
    table.add_row(
        "commit→consume p50 / p99",
        f"{progress.latency_us(0.5) / 1e3:.2f} / {progress.latency_us(0.99) / 1e3:.2f} ms",
    )
    if progress.stats:
        states = progress.stats.states
        table.add_row(
            "slots FREE / WRITING / READY / HELD",
            f"{states['FREE']} / {states['WRITING']} / {states['READY']} / {states['HELD']}",
        )
    table.add_row("verified", f"{progress.verified:,}")
    table.add_row("aborted (decode)", f"{progress.decode_aborted:,}")
    table.add_row("corrupted", f"[red]{progress.corrupted:,}[/]" if progress.corrupted else "0")
    table.add_row("leaked views", f"{c.get('leaked_views', 0):,}")
    return table


def summary_table(result: FlowResult) -> Table:
    p = result.progress
    table = flow_table(p, "demo summary")
    table.add_row(
        "published / aborted (transfer)", f"{result.published:,} / {result.transfer_aborted:,}"
    )
    table.add_row(
        "accounted (published = consumed + aborted)", "yes" if result.accounted else "[red]NO[/]"
    )
    table.add_row("slots still owned", str(result.final.owned))
    table.add_row("peak slots owned", str(p.peak_owned))
    table.add_row("seconds", f"{p.seconds:.1f}")
    return table


def run(
    requests: int,
    transfer: int,
    decode: int,
    slots: int,
    policy: Policy,
    hidden: int,
    burst: int,
    console: Console | None = None,
) -> int:
    console = console or Console()
    config = FlowConfig(
        requests=requests,
        transfer_workers=transfer,
        decode_workers=decode,
        slots=slots,
        policy=policy,
        shape=eagle.RowShape(hidden=hidden),
        burst=burst,
    )
    bar = Progress(
        TextColumn("requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    task = bar.add_task("requests", total=requests - requests % transfer)
    with Live(console=console, refresh_per_second=4, transient=True) as live:

        def show(progress: FlowProgress) -> None:
            aborted = sum(len(r.aborted) for r in progress.transfers)
            bar.update(task, completed=progress.handled + aborted)
            live.update(Group(bar, flow_table(progress, "live")))

        result = run_flow(config, show)
    console.print(summary_table(result))
    good = result.accounted and result.final.owned == 0
    if policy != "early-release":
        good = good and result.progress.corrupted == 0
    return 0 if good else 1
