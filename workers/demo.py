"""`shmslots demo`: transfer -> decode workers on one table, with a live view.

The launcher does the work; this module only turns its progress into a
terminal view and a summary table, and says what the figures mean, since a
first-time user should not need the README to read them.
"""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from shmslots.cli_render import holdings_table

from . import eagle
from .decode import Policy
from .launcher import FlowConfig, FlowProgress, FlowResult, run_flow

POLICY_MEANING: dict[Policy, str] = {
    "hold": "decode keeps each request's slot until process_prebuilt has consumed its row, "
    "then releases it (correct, no copy)",
    "clone": "decode copies each row at commit and releases its slot at once "
    "(correct, one copy per row)",
    "early-release": "decode keeps views of each row but releases its slot at commit: the "
    "production bug, where a later transfer reuses the row under those views",
}


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
    if progress.config.leak_every:
        leaked = len(progress.leaked_tags)
        table.add_row("leaked slots (never released)", f"[red]{leaked:,}[/]" if leaked else "0")
    return table


def summary_table(result: FlowResult) -> Table:
    p = result.progress
    table = flow_table(p, "demo summary")
    table.add_row(
        "published / aborted (transfer)", f"{result.published:,} / {result.transfer_aborted:,}"
    )
    equation = "consumed + aborted" + (" + leaked" if p.config.leak_every else "")
    table.add_row(
        f"accounted (published = {equation})", "yes" if result.accounted else "[red]NO[/]"
    )
    table.add_row("slots still owned", str(result.final.owned))
    table.add_row("peak slots owned", str(p.peak_owned))
    table.add_row("seconds", f"{p.seconds:.1f}")
    return table


def intro(progress: FlowProgress) -> list[str]:
    """What runs, on which table, and how to look at it meanwhile."""
    c = progress.config
    lines = [
        f"shmslots demo: {c.requests:,} requests, {c.transfer_workers} transfer -> "
        f"{c.decode_workers} decode workers, table {progress.table} ({c.slots} slots)",
        f"policy {c.policy}: {POLICY_MEANING[c.policy]}",
        f"look inside while it runs, from another terminal: shmslots inspect {progress.table}",
    ]
    if c.leak_every:
        lines[2:2] = [
            f"leak injected: decode cancels 1 in {c.leak_every} of the requests it takes through "
            "an abort path that forgets the release, so those slots stay HELD; the table is "
            f"traced, and a transfer claim that waits {c.claim_wait_s:g} s for a free slot ends "
            "the run with SlotsExhausted"
        ]
        lines[-1] += " --by-site (who is holding the slots)"
    return lines


def exhaustion_lines(result: FlowResult) -> list[RenderableType]:
    """The SlotsExhausted a transfer worker got, and who held the slots just after."""
    e = result.progress.exhaustion
    if e is None:
        return []
    return [
        Text(f"transfer-{e.worker}: SlotsExhausted: {e.message}", style="bold red"),
        Text(
            f"the table right after ({e.snapshot.name}, as `shmslots inspect NAME --by-site` "
            "shows it):"
        ),
        holdings_table(e.snapshot, None),
    ]


def outro(result: FlowResult) -> list[str]:
    """What happened, in words, and what to try next."""
    p = result.progress
    policy = p.config.policy
    leaked = result.final.counters["leaked_views"]
    if p.unlinked:
        return [
            "[yellow]the table was unlinked from outside while the demo ran (`shmslots unlink "
            "--force`): the workers were stopped and the summary is of what was done[/]"
        ]
    if not result.accounted or result.final.owned:
        return [
            "[red]something is wrong:[/] not every published row was consumed or aborted exactly "
            "once, or slots are still owned; please report it with this output"
        ]
    if p.config.leak_every:
        ran_out = (
            "the table ran out of slots and a transfer worker's claim raised SlotsExhausted, "
            "naming the call site that held them (above)"
            if p.exhaustion
            else "the table did not run out (too few requests for this leak rate)"
        )
        return [
            f"what happened: decode never released {len(p.leaked_tags):,} of the requests it "
            f"took (1 in {p.config.leak_every}), so their slots stayed HELD; {ran_out}. "
            "The slots came back only when the decode workers shut down.",
            "try next: while it runs, watch the leaking call site grow from another terminal "
            "with `shmslots inspect NAME --by-site --older-than 100ms` (slots in flight are "
            "younger; a rarer leak runs longer: --requests 200000 --leak-every 1000)",
        ]
    if policy == "early-release":
        return [
            f"what happened: {p.corrupted:,} rows reached process_prebuilt with another request's "
            "draft state (the first token still matched), because their slots had been released "
            f"at commit and reused; shmslots caught and counted {leaked:,} views still referenced "
            "at release (strict mode refuses such a release). This is the bug shmslots exists "
            "to catch.",
            "try next: shmslots demo --policy hold (correct, no copy), or --policy clone",
        ]
    return [
        f"what happened: all {result.published:,} published rows were consumed intact or "
        "aborted, each exactly once, and no slot is left owned.",
        "try next: shmslots demo --policy early-release (the bug shmslots catches); "
        "shmslots inspect NAME from another terminal while a demo runs",
    ]


def run(
    requests: int,
    transfer: int,
    decode: int,
    slots: int,
    policy: Policy,
    hidden: int,
    burst: int,
    console: Console | None = None,
    leak_every: int = 0,
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
        leak_every=leak_every,
    )
    bar = Progress(
        TextColumn("requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    task = bar.add_task("requests", total=requests - requests % transfer)
    starting = Text(
        f"starting {transfer + decode} workers (each loads torch: a few seconds)...", style="dim"
    )
    with Live(console=console, refresh_per_second=4, transient=True) as live:

        def show(progress: FlowProgress) -> None:
            if progress.stats is None:  # the table exists, the workers are not started yet
                for line in intro(progress):
                    console.print(Text(line), soft_wrap=True)
            aborted = sum(len(r.aborted) for r in progress.transfers)
            bar.update(task, completed=progress.handled + aborted)
            view = flow_table(progress, "live")
            live.update(Group(bar, starting, view) if not progress.first_ns else Group(bar, view))

        result = run_flow(config, show)
    for part in exhaustion_lines(result):
        console.print(part, soft_wrap=True)
    console.print(summary_table(result))
    for line in outro(result):
        console.print(line, soft_wrap=True)
    p = result.progress
    good = result.accounted and result.final.owned == 0 and not p.corrupted and not p.unlinked
    return 0 if good else 1  # early-release shows the bug: its corrupted rows fail the run
