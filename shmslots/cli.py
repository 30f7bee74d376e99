"""The `shmslots` command line (also `python -m shmslots`).

Commands::

    shmslots ls [--json]                  every table on this machine (found by header magic)
    shmslots inspect NAME [--older-than 5s] [--by-site] [--slot N] [--json]
    shmslots watch NAME [--interval S] [--count N]
    shmslots metrics NAME [NAME ...] [--serve PORT [--bind ADDR]]
                                          Prometheus text, printed or served over HTTP
    shmslots reap NAME                    reclaim the slots of dead participants now
    shmslots unlink NAME [--force]        remove a table; refused while participants live
    shmslots demo [--policy P] [--leak-every N]
                                          transfer -> decode workers, live view

`ls`, `inspect`, `watch` and `metrics` only ever map a table read-only and never
register as a participant (shmslots.snapshot.TableView): looking cannot change a table.
`metrics` prints (or serves) the exposition of shmslots.metrics.TableCollector, the
collector a server registers in its own prometheus_client registry.
No command but `demo` imports torch (this module imports only torch-free ones, and
`reap` attaches through shmslots.reaper), so each starts in about 0.1 s.

Exit codes (also in every `--help`): 0 ok; 1 a problem was found (a slot is owned by a
participant that is no longer alive, a published row fails its checksum, or `unlink` was
refused); 2 the table is missing, incompatible or corrupt, or was unlinked while watched,
or the arguments are wrong.  `ls` flags tables with no live participant (orphaned) but
exits 0 for them: nothing is wrong inside such a table.
Errors are one line on stderr, `shmslots: error: ...`.

JSON (`--json`, keys sorted; `json_version` changes only on incompatible changes):

* `ls --json`: `{"json_version": 2, "tables": [T...], "skipped": [{"name", "reason"}],
  "unfinished": [{"name", "age_s", "gate"}]}` (unfinished: this user's objects whose header
  is still zeros: a table its creator never finished, or not a table)
  with T = `{"name", "total_size", "slots", "states": {STATE: n}, "queued",
  "participants_alive", "participants_dead", "dead_owned_slots", "creator_pid",
  "creator_uid", "created_ns"}`.
* `inspect NAME --json`: `{"json_version": 2, "name",
  "header": {"version", "total_size", "slots", "row_size", "created_ns", "created"
  (ISO 8601, UTC), "creator_pid", "creator_uid", "strict", "on_consumer_death",
  "max_hold_s" (null if unset), "traced"},
  "schema": [{"name", "kind" ("inline" or "ref"), "dtype", "shape": [..], "nbytes",
              "item_len" (its bytes a row in its column: nbytes padded to 64)}],
  "participants": [{"index", "pid", "role", "name", "alive", "attach_ns", "attached_s",
  "last_seen_ns"}],
  "states": {"FREE": n, ..., "CHANGING": n}, "queued", "counters": {COUNTER: n},
  "slots": [S...] (every slot that is not FREE; with --older-than, only those that old),
  "by_site": [{"site": SITE, "count", "slots": [..], "oldest_s", "states": {STATE: n},
  "owners": [{"index", "pid", "role", "alive"}]}...] (traced tables; most slots first),
  "histograms": {"held" | "ready_wait": {"bounds_s": [..] (upper bounds; the last count is
  beyond them), "counts": [..], "count" (their total), "sum_s" (of the times observed),
  "p50_s", "p99_s" (null when empty)}},
  "older_than_s" (null if not given), "problems": [str...], "broken_seals": [slot...]
  (queued rows that do not match their seal)}`
  with S = `{"slot", "state" (null: changing while read), "generation", "owner"
  (participant index, -1 for nobody), "owner_pid", "owner_role", "owner_alive" (null when
  nobody owns it), "tag", "age_s", "deliveries" (times this publication was taken),
  "frees_in_s" (QUARANTINED only, else null, and null until its owner has stored it:
  seconds until its late-write window ends, negative once it has; the next claim that finds
  no FREE slot, or `reap`, frees it), "older",
  "site" (SITE = {"file", "line", "function"}: the code that made the owner, first frame
  outside shmslots; null when not traced, ownerless or not recorded)}`.
* `inspect NAME --slot N --json`: S plus `"json_version", "table", "sealed_generation",
  "checksum_ok" (both read from the row as it is: they mean something only while the slot is
  READY or HELD), "fields": {FIELD: {"kind", "dtype", "shape", and "values" (nested lists;
  inline fields) or "ref" (what the row points to, bytes as hex; ref fields)}}`.
  NaN and infinities are written as the strings "NaN", "Infinity", "-Infinity".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import posix_ipc
from rich.console import Console
from rich.live import Live
from rich.text import Text

from . import cli_render as R
from . import orphans
from .errors import (
    IncompatibleTable,
    ShmSlotsError,
    TableNotFound,
    TablePermissionError,
)
from .layout import HEADER_SIZE, MAX_SLOTS
from .participants import gate_holder
from .reaper import Reaper
from .segment import SHM_DIR, open_shm_file, unlink, validate_name
from .snapshot import SlotSnapshot, TableSnapshot, TableView
from .states import State

REAP_REASONS = {
    "reclaimed_writing": "WRITING slots returned to FREE",
    "reclaimed_reserved": "RESERVED slots returned to FREE",
    "reclaimed_held_dropped": "HELD slots dropped to FREE (on_consumer_death=drop)",
    "redelivered": "HELD slots queued again as READY",
    "participants_reaped": "dead participants removed from the registry",
    "quarantines_ended": "QUARANTINED slots returned to FREE (window ended, or owner dead)",
}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# -- shared helpers --------------------------------------------------------------------
def _console() -> Console:
    """Colours only on a terminal; when piped, a wide page so that tables do not wrap."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160)
    return console


def _look(name: str) -> tuple[TableSnapshot, list[SlotSnapshot]]:
    with TableView.open(name) as view:
        snap = view.snapshot()
        return snap, view.dead_owned(snap)


def _print_json(doc: dict[str, Any]) -> None:
    print(json.dumps(doc, sort_keys=True, indent=2))


# -- commands --------------------------------------------------------------------------
def _scan() -> tuple[list[str], list[dict[str, Any]], int]:
    """Names in /dev/shm whose first bytes are the table magic; this user's objects with no
    header yet (a table its creator never finished, or not a table); how many were
    unreadable."""
    names, unfinished, unreadable = [], [], 0
    for entry in sorted(os.scandir(SHM_DIR), key=lambda e: e.name):
        with contextlib.suppress(ValueError):
            if validate_name(entry.name) and entry.is_file(follow_symlinks=False):
                magic = orphans.has_magic(entry.name)
                unreadable += magic is None
                if magic:
                    names.append(entry.name)
                elif magic is False:
                    found = _unfinished(entry.name)
                    if found is not None:
                        unfinished.append(found)
    return names, unfinished, unreadable


def _unfinished(name: str) -> dict[str, Any] | None:
    """{"name", "age_s", "gate"} for this user's object whose header is still all zeros (the
    magic is written last), or None."""
    try:
        fd = open_shm_file(name, os.O_RDONLY)
    except (ShmSlotsError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < HEADER_SIZE:
            return None
        if any(os.pread(fd, HEADER_SIZE, 0)):
            return None
        return {"name": name, "age_s": round(time.time() - st.st_mtime, 3), "gate": gate_holder(fd)}
    finally:
        os.close(fd)


def _ls(args: argparse.Namespace) -> int:
    found: list[tuple[TableSnapshot, list[SlotSnapshot]]] = []
    skipped: list[tuple[str, str]] = []
    names, unfinished, unreadable = _scan()
    for name in names:
        try:
            found.append(_look(name))
        except TableNotFound:
            continue  # unlinked since the scan
        except ShmSlotsError as exc:
            skipped.append((name, str(exc)))
    if args.json:
        _print_json(
            {
                "json_version": R.JSON_VERSION,
                "tables": [R.summary_doc(snap, dead) for snap, dead in found],
                "skipped": [{"name": n, "reason": why} for n, why in skipped],
                "unfinished": unfinished,
            }
        )
    else:
        console = _console()
        console.print(R.ls_table(found) if found else f"no shmslots tables in {SHM_DIR}")
        for snap, dead in found:
            if dead:
                line = (
                    f"{len(dead)} slot(s) owned by dead participants; `shmslots reap {snap.name}`"
                )
                console.print(Text(f"problem: {snap.name}: {line}"), soft_wrap=True)
            if not any(p.alive for p in snap.participants):
                line = (
                    "no live participant: nothing uses or removes it (closed without unlink, "
                    f"or its processes died); `shmslots unlink {snap.name}` removes it"
                )
                console.print(Text(f"orphaned: {snap.name}: {line}"), soft_wrap=True)
    if not args.json:
        for u in unfinished:
            line = (
                f"no header after {u['age_s']:.1f} s: a table its creator never finished (or "
                f"died making), or not a table; gate held by {u['gate']}; "
                f"`shmslots unlink --force {u['name']}` removes it"
            )
            console.print(Text(f"unfinished: {u['name']}: {line}"), soft_wrap=True)
    for n, why in skipped:
        print(f"shmslots: note: skipped {n}: {why}", file=sys.stderr)
    if unreadable:
        note = f"{unreadable} object(s) in {SHM_DIR} are not readable by this user"
        print(f"shmslots: note: {note}", file=sys.stderr)
    return 1 if any(dead for _, dead in found) else 0


def _inspect(args: argparse.Namespace) -> int:
    with TableView.open(args.name) as view:
        if args.slot is not None:
            return _inspect_slot(view, args.slot, args.json)
        snap = view.snapshot()
        dead = view.dead_owned(snap)
        broken = view.broken_seals(snap)
    older_than = args.older_than if args.older_than is not None else snap.max_hold_s
    if args.json:
        _print_json(R.table_doc(snap, older_than, dead, args.older_than, broken))
    elif args.by_site:
        _console().print(R.by_site_view(snap, args.older_than, dead, broken))
    else:
        _console().print(R.inspect_view(snap, older_than, dead, args.older_than, broken))
    return 1 if dead or broken else 0


def _inspect_slot(view: TableView, n: int, as_json: bool) -> int:
    before = view.slot(n)  # InvalidSlot when n is out of range
    row = view.row(n)
    after = view.slot(n)
    steady = (before.state, before.generation) == (after.state, after.generation)
    s = after if steady else SlotSnapshot(n, None, after.generation, after.owner, after.tag, 0, 0)
    snap = view.snapshot()
    if as_json:
        _print_json(R.row_doc(snap, s, row))
    else:
        _console().print(R.row_view(snap, s, row))
    published = s.state in (State.READY, State.HELD)
    intact = row.checksum_ok and row.sealed_generation == s.generation
    return 1 if published and not intact else 0


def _frames(view: TableView, interval: float, count: int | None) -> Iterator[R.Frame]:
    previous: tuple[dict[str, int], float] | None = None
    shown = 0
    while count is None or shown < count:
        if shown:
            time.sleep(interval)
        if view.unlinked():
            raise TableNotFound(f"table {view.name!r} was unlinked while watched")
        snap = view.snapshot()
        now = time.monotonic()
        rates = R.rates(previous[0], snap.counters, now - previous[1]) if previous else None
        yield R.Frame(snap, rates, interval)
        previous = (snap.counters, now)
        shown += 1


def _watch(args: argparse.Namespace) -> int:
    console = _console()
    last: R.Frame | None = None
    with TableView.open(args.name) as view:
        frames = _frames(view, args.interval, args.count)
        try:
            if console.is_terminal:
                with Live(console=console, auto_refresh=False) as live:
                    for last in frames:
                        live.update(R.watch_view(last), refresh=True)
            else:
                for last in frames:
                    print(R.watch_text(last), flush=True)
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a watch without --count ends
        dead = view.dead_owned(last.snap) if last is not None else []
    for line in R.problems(last.snap, dead) if last is not None else []:
        print(f"problem: {line}", file=sys.stderr)
    return 1 if dead else 0


def _metrics(args: argparse.Namespace) -> int:
    from prometheus_client import generate_latest  # only this command pays for the import

    from .metrics import registry_for

    # a missing table is an error here, not a silent scrape error
    looks = [_look(name) for name in args.names]
    registry = registry_for(*args.names)
    if args.serve is not None:  # a service: its exit says it stopped cleanly
        return _serve(registry, args.bind, args.serve)
    sys.stdout.write(generate_latest(registry).decode())
    return 1 if any(dead for _, dead in looks) else 0


def _serve(registry: Any, bind: str, port: int) -> int:
    """Serve /metrics until SIGINT or SIGTERM, then stop the server and return 0."""
    from prometheus_client import start_http_server

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server, thread = start_http_server(port, addr=bind, registry=registry)
    try:
        bound = server.server_address[1]
        print(f"serving metrics on http://{bind}:{bound}/metrics (Ctrl-C stops)", flush=True)
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    return 0


def _reap(args: argparse.Namespace) -> int:
    before, _ = _look(args.name)
    with Reaper.open(args.name) as reaper:  # attaching reaps already
        reaped = reaper.reap()
        counters = reaper.counters()
    after, dead = _look(args.name)
    done = {k: counters[k] - before.counters[k] for k in REAP_REASONS}
    # live owners end their own quarantines meanwhile: only what this reap ended
    done["quarantines_ended"] = reaped.get("quarantines_ended", 0)
    still_dead = {(p.index, p.pid, p.start_ticks) for p in after.participants if not p.alive}
    gone = [
        p
        for p in before.participants
        if not p.alive and (p.index, p.pid, p.start_ticks) not in still_dead
    ]
    console = _console()
    if not any(done.values()):
        console.print(Text(f"{args.name}: nothing to reap (no dead participants)"))
    else:
        console.print(Text(f"reaped {args.name}:"))
        for p in gone:
            console.print(Text(f"  participant {p.index}: pid {p.pid} {p.role} ({p.name})"))
        for reason, n in done.items():
            if n:
                console.print(Text(f"  {reason:<24} {n:>6}  {REAP_REASONS[reason]}"))
    for line in R.problems(after, dead):
        console.print(Text(f"problem: {line}"))
    return 1 if dead else 0


def _unlink(args: argparse.Namespace) -> int:
    try:
        with TableView.open(args.name) as view:
            alive = [p for p in view.snapshot().participants if p.alive]
    except TablePermissionError:
        raise
    except IncompatibleTable as exc:
        if not (args.force and orphans.force_removes(args.name, exc)):
            raise
        alive = []
    if alive and not args.force:
        who = ", ".join(f"pid {p.pid} {p.role}" for p in alive[:3])
        more = f" and {len(alive) - 3} more" if len(alive) > 3 else ""
        print(
            f"shmslots: refusing to unlink {args.name}: {len(alive)} live participant(s) "
            f"({who}{more}); stop them first or use --force",
            file=sys.stderr,
        )
        return 1
    unlink(args.name)
    kept = f" ({len(alive)} live participant(s) keep their mapping until they close)"
    print(f"unlinked {args.name}{kept if alive else ''}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from shmslots.workers import demo  # the library itself never imports workers

    code: int = demo.run(
        requests=args.requests,
        transfer=args.transfer,
        decode=args.decode,
        slots=args.slots,
        policy=args.policy,
        hidden=args.hidden,
        burst=args.burst,
        leak_every=args.leak_every or 0,
    )
    return code


# -- arguments -------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"shmslots: error: {message} (see `{self.prog} --help`)\n")


def _table_name(text: str) -> str:
    try:
        return validate_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str) -> float:
    """`500ms`, `5s`, `2m`, `1h` or plain seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (use e.g. 500ms, 5s, 2m)")
    return float(match[1]) * _UNIT_S[match[2] or "s"]


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return int(text)


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


_MISSING = "2  the table is missing, not a valid table, or the arguments are wrong"
# What each command's exit code means: its own verdict, in its own --help.
EXIT_CODES = {
    "ls": "0  listed (orphaned tables are flagged, not failures)\n"
    "1  a table has slots owned by a participant that is no longer alive\n"
    "2  the arguments are wrong",
    "inspect": "0  nothing wrong\n"
    "1  a dead participant owns slots, or a queued row fails its checksum (both named);\n"
    "   with --slot N: row N is published and fails its checksum\n" + _MISSING,
    "watch": "0  stopped (Ctrl-C or --count) and the last refresh found nothing wrong\n"
    "1  the last refresh found slots owned by a dead participant\n"
    "2  the table is missing, not a valid table, or was unlinked while watched;\n"
    "   or the arguments are wrong",
    "metrics": "0  printed, and no named table has dead-owned slots; or, with --serve,\n"
    "   served until stopped\n"
    "1  a named table has slots owned by a dead participant (the metrics say which)\n" + _MISSING,
    "reap": "0  nothing left owned by the dead\n"
    "1  slots owned by a dead participant remain after the reap\n" + _MISSING,
    "unlink": "0  unlinked\n1  refused: participants are alive (--force removes it anyway)\n"
    + _MISSING,
    "demo": "0  every request accounted for, no slot left owned, no corrupted row\n"
    "1  rows were corrupted (the early-release policy shows how), or requests or\n"
    "   slots went unaccounted for\n2  the arguments are wrong",
}
NAME_HELP = "the table's name: its file in /dev/shm (`shmslots ls` lists them)"


def _command(
    sub: Any, name: str, summary: str, description: str, run: Any
) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does and what its exit codes mean."""
    codes = "\n".join(f"  {line}" for line in EXIT_CODES[name].splitlines())
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=f"exit codes:\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shmslots",
        description="shmslots tables: look, watch, repair; and a demo of the flow they serve.",
        epilog="exit codes: 0 fine, 1 a problem was found, 2 the table is missing or not valid, "
        "or the arguments are wrong; `shmslots COMMAND --help` says what each means for it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ls = _command(
        sub,
        "ls",
        "list every shmslots table on this machine",
        "List the tables in /dev/shm (found by their header magic, whatever their name) with "
        "their size, slot states and participants. A table no live process is attached to is "
        "flagged: nothing will use or remove it (a creator that called close() without "
        "unlink(), or died); `shmslots unlink NAME` removes it.",
        _ls,
    )
    ls.add_argument("--json", action="store_true", help="machine-readable output")

    inspect = _command(
        sub,
        "inspect",
        "header, schema, participants and slots of a table",
        "Show a table's header, schema, participants (alive or dead), slot states, counters "
        "and every slot that is not FREE; or, with --slot, decode one row. The table is mapped "
        "read-only and never registered with: inspecting cannot change it.",
        _inspect,
    )
    inspect.add_argument("name", type=_table_name, help=NAME_HELP)
    inspect.add_argument(
        "--older-than",
        type=_duration,
        metavar="AGE",
        help="show only slots this old (500ms, 5s, 2m), highlighted; without it every slot "
        "is shown and those older than the table's max_hold_s are highlighted",
    )
    inspect.add_argument(
        "--by-site",
        action="store_true",
        help="who is holding the slots: owned slots per call site, oldest age of each "
        "(tables made with trace=True)",
    )
    inspect.add_argument("--slot", type=int, metavar="N", help="decode the row of slot N")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")

    watch = _command(
        sub,
        "watch",
        "live states, rates and the oldest slot",
        "Refresh a table's slot states, per-second rates and its oldest slot until Ctrl-C "
        "(or --count refreshes); plain lines when the output is not a terminal. Ends with "
        "exit code 2 if the table is unlinked meanwhile.",
        _watch,
    )
    watch.add_argument("name", type=_table_name, help=NAME_HELP)
    watch.add_argument(
        "--interval",
        type=_positive(float),
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default: %(default)g)",
    )
    watch.add_argument(
        "--count", type=_positive(int), metavar="N", help="stop after N refreshes (default: never)"
    )

    metrics = _command(
        sub,
        "metrics",
        "counters, gauges and histograms in Prometheus text format",
        "Print the named tables' counters, gauges per state, dead-owned slots, oldest age, "
        "slots per call site and HELD / READY-wait histograms in Prometheus text format, or "
        "serve them over HTTP with --serve for a sidecar scrape. The same figures come from "
        "shmslots.metrics.TableCollector, for a server's own prometheus_client registry.",
        _metrics,
    )
    metrics.add_argument("names", nargs="+", type=_table_name, metavar="NAME", help=NAME_HELP)
    metrics.add_argument(
        "--serve",
        type=_port,
        metavar="PORT",
        help="serve http://BIND:PORT/metrics until Ctrl-C or SIGTERM (0: any free port, "
        "printed on the first line)",
    )
    metrics.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="ADDR",
        help="address to serve on (default: %(default)s, this machine only)",
    )

    reap = _command(
        sub,
        "reap",
        "reclaim the slots of dead participants now",
        "Attach briefly and hand back what dead participants owned: WRITING and RESERVED "
        "slots become FREE, HELD ones READY again (or FREE with on_consumer_death=drop). "
        "Every attach does this too; reap does it now.",
        _reap,
    )
    reap.add_argument("name", type=_table_name, help=NAME_HELP)

    rm = _command(
        sub,
        "unlink",
        "remove a table (refused while participants live)",
        "Remove a table's name from /dev/shm. Processes still attached keep their mapping "
        "until they close; the memory is freed then.",
        _unlink,
    )
    rm.add_argument("name", type=_table_name, help=NAME_HELP)
    rm.add_argument("--force", action="store_true", help="remove even with live participants")

    demo = _command(
        sub,
        "demo",
        "transfer -> decode workers moving EAGLE metadata rows, live",
        "Run transfer workers that commit per-request EAGLE metadata rows and decode workers "
        "that consume them later, on one table, with a live view and a summary. --policy says "
        "when decode hands a slot back: hold (after consumption: correct, no copy), clone "
        "(copy at commit: correct, one copy per row) or early-release (at commit while views "
        "are kept: the production bug, which shmslots catches). --leak-every N injects the "
        "other classic bug: decode cancels 1 in N requests through an abort path that forgets "
        "the release, on a traced table, until a transfer claim raises SlotsExhausted naming "
        "the call site that holds the slots.",
        _demo,
    )
    count = _positive(int)
    demo.add_argument(
        "--requests", type=count, default=20_000, help="requests to transfer (default: %(default)s)"
    )
    demo.add_argument(
        "--transfer", type=count, default=2, help="transfer workers (default: %(default)s)"
    )
    demo.add_argument(
        "--decode", type=count, default=2, help="decode workers (default: %(default)s)"
    )
    demo.add_argument(
        "--slots", type=count, default=64, help="rows in the table (default: %(default)s)"
    )
    demo.add_argument(
        "--policy",
        choices=("hold", "clone", "early-release"),
        default="hold",
        help="when decode hands a slot back (default: %(default)s)",
    )
    demo.add_argument(
        "--hidden", type=count, default=4096, help="hidden-state size, bf16 (default: %(default)s)"
    )
    demo.add_argument(
        "--burst",
        type=count,
        default=32,
        help="back-to-back commits per burst (default: %(default)s)",
    )
    demo.add_argument(
        "--leak-every",
        type=count,
        metavar="N",
        help="decode never releases 1 in N requests it takes (default: no leak)",
    )
    return parser


def _error(args: argparse.Namespace, exc: BaseException) -> int:
    message = " ".join(str(exc).split())
    name = getattr(args, "name", None)
    if name and name not in message:
        message = f"{name}: {message}"
    print(f"shmslots: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.requests < args.transfer:
            parser.error(
                f"--requests {args.requests} gives no request to some of the "
                f"{args.transfer} transfer workers"
            )
        if args.slots > MAX_SLOTS:
            parser.error(f"--slots must be at most {MAX_SLOTS}, got {args.slots}")
    try:
        code: int = args.run(args)
    except BrokenPipeError:  # `shmslots ls | head -1`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ShmSlotsError, OSError, posix_ipc.Error) as exc:
        return _error(args, exc)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
