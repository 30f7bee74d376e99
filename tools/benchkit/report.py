"""The report of tools/bench.py: figures from the raw sessions, the Markdown tables (ratios
against the targets of docs/performance.md, then absolute figures), and the
PNG plots.

Not run on its own; see tools/bench.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .common import KINDS, Spread, percentile, spread
from .session import BY_NAME, SHM_BATCH, SHM_BLOCK, SHM_BUSY, SHM_COPYING, SHM_LOAN, Session

BARE, QUEUE, ICEORYX = "bare ring", "mp.Queue", "iceoryx2 busy"
CLI_MAX_S = 0.3  # one CLI call, spawn to exit
LOAN_FLOOR = {"1MiB": 1.3, "64MiB": 1.2}  # round trip of a loaned tensor, x the bare ring
# Targets by record kind: a busy round trip within these times the bare ring's (issue #37
# tightened #26's 2.0 and 2.5), and the round trip as a user writes it at least these times
# faster than mp.Queue's.
RTT_FLOOR = {"small": 1.5, "eagle": 1.75}
ICEORYX_FASTER = 1.5  # busy round trip, iceoryx2's time / shmslots'
SGLANG_FASTER = 4.0  # SGLang's decode path per request, its clone at commit / shmslots
AS_WRITTEN = {"small": 15, "eagle": 8}
IDLE_CPU_MAX = 1.0  # % of a core: "no measurable CPU", with getrusage's resolution in mind
RSS_GROWTH_MAX = 1.0  # MiB between the first and the last checkpoint: "flat"
KIND_BYTES = {k.name: k.nbytes for k in KINDS}


# -- figures from sessions ----------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """One session reduced to what the tables and the JSON show."""

    transport: str
    kind: str
    rtt_us: Spread  # medians of the repeats
    rtt_p99_us: Spread  # p99 of each repeat
    rtt_trips: int
    rows_s: Spread
    mb_s: Spread
    cpus: tuple[int, int]
    preempted: tuple[int, int]
    seconds: float


def figures(s: Session) -> Figures:
    medians = [percentile(sorted(r), 50) / 1e3 for r in s.rtt_ns]
    p99s = [percentile(sorted(r), 99) / 1e3 for r in s.rtt_ns]
    mb = KIND_BYTES[s.kind] / (1 << 20)
    return Figures(
        s.transport,
        s.kind,
        spread(medians),
        spread(p99s),
        sum(len(r) for r in s.rtt_ns),
        spread(s.rows_s),
        spread([rate * mb for rate in s.rows_s]),
        s.cpus,
        s.preempted,
        round(s.seconds, 2),
    )


def quantiles_us(s: Session, points: int = 101) -> list[float]:
    """The round-trip distribution of all repeats at `points` evenly spaced quantiles."""
    ordered = sorted(x for r in s.rtt_ns for x in r)
    return [percentile(ordered, 100 * i / (points - 1)) / 1e3 for i in range(points)]


def find(figs: list[Figures], transport: str, kind: str) -> Figures | None:
    for f in figs:
        if f.transport == transport and f.kind == kind:
            return f
    return None


# -- formatting -----------------------------------------------------------------------------


def num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def with_spread(s: Spread, unit: str) -> str:
    return f"{num(s.median)} {unit} ({num(s.low)}-{num(s.high)}, n={s.runs})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Row:
    """One line of the ratio table; `met` is '-' where no target is set."""

    measure: str
    shmslots: str
    peer: str
    ratio: str
    target: str
    met: str


def met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def faster_row(
    measure: str, shm: Figures | None, peer: Figures | None, target: float | None, metric: str
) -> Row | None:
    """Time or rate of shmslots against a peer, as a speed-up: higher is better for shmslots."""
    if shm is None or peer is None:
        return None
    if metric == "rtt":
        ratio = peer.rtt_us.median / shm.rtt_us.median
        mine, theirs = with_spread(shm.rtt_us, "us"), with_spread(peer.rtt_us, "us")
        how = f"{peer.transport} / shmslots (time) = {ratio:.2f}x"
    else:
        ratio = shm.rows_s.median / peer.rows_s.median
        mine, theirs = with_spread(shm.rows_s, "rows/s"), with_spread(peer.rows_s, "rows/s")
        how = f"shmslots / {peer.transport} (rate) = {ratio:.2f}x"
    goal = f">= {target:g}x" if target else "-"
    return Row(
        measure,
        f"{shm.transport}: {mine}",
        f"{peer.transport}: {theirs}",
        how,
        goal,
        met(ratio >= target) if target else "-",
    )


def floor_row(
    measure: str, shm: Figures | None, bare: Figures | None, target: float | None, metric: str
) -> Row | None:
    """shmslots' time over the bare ring's, per round trip or per row one way: lower is
    better, 1.0 is the floor."""
    if shm is None or bare is None:
        return None
    floor = bare.rtt_us if metric == "rtt" else bare.rows_s
    if metric == "rtt":
        ratio = shm.rtt_us.median / bare.rtt_us.median
        mine, theirs = with_spread(shm.rtt_us, "us"), with_spread(bare.rtt_us, "us")
        how = f"shmslots / bare (time) = {ratio:.2f}x"
    else:
        ratio = bare.rows_s.median / shm.rows_s.median
        mine, theirs = with_spread(shm.rows_s, "rows/s"), with_spread(bare.rows_s, "rows/s")
        how = f"shmslots / bare (time per row) = {ratio:.2f}x"
    # whether the floor itself moved in this run (the VM runs a process at one of two speeds)
    how += f"; floor's runs spread {floor.high / floor.low:.2f}x"
    return Row(
        measure,
        f"{shm.transport}: {mine}",
        f"{bare.transport}: {theirs}",
        how,
        f"<= {target:g}x" if target else "-",
        met(ratio <= target) if target else "-",
    )


def limit_row(measure: str, value: Spread, unit: str, target: str, ok: bool) -> Row:
    return Row(measure, with_spread(value, unit), "-", "-", target, met(ok))


# -- the tables -------------------------------------------------------------------------------


def target_rows(r: dict[str, Any], figs: list[Figures]) -> list[Row]:
    """The targets of docs/performance.md: one row per promise, small record and EAGLE row."""

    def f(t: str, k: str) -> Figures | None:
        return find(figs, t, k)

    rows: list[Row | None] = []
    for kind in ("small", "eagle"):
        rows.append(faster_row(f"round trip, {kind}", f(SHM_BUSY, kind), f(QUEUE, kind), 15, "rtt"))
        rows.append(
            faster_row(
                f"round trip, {kind}, as a user writes it", f(SHM_COPYING, kind), f(QUEUE, kind),
                AS_WRITTEN[kind], "rtt",
            )
        )  # fmt: skip
        rows.append(
            faster_row(f"round trip, {kind}, vs iceoryx2", f(SHM_BUSY, kind), f(ICEORYX, kind),
                       ICEORYX_FASTER, "rtt")
        )  # fmt: skip
        busy, bare = f(SHM_BUSY, kind), f(BARE, kind)
        rows.append(floor_row(f"round trip, {kind}, vs floor", busy, bare, RTT_FLOOR[kind], "rtt"))
    rows.append(
        faster_row("one-way throughput, small", f(SHM_BLOCK, "small"), f(QUEUE, "small"), 8, "rate")
    )
    for kind in ("small", "eagle"):
        measure = f"one-way throughput, {kind}, batches of 64"
        rows.append(faster_row(measure, f(SHM_BATCH, kind), f(QUEUE, kind), 8, "rate"))
        rows.append(
            floor_row(measure + ", vs floor", f(SHM_BATCH, kind), f(BARE, kind), 1.25, "rate")
        )
    for kind, limit in LOAN_FLOOR.items():
        rows.append(
            floor_row(f"round trip, {kind}, loaned, vs floor", f(SHM_LOAN, kind), f(BARE, kind),
                      limit, "rtt")
        )  # fmt: skip
    if "gather" in r:
        rows += gather_rows(r["gather"])
    for label, wall in r.get("cli_s", {}).items():
        rows.append(
            limit_row(f"one CLI call, `{label}`", wall, "s", f"<= {CLI_MAX_S:g} s",
                      wall.median <= CLI_MAX_S)
        )  # fmt: skip
    if "sglang" in r:
        rows.append(sglang_row(r["sglang"]))
    one = r["one_process"]["claim_abort_ns"]
    rows.append(limit_row("claim+release, 1 process", one, "ns", "<= 1,000 ns", one.median <= 1000))
    two = r["contention"]["2 processes"]
    rows.append(
        limit_row(
            "claims/s, 2 processes contending", two, "/s", ">= 1,000,000/s", two.median >= 1e6
        )
    )
    idle = r["idle_cpu_percent"]["shmslots take(timeout)"]
    rows.append(
        limit_row(
            "CPU of a reader blocked ~2 s", idle, "% core", f"< {IDLE_CPU_MAX:g}% core",
            idle.median < IDLE_CPU_MAX,
        )
    )  # fmt: skip
    growth = r["rss"]["growth_mib"]
    rows.append(
        limit_row(
            f"RSS growth of a consumer, {r['rss']['between']}", growth, "MiB",
            f"<= {RSS_GROWTH_MAX:g} MiB", growth.median <= RSS_GROWTH_MAX,
        )
    )  # fmt: skip
    return [row for row in rows if row is not None]


def sglang_row(g: dict[str, Any]) -> Row:
    """SGLang 0.5.23's decode path per request: its clone at commit against shmslots' views
    held until consumed (`python tools/bench.py sglang`)."""
    measure = "SGLang decode path, per request"
    target = f">= {SGLANG_FASTER:g}x"
    if "missing" in g:
        return Row(measure, "-", f"not measured: {g['missing']}", "-", target, "-")
    ratio = g["sglang_us"].median / g["shmslots_us"].median
    return Row(
        measure,
        f"alloc, get_buf views, clear, free, release: {with_spread(g['shmslots_us'], 'us')}",
        f"SGLang 0.5.23 (get_buf clones): {with_spread(g['sglang_us'], 'us')}",
        f"SGLang / shmslots (time) = {ratio:.2f}x",
        target,
        met(ratio >= SGLANG_FASTER),
    )


def gather_rows(g: dict[str, Spread]) -> list[Row]:
    """table.gather of 64 EAGLE hidden states against torch.cat of the same private bytes
    (the target) and torch.stack of per-request clones (SGLang's way; reported)."""
    mine = with_spread(g["gather_us"], "us")
    cat = g["gather_us"].median / g["cat_us"].median
    stack = g["stack_clones_us"].median / g["gather_us"].median
    return [
        Row(
            "gather, 64 EAGLE hidden states",
            f"gather: {mine}",
            f"torch.cat: {with_spread(g['cat_us'], 'us')}",
            f"gather / cat (time) = {cat:.2f}x",
            "<= 1.5x",
            met(cat <= 1.5),
        ),
        Row(
            "gather, vs stack of clones",
            f"gather: {mine}; into out=: {with_spread(g['gather_out_us'], 'us')}",
            f"stack of clones: {with_spread(g['stack_clones_us'], 'us')}",
            f"stack / gather (time) = {stack:.2f}x",
            "-",
            "-",
        ),
    ]


def peer_rows(figs: list[Figures]) -> list[Row]:
    """Every other peer, side by side with the matching shmslots mode (no targets)."""
    pairs = [
        ("round trip", SHM_BUSY, "iceoryx2 busy", ("small", "eagle"), "rtt"),
        ("round trip", SHM_BLOCK, "iceoryx2 blocking", ("small", "eagle"), "rtt"),
        ("round trip", SHM_BLOCK, QUEUE, ("small", "eagle", "1MiB", "64MiB"), "rtt"),
        ("round trip", SHM_BLOCK, "mp.Pipe", ("small", "eagle"), "rtt"),
        ("round trip", SHM_BLOCK, "torch.mp Queue", ("small", "eagle", "1MiB", "64MiB"), "rtt"),
        ("round trip", SHM_BUSY, BARE, ("1MiB", "64MiB"), "rtt"),
        ("round trip", SHM_LOAN, QUEUE, ("1MiB", "64MiB"), "rtt"),
        ("round trip", SHM_COPYING, "iceoryx2 busy", ("small", "eagle"), "rtt"),
        ("throughput", SHM_BUSY, QUEUE, ("small",), "rate"),
        ("throughput", SHM_BUSY, "iceoryx2 busy", ("small", "eagle"), "rate"),
        ("throughput", SHM_BLOCK, "mp.Pipe", ("small", "eagle"), "rate"),
        ("throughput", SHM_BLOCK, "torch.mp Queue", ("small", "eagle", "1MiB", "64MiB"), "rate"),
        ("throughput", SHM_BUSY, BARE, ("small", "eagle", "1MiB", "64MiB"), "rate"),
        ("throughput", SHM_LOAN, BARE, ("1MiB", "64MiB"), "rate"),
    ]
    rows = []
    for what, mine, peer, kinds, metric in pairs:
        ratio_row = floor_row if peer == BARE else faster_row
        for kind in kinds:
            row = ratio_row(
                f"{what}, {kind}", find(figs, mine, kind), find(figs, peer, kind), None, metric
            )
            if row is not None:
                rows.append(row)
    return rows


def ratio_table(rows: list[Row]) -> str:
    header = ["measure", "shmslots", "peer", "ratio", "target", "met"]
    return table(header, [list(asdict(row).values()) for row in rows])


def absolute_table(figs: list[Figures]) -> str:
    header = ["transport", "record", "RTT median us", "RTT p99 us", "trips", "rows/s", "MiB/s"]
    lines = [
        [
            f.transport,
            f.kind,
            with_spread(f.rtt_us, ""),
            num(f.rtt_p99_us.median),
            str(f.rtt_trips),
            with_spread(f.rows_s, ""),
            num(f.mb_s.median),
        ]
        for f in figs
    ]
    return table(header, lines)


def placement(figs: list[Figures], pins: tuple[int, int] | None) -> list[str]:
    """Whether the busy pollers ever shared a core, and how often busy pollers were preempted."""
    busy = [f for f in figs if BY_NAME[f.transport].busy]
    shared = [f"{f.transport}/{f.kind}" for f in busy if f.cpus[0] == f.cpus[1]]
    lines = [
        f"- Pinned: A -> CPU {pins[0]}, B -> CPU {pins[1]} with os.sched_setaffinity in every "
        "two-process session (contention workers too); torch single-threaded in each child."
        if pins
        else "- Not pinned: only one CPU is allowed; busy-poll figures are not meaningful."
    ]
    if shared:
        lines.append(f"- **Busy pollers shared a core** in: {', '.join(shared)}.")
    else:
        cpus = sorted({f.cpus for f in busy})
        lines.append(f"- Busy pollers never shared a core (A, B last seen on CPUs {cpus}).")
    noisy = [f"{f.transport}/{f.kind} {f.preempted}" for f in busy if max(f.preempted) > 100]
    if noisy:
        lines.append(
            "- Busy pollers preempted > 100 times while timed (other load on their core): "
            + ", ".join(noisy)
        )
    return lines


def busy_machine(meta: dict[str, Any]) -> bool:
    """True when the 1-minute load average was 0.5 or more before the run (after it, the
    benchmark's own busy pollers are in the figure)."""
    return float(meta["load_before"].split(",")[0]) >= 0.5


def markdown(r: dict[str, Any], figs: list[Figures]) -> str:
    meta = r["meta"]
    one = r["one_process"]
    parts = [
        f"# shmslots benchmark ({meta['mode']}, {meta['runtime_s']:.0f} s)",
        "",
        "Ratios against the peers are speed-ups of shmslots: peer time / shmslots time, or "
        "shmslots rate / peer rate (higher is better for shmslots). Against the bare ring (the "
        "floor) they are shmslots time / floor time, per round trip or per row (lower is "
        "better, 1.0 = the floor). "
        "Figures are medians of the repeats with (lowest-highest, n=repeats).",
        "",
        "## Targets (docs/performance.md)",
        "",
        ratio_table(target_rows(r, figs)),
        "",
        "## shmslots against every peer",
        "",
        ratio_table(peer_rows(figs)),
        "",
        "## Absolute figures",
        "",
        absolute_table(figs),
        "",
        f"- claim+abort, 1 process: {with_spread(one['claim_abort_ns'], 'ns')}; "
        f"claim->write->publish->take->read->release, 1 process: "
        f"{with_spread(one['local_cycle_ns'], 'ns')}.",
        "- claims/s (claim+abort loops): "
        + "; ".join(f"{k} {with_spread(v, '/s')}" for k, v in r["contention"].items())
        + ".",
        "- CPU of an idle blocked reader: "
        + "; ".join(f"{k} {with_spread(v, '%')}" for k, v in r["idle_cpu_percent"].items())
        + ".",
        f"- Consumer RSS (MiB) after N rows, first run: {r['rss']['checkpoints'][0]}; "
        f"rows/s over the whole run {with_spread(r['rss']['rows_s'], '')}.",
        "",
        "## Conditions",
        "",
        *placement(figs, meta["pins"]),
        f"- Load average before {meta['load_before']}, after {meta['load_after']}; "
        f"CPUs allowed {meta['cpus']}."
        + (" **Other load was running: figures are noisy.**" if busy_machine(meta) else ""),
        *(f"- {note}" for note in meta["notes"]),
        "",
        "![round-trip latency](latency_cdf.png)",
        "![throughput vs payload](throughput_vs_payload.png)",
        "![gather of 64 EAGLE hidden states](gather.png)",
        "",
    ]
    return "\n".join(parts)


# -- plots ------------------------------------------------------------------------------------


def colour(transport: str) -> str:
    """The same colour for a transport in every panel and plot, and none shared: the ten
    of matplotlib's cycle, then black."""
    i = list(BY_NAME).index(transport)
    return f"C{i}" if i < 10 else "black"


def plot_latency(sessions: list[Session], path: Path) -> None:
    """CDF of round-trip samples per transport, one panel per record kind (log time axis)."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, kind in zip(axes.flat, KINDS, strict=True):
        for s in sessions:
            if s.kind != kind.name or not s.rtt_ns:
                continue
            ordered = sorted(x / 1e3 for r in s.rtt_ns for x in r)
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.plot(
                ordered,
                fractions,
                label=s.transport,
                color=colour(s.transport),
                drawstyle="steps-post",
            )
        ax.set_xscale("log")
        ax.set_xlabel("round trip (us, log)")
        ax.set_ylabel("fraction of trips")
        ax.set_title(f"round trip, {kind.name} record")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(figs: list[Figures], path: Path) -> None:
    """Rows/s and MiB/s against payload size, one line per transport (log-log)."""
    fig, (rows_ax, bytes_ax) = plt.subplots(1, 2, figsize=(13, 5))
    panels: list[tuple[Any, Callable[[Figures], float], str]] = [
        (rows_ax, lambda f: f.rows_s.median, "rows/s"),
        (bytes_ax, lambda f: f.mb_s.median, "MiB/s"),
    ]
    for transport in dict.fromkeys(f.transport for f in figs):
        mine = sorted(
            (f for f in figs if f.transport == transport), key=lambda f: KIND_BYTES[f.kind]
        )
        sizes = [KIND_BYTES[f.kind] for f in mine]
        for ax, value, _ in panels:
            ax.plot(
                sizes,
                [value(f) for f in mine],
                marker="o",
                label=transport,
                color=colour(transport),
            )
    for ax, _, label in panels:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("payload bytes (small row, EAGLE row, 1 MiB, 64 MiB; log)")
        ax.set_ylabel(f"{label} (log)")
        ax.set_title(f"one-way throughput, {label}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


GATHER_BARS = (
    ("gather_us", "table.gather"),
    ("gather_out_us", "table.gather(out=)"),
    ("cat_us", "torch.cat, private"),
    ("stack_clones_us", "torch.stack of clones"),
)


def plot_gather(g: dict[str, Spread], path: Path) -> None:
    """One bar per way of batching 64 EAGLE hidden states, lowest-highest as error bars."""
    fig, ax = plt.subplots(figsize=(7, 4))
    medians = [g[key].median for key, _ in GATHER_BARS]
    errors = [
        [g[key].median - g[key].low for key, _ in GATHER_BARS],
        [g[key].high - g[key].median for key, _ in GATHER_BARS],
    ]
    bars = ax.barh([label for _, label in GATHER_BARS], medians, xerr=errors, color="C0")
    ax.bar_label(bars, labels=[f"{m:.1f} us" for m in medians], padding=4)
    ax.set_xlabel("us per batch of 64 rows")
    ax.set_xlim(0, max(m + e for m, e in zip(medians, errors[1], strict=True)) * 1.2)
    ax.set_title("batching 64 EAGLE hidden states (bf16[4096], 512 KiB)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
