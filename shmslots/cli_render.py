"""Rendering for the `shmslots` command line: rich tables and JSON documents.

Everything here is a pure function of snapshots taken by `shmslots.snapshot.TableView`;
nothing here opens, maps or changes a table.  The JSON shapes are documented in
`shmslots.cli`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .layout import HIST_BOUNDS_NS
from .schema import Field
from .snapshot import (
    DecodedRow,
    SlotSnapshot,
    TableSnapshot,
    by_index,
    in_use,
    oldest,
    quantile,
    slot_holdings,
)
from .states import State
from .tracing import CallSite
from .units import fmt_bytes, fmt_duration

# 2: ref fields (a schema entry's kind "ref", a slot's field key "ref"; both were "handle")
JSON_VERSION = 2
# What each rate of `watch` adds up.
RATES: dict[str, tuple[str, ...]] = {
    "claims": ("claims",),
    "publishes": ("publishes",),
    "releases": ("releases",),
    "aborts": ("aborts", "quarantined"),  # a cancel counts in aborts; a quarantine aborts too
    "reclaims": (
        "reclaimed_writing",
        "reclaimed_reserved",
        "reclaimed_held_dropped",
        "redelivered",
    ),
}
MAIN_STATES = ("FREE", "RESERVED", "WRITING", "READY", "HELD")
FIRST_VALUES = 8


# -- small formatters ------------------------------------------------------------------
def fmt_time(ns: int) -> str:
    """Local wall-clock time and how long ago."""
    when = datetime.fromtimestamp(ns / 1e9).astimezone()
    ago = fmt_duration(max(0.0, time.time() - ns / 1e9))
    return f"{when:%Y-%m-%d %H:%M:%S %Z} ({ago} ago)"


def _num(value: float | int | bool) -> str:
    if not isinstance(value, float):
        return str(value)
    text = f"{value:.6g}"
    return text + ".0" if text.lstrip("-").isdigit() else text


def state_name(s: SlotSnapshot) -> str:
    if s.state is None:
        return "changing"
    if s.frees_in_s is None:
        return s.state.name
    if s.frees_in_s >= 0:
        return f"{s.state.name} (frees in {fmt_duration(s.frees_in_s)})"
    return f"{s.state.name} (window ended {fmt_duration(-s.frees_in_s)} ago)"


def _titled(title: str) -> Table:
    return Table(title=title, title_justify="left", title_style="bold")


# -- who owns what ---------------------------------------------------------------------
def owner_text(snap: TableSnapshot, owner: int) -> Text:
    if owner < 0:
        return Text("-")
    p = by_index(snap).get(owner)
    if p is None:
        return Text(f"{owner} (unregistered)", style="red")
    if p.alive:
        return Text(f"{owner} pid {p.pid} {p.role}")
    return Text(f"{owner} pid {p.pid} {p.role} (dead)", style="bold red")


def problems(
    snap: TableSnapshot, dead: Sequence[SlotSnapshot], broken: Sequence[SlotSnapshot] = ()
) -> list[str]:
    """What `inspect` exits 1 for: slots owned by dead participants, queued rows that do not
    match their seal; each with the command that deals with it."""
    parts = by_index(snap)
    out = []
    for s in dead:
        p = parts.get(s.owner)
        who = f"participant {s.owner} (pid {p.pid} {p.role})" if p else f"participant {s.owner}"
        out.append(
            f"slot {s.slot} {state_name(s)} is owned by dead {who} (run `shmslots reap "
            f"{snap.name}`)"
        )
    for s in broken:
        out.append(
            f"slot {s.slot} {state_name(s)} generation {s.generation}: its row does not match "
            f"its seal, checksum bad (`shmslots inspect {snap.name} --slot {s.slot}` shows it)"
        )
    return out


def state_counts(states: Mapping[str, int]) -> str:
    """`FREE 4  WRITING 1 ...`: the main states always, the transient ones when present."""
    shown = [k for k in states if k in MAIN_STATES or states[k]]
    return "  ".join(f"{k} {states[k]}" for k in shown)


# -- inspect ---------------------------------------------------------------------------
def header_table(snap: TableSnapshot) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    rows = {
        "table": snap.name,
        "format": f"version {snap.version}",
        "size": f"{fmt_bytes(snap.total_size)} ({snap.slots} slots x {snap.row_size} B rows)",
        "created": fmt_time(snap.created_ns),
        "creator": f"pid {snap.creator_pid} uid {snap.creator_uid}",
        "strict": "yes" if snap.strict else "no",
        "on consumer death": snap.on_consumer_death,
        "max hold": fmt_duration(snap.max_hold_s) if snap.max_hold_s else "not set",
    }
    for key, value in rows.items():
        grid.add_row(key, Text(value))
    return grid


def schema_table(snap: TableSnapshot) -> Table:
    t = _titled("schema")
    for col in ("field", "kind", "dtype", "shape", "bytes", "item"):  # item: the column stride
        t.add_column(col, justify="right" if col in ("bytes", "item") else "left")
    for f in snap.fields:
        t.add_row(Text(f.name), f.kind, f.dtype, str(f.shape), str(f.nbytes), str(f.item_len))
    return t


def participants_table(snap: TableSnapshot) -> Table | Text:
    if not snap.participants:
        return Text("participants: none attached")
    t = _titled("participants")
    for col in ("#", "pid", "role", "name", "status", "attached for", "last seen"):
        t.add_column(col, justify="right" if col in ("#", "pid") else "left")
    now = time.time_ns()
    for p in snap.participants:
        status = Text("alive", style="green") if p.alive else Text("dead", style="bold red")
        t.add_row(
            str(p.index),
            str(p.pid),
            Text(p.role),
            Text(p.name),
            status,
            fmt_duration(max(0, now - p.attach_ns) / 1e9),
            fmt_duration(max(0, now - p.last_seen_ns) / 1e9) + " ago",
        )
    return t


def counters_table(counters: Mapping[str, int]) -> Table:
    t = _titled("counters")
    items = list(counters.items())
    half = (len(items) + 1) // 2
    for _ in range(2):
        t.add_column("counter")
        t.add_column("total", justify="right")
    for i in range(half):
        left = items[i]
        right = items[i + half] if i + half < len(items) else ("", "")
        t.add_row(left[0], f"{left[1]:,}", right[0], f"{right[1]:,}" if right[0] else "")
    return t


def shown_slots(snap: TableSnapshot, only_older: float | None) -> list[SlotSnapshot]:
    """The slots `inspect` lists: every one not FREE, or only those `only_older` old."""
    return [s for s in in_use(snap) if only_older is None or s.age_s >= only_older]


def slots_table(
    snap: TableSnapshot, older_than: float | None, only_older: float | None = None
) -> Table | Text:
    rows = shown_slots(snap, only_older)
    if not rows:
        if only_older is not None:
            return Text(f"no slot is {fmt_duration(only_older)} old or older")
        return Text(f"all {snap.slots} slots are FREE")
    t = _titled(f"slots not FREE ({len(rows)} of {snap.slots})")
    # "taken": how often this publication was taken (2 on a HELD slot: delivered twice)
    columns = ["slot", "state", "gen", "owner", "tag", "age", "taken"]
    for col in columns + ["call site"] * snap.traced:
        t.add_column(col, justify="right" if col in ("slot", "gen", "tag", "age") else "left")
    for s in rows:
        old = older_than is not None and s.age_s >= older_than
        age = Text(fmt_duration(s.age_s) + (" (old)" if old else ""), style="bold yellow" * old)
        state = Text(state_name(s), style="dim" if s.state is None else "")
        deliveries = str(s.deliveries) if s.deliveries else ""
        owner = owner_text(snap, s.owner)
        cells: list[RenderableType] = [
            str(s.slot),
            state,
            str(s.generation),
            owner,
            str(s.tag),
            age,
            deliveries,
        ]
        if snap.traced:
            cells.append(Text(s.site.short if s.site else "-"))
        t.add_row(*cells)
    return t


def holdings_table(snap: TableSnapshot, only_older: float | None) -> Table | Text:
    """Who is holding my slots: owned slots per call site, the oldest age of each."""
    if not snap.traced:
        return Text(
            f"{snap.name} is not traced: create it with trace=True (or SHMSLOTS_TRACE=1 in the "
            "creator's environment) to see the call sites of owners"
        )
    found = slot_holdings(snap.slot_states, only_older)
    if not found:
        return Text("no owned slot has a recorded call site")
    parts = by_index(snap)
    t = _titled(f"slots held per call site ({sum(len(h.slots) for h in found)} slots)")
    for col in ("slots", "oldest", "states", "owners", "call site"):
        t.add_column(col, justify="right" if col in ("slots", "oldest") else "left")
    for h in found:
        owners = Text(", ".join(f"{o}" for o in sorted(h.owners)))
        if any(o in parts and not parts[o].alive for o in h.owners):
            owners.append(" (dead)", style="bold red")
        t.add_row(
            str(len(h.slots)),
            fmt_duration(h.oldest_s),
            state_counts(h.states),
            owners,
            Text(str(h.site)),
        )
    return t


def _fmt_time(seconds: float) -> str:
    """Hold and wait times reach down to microseconds: 3 significant digits in µs or ms."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g}ms"
    return fmt_duration(seconds)


def histogram_text(snap: TableSnapshot) -> str:
    """`held p50 1.2ms p99 40ms (n 1,234)  ready wait p50 ...` since the table was made."""
    out = []
    for name, label in (("held", "held"), ("ready_wait", "ready wait")):
        hist = snap.histograms[name]
        p50, p99 = quantile(hist.counts, 0.5), quantile(hist.counts, 0.99)
        if p50 is None or p99 is None:
            out.append(f"{label} -")
        else:
            out.append(f"{label} p50 {_fmt_time(p50)} p99 {_fmt_time(p99)} (n {hist.count:,})")
    return "  ".join(out)


def by_site_view(
    snap: TableSnapshot,
    only_older: float | None,
    dead: Sequence[SlotSnapshot],
    broken: Sequence[SlotSnapshot] = (),
) -> Group:
    parts: list[RenderableType] = [
        Text(f"{snap.name}: states {state_counts(snap.states)}  (queued {snap.queued})"),
        Text(""),
        holdings_table(snap, only_older),
    ]
    for line in problems(snap, dead, broken):
        parts.append(Text(f"problem: {line}", style="bold red"))
    return Group(*parts)


def inspect_view(
    snap: TableSnapshot,
    older_than: float | None,
    dead: Sequence[SlotSnapshot],
    only_older: float | None = None,
    broken: Sequence[SlotSnapshot] = (),
) -> Group:
    sections: list[RenderableType] = [
        header_table(snap),
        schema_table(snap),
        participants_table(snap),
        Text(f"states: {state_counts(snap.states)}  (queued {snap.queued})"),
        Text(f"times:  {histogram_text(snap)}"),
        counters_table(snap.counters),
        slots_table(snap, older_than, only_older),
    ]
    if snap.traced:
        sections.append(holdings_table(snap, only_older))
    parts: list[RenderableType] = []
    for section in sections:
        parts += [section, Text("")]
    n = sum(1 for s in in_use(snap) if older_than is not None and s.age_s >= older_than)
    if n and older_than is not None:
        parts.append(
            Text(f"{n} slot(s) not FREE for {fmt_duration(older_than)} or longer", style="yellow")
        )
    for line in problems(snap, dead, broken):
        parts.append(Text(f"problem: {line}", style="bold red"))
    return Group(*parts)


# -- one decoded row -------------------------------------------------------------------
def _finite(value: Any) -> Any:
    """JSON has no NaN or infinities: spell them as JavaScript does, as strings."""
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def values_summary(f: Field, flat: Sequence[float]) -> str:
    """A scalar as itself; an array as its first values and its length."""
    if f.shape == ():
        return _num(flat[0])
    first = ", ".join(_num(v) for v in flat[:FIRST_VALUES])
    more = f", ... ({len(flat)} values)" if len(flat) > FIRST_VALUES else ""
    return f"[{first}{more}]"


def nested(flat: Sequence[Any], shape: Sequence[int]) -> Any:
    """Flat values in the nesting of `shape`, as tensor.tolist() gives them."""
    if not shape:
        return flat[0]
    step = len(flat) // shape[0]
    return [nested(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def row_view(snap: TableSnapshot, s: SlotSnapshot, row: DecodedRow) -> Group:
    head = Text(
        f"slot {s.slot} of {snap.name}: {state_name(s)}, generation {s.generation}, "
        f"tag {s.tag}, age {fmt_duration(s.age_s)}, owner "
    )
    head.append_text(owner_text(snap, s.owner))
    if s.state in (State.READY, State.HELD):
        ok = Text("ok", style="green") if row.checksum_ok else Text("bad", style="bold red")
        seal = Text(f"row sealed under generation {row.sealed_generation}, checksum ")
        seal.append_text(ok)
    elif s.state is None:
        seal = Text("row read while the slot changed: run again for a steady read", style="dim")
    else:
        seal = Text("row not published", style="dim")
    t = _titled("fields")
    for col in ("field", "kind", "dtype", "shape", "values"):
        t.add_column(col)
    for f in snap.fields:
        value = (
            ref_summary(row.refs[f.name])
            if f.name in row.refs
            else values_summary(f, row.values[f.name])
        )
        t.add_row(Text(f.name), f.kind, f.dtype, str(f.shape), Text(value))
    return Group(head, seal, t)


def ref_summary(ref: Mapping[str, Any]) -> str:
    """What a ref field's row bytes point to (the tensor itself is not opened)."""
    if "error" in ref:
        return f"no ref: {ref['error']}"
    what = f"{ref['b']} ref, {ref['dtype']} {tuple(ref['shape'])}"
    if ref["b"] == "shm":
        return f"{what} in arena {ref['arena']} at {ref['off']} ({ref['n']} bytes)"
    return f"{what} on GPU {ref.get('uuid')} of pid {ref.get('pid')}"


def _plain(value: Any) -> Any:
    """A ref's msgpack values as JSON values (bytes as hex)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def field_doc(f: Field, row: DecodedRow) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": f.kind, "dtype": f.dtype, "shape": list(f.shape)}
    if f.name in row.refs:
        doc["ref"] = _plain(row.refs[f.name])
    else:
        doc["values"] = _finite(nested(row.values[f.name], f.fixed_shape))
    return doc


def row_doc(snap: TableSnapshot, s: SlotSnapshot, row: DecodedRow) -> dict[str, Any]:
    doc = slot_doc(snap, s, None)
    doc.update(
        json_version=JSON_VERSION,
        table=snap.name,
        sealed_generation=row.sealed_generation,
        checksum_ok=row.checksum_ok,
        fields={f.name: field_doc(f, row) for f in snap.fields},
    )
    return doc


# -- JSON documents --------------------------------------------------------------------
def slot_doc(snap: TableSnapshot, s: SlotSnapshot, older_than: float | None) -> dict[str, Any]:
    p = by_index(snap).get(s.owner)
    return {
        "slot": s.slot,
        "state": s.state.name if s.state is not None else None,
        "generation": s.generation,
        "owner": s.owner,
        "owner_pid": p.pid if p else None,
        "owner_role": p.role if p else None,
        "owner_alive": p.alive if p else (None if s.owner < 0 else False),
        "tag": s.tag,
        "age_s": round(s.age_s, 6),
        "deliveries": s.deliveries,
        "frees_in_s": None if s.frees_in_s is None else round(s.frees_in_s, 6),
        "older": older_than is not None and s.age_s >= older_than,
        "site": site_doc(s.site) if s.site else None,
    }


def site_doc(site: CallSite) -> dict[str, Any]:
    return {"file": site.file, "line": site.line, "function": site.function}


def holdings_doc(snap: TableSnapshot, only_older: float | None) -> list[dict[str, Any]]:
    parts = by_index(snap)
    return [
        {
            "site": site_doc(h.site),
            "count": len(h.slots),
            "slots": sorted(h.slots),
            "oldest_s": round(h.oldest_s, 6),
            "states": dict(sorted(h.states.items())),
            "owners": [
                {
                    "index": o,
                    "pid": parts[o].pid if o in parts else None,
                    "role": parts[o].role if o in parts else None,
                    "alive": parts[o].alive if o in parts else False,
                }
                for o in sorted(h.owners)
            ],
        }
        for h in slot_holdings(snap.slot_states, only_older)
    ]


def histograms_doc(snap: TableSnapshot) -> dict[str, Any]:
    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 9)

    return {
        name: {
            "bounds_s": [ns / 1e9 for ns in HIST_BOUNDS_NS],  # the last bucket: beyond
            "counts": hist.counts,
            "count": hist.count,
            "sum_s": hist.sum_s,
            "p50_s": seconds(quantile(hist.counts, 0.5)),
            "p99_s": seconds(quantile(hist.counts, 0.99)),
        }
        for name, hist in snap.histograms.items()
    }


def table_doc(
    snap: TableSnapshot,
    older_than: float | None,
    dead: Sequence[SlotSnapshot],
    only_older: float | None = None,
    broken: Sequence[SlotSnapshot] = (),
) -> dict[str, Any]:
    now = time.time_ns()
    return {
        "json_version": JSON_VERSION,
        "name": snap.name,
        "header": {
            "version": snap.version,
            "total_size": snap.total_size,
            "slots": snap.slots,
            "row_size": snap.row_size,
            "created_ns": snap.created_ns,
            "created": datetime.fromtimestamp(snap.created_ns / 1e9, UTC).isoformat(),
            "creator_pid": snap.creator_pid,
            "creator_uid": snap.creator_uid,
            "strict": snap.strict,
            "on_consumer_death": snap.on_consumer_death,
            "max_hold_s": snap.max_hold_s,
            "traced": snap.traced,
        },
        "schema": [
            {
                "name": f.name,
                "kind": f.kind,
                "dtype": f.dtype,
                "shape": list(f.shape),
                "nbytes": f.nbytes,
                "item_len": f.item_len,
            }
            for f in snap.fields
        ],
        "participants": [
            {
                "index": p.index,
                "pid": p.pid,
                "role": p.role,
                "name": p.name,
                "alive": p.alive,
                "attach_ns": p.attach_ns,
                "attached_s": round(max(0, now - p.attach_ns) / 1e9, 6),
                "last_seen_ns": p.last_seen_ns,
            }
            for p in snap.participants
        ],
        "states": dict(snap.states),
        "queued": snap.queued,
        "counters": dict(snap.counters),
        "slots": [slot_doc(snap, s, older_than) for s in shown_slots(snap, only_older)],
        "by_site": holdings_doc(snap, only_older),
        "histograms": histograms_doc(snap),
        "older_than_s": older_than,
        "problems": problems(snap, dead, broken),
        "broken_seals": [s.slot for s in broken],
    }


def summary_doc(snap: TableSnapshot, dead: Sequence[SlotSnapshot]) -> dict[str, Any]:
    """One table as `ls --json` lists it."""
    alive = sum(p.alive for p in snap.participants)
    return {
        "name": snap.name,
        "total_size": snap.total_size,
        "slots": snap.slots,
        "states": dict(snap.states),
        "queued": snap.queued,
        "participants_alive": alive,
        "participants_dead": len(snap.participants) - alive,
        "dead_owned_slots": len(dead),
        "creator_pid": snap.creator_pid,
        "creator_uid": snap.creator_uid,
        "created_ns": snap.created_ns,
    }


# -- ls --------------------------------------------------------------------------------
def ls_table(found: Iterable[tuple[TableSnapshot, Sequence[SlotSnapshot]]]) -> Table:
    t = Table(title="shmslots tables", title_justify="left", title_style="bold")
    for col in ("table", "size", "slots", "free", "in use", "queued", "participants", "creator"):
        right = col in ("size", "slots", "free", "queued")
        t.add_column(col, justify="right" if right else "left", no_wrap=col == "table")
    for snap, dead in found:
        busy = {k: v for k, v in snap.states.items() if k != "FREE" and v}
        alive = sum(p.alive for p in snap.participants)
        who = Text(f"{alive} alive")
        if len(snap.participants) > alive:
            who.append(f", {len(snap.participants) - alive} dead", style="bold red" if dead else "")
        t.add_row(
            Text(snap.name),
            fmt_bytes(snap.total_size),
            str(snap.slots),
            str(snap.states["FREE"]),
            state_counts(busy) or "-",
            str(snap.queued),
            who,
            f"pid {snap.creator_pid} uid {snap.creator_uid}",
        )
    return t


# -- watch -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """One refresh of `watch`: the snapshot and per-second rates since the previous one."""

    snap: TableSnapshot
    rates: dict[str, float] | None  # None on the first refresh
    interval: float


def rates(before: Mapping[str, int], after: Mapping[str, int], seconds: float) -> dict[str, float]:
    dt = max(seconds, 1e-9)
    return {
        rate: sum(after[c] - before[c] for c in counters) / dt for rate, counters in RATES.items()
    }


def _oldest_text(snap: TableSnapshot) -> Text:
    s = oldest(snap)
    if s is None:
        changing = snap.states["CHANGING"]
        if changing:
            return Text(f"none steady ({changing} slot(s) changed while read)")
        return Text("none (every slot is FREE)")
    out = Text(f"slot {s.slot} {state_name(s)} for {fmt_duration(s.age_s)}, tag {s.tag}, owner ")
    out.append_text(owner_text(snap, s.owner))
    return out


def _rates_text(r: dict[str, float] | None) -> str:
    if r is None:
        return "(from the next refresh on)"
    return "  ".join(f"{k} {v:,.1f}" for k, v in r.items())


def _who(snap: TableSnapshot) -> str:
    alive = sum(p.alive for p in snap.participants)
    return f"{alive} alive, {len(snap.participants) - alive} dead"


def watch_view(frame: Frame) -> Table:
    snap = frame.snap
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row(
        "table",
        Text(f"{snap.name}  (every {fmt_duration(frame.interval)}, {datetime.now():%H:%M:%S})"),
    )
    grid.add_row("states", f"{state_counts(snap.states)}  (queued {snap.queued})")
    grid.add_row("rates/s", _rates_text(frame.rates))
    grid.add_row("oldest", _oldest_text(snap))
    grid.add_row("times", histogram_text(snap))
    grid.add_row("participants", _who(snap))
    return grid


def watch_text(frame: Frame) -> str:
    snap = frame.snap
    return "\n".join(
        [
            f"[{datetime.now():%H:%M:%S}] {snap.name}: {snap.slots} slots, queued {snap.queued}, "
            f"participants {_who(snap)}",
            f"  states   {state_counts(snap.states)}",
            f"  rates/s  {_rates_text(frame.rates)}",
            f"  oldest   {_oldest_text(snap).plain}",
            f"  times    {histogram_text(snap)}",
        ]
    )
