"""The owner side of remote writing: grant rows, publish commits, feed the decode worker.

The owner process holds the table and a `RemoteServer`; a decode worker
(the same one the local flow uses) consumes from the table; a remote writer
process — on loopback, or in another network namespace — fills the rows
through a transfer engine (Mooncake or NIXL).  Grants leave the owner through one
function, `deliver`; here it sends them on the small framed link of
`shmslots.remote.bootstrap`, and a server plugs in its own channel there.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

from shmslots import SlotsExhausted, SlotTable, Stats
from shmslots.remote import (
    ENGINES,
    Grant,
    GrantLink,
    GrantListener,
    RemoteServer,
    RemoteStats,
    Settled,
    open_engine,
)

from . import eagle
from .decode import DecodeConfig, DecodeReport, decode_worker
from .launcher import SPAWN, drain
from .netns import veth_namespace
from .remote_writer import TOKEN_ENV

START_S = 60.0  # a writer process imports torch and starts an engine


@dataclass(frozen=True)
class RemoteFlowConfig:
    requests: int = 2300  # ~5 % end aborted, expired or dropped by decode: > 2,000 verified
    slots: int = 64
    batch: int = 16  # grants per link message, rows per engine call
    window: int = 48  # grants outstanding at most
    abort_fraction: float = 0.03  # cancelled right after the grant left: its write comes late
    never_commit_every: int = 0  # writer fault: every Nth row written, never committed
    commit_timeout_s: float = 2.0
    # slots of aborted and expired grants are held back this long (the writer here writes
    # each grant within milliseconds of receiving it; 64 slots cannot spare seconds' worth)
    late_write_window_s: float = 1.0
    decode_abort: float = 0.02
    shape: eagle.RowShape = field(default_factory=eagle.RowShape)
    engine: str = "mooncake"  # one of shmslots.remote.ENGINES, on both sides
    owner_host: str = "127.0.0.1"
    writer_host: str = "127.0.0.1"
    writer_prefix: tuple[str, ...] = ()  # e.g. ("ip", "netns", "exec", "ns")
    timeout_s: float = 120.0
    seed: int = 0


@dataclass
class RemoteFlowResult:
    remote: RemoteStats
    settled: Settled  # published, rejected, expired tags
    aborted: list[int]  # by the owner
    uncommitted: list[int]  # what the writer wrote and never committed
    decode: DecodeReport
    final: Stats
    consistency: list[str]
    seconds: float


def run_remote_flow(config: RemoteFlowConfig, name: str | None = None) -> RemoteFlowResult:
    """Move `config.requests` rows from a remote writer through the table to a decode worker."""
    name = name or f"shmslots-remote-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"
    return _run(config, name)


@dataclass
class WriterProcess:
    link: GrantLink  # grants go out on it
    process: subprocess.Popen[bytes]


@contextmanager
def remote_writer(
    server: RemoteServer,
    *,
    owner_host: str = "127.0.0.1",
    writer_host: str = "127.0.0.1",
    prefix: tuple[str, ...] = (),
    options: tuple[str, ...] = (),
) -> Iterator[WriterProcess]:
    """Start a remote writer process and bootstrap it: link, token, schema, the server's
    engine and its contact; the writer's engine up and connected.

    Yields the link grants travel on and the process; on exit the link is closed and the
    process reaped (killed if it has not exited).
    """
    listener = GrantListener(owner_host)
    writer = subprocess.Popen(
        [*prefix, sys.executable, "-m", "shmslots.workers.remote_writer",
         "--connect", listener.address, "--host", writer_host, *options],
        env={**os.environ, TOKEN_ENV: listener.token},
    )  # fmt: skip
    link: GrantLink | None = None
    try:
        link = listener.accept(timeout=START_S)
        link.send(
            {
                "schema": server.table.schema.encode(),
                "engine": server.engine.kind,
                "contact": server.contact(),
            }
        )
        link.recv(START_S)  # ready: its engine is up
        yield WriterProcess(link, writer)
    finally:
        listener.close()
        if link is not None:
            link.close()
        try:
            writer.wait(10)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait(10)


def _run(config: RemoteFlowConfig, name: str) -> RemoteFlowResult:
    results: mp.Queue[DecodeReport] = SPAWN.Queue()
    stop = SPAWN.Event()
    dconf = DecodeConfig("hold", config.shape, abort_fraction=config.decode_abort, seed=config.seed)
    started = time.monotonic()
    options = ("--batch", str(config.batch), "--never-commit-every", str(config.never_commit_every))
    with SlotTable.create(name, config.shape.fields(), slots=config.slots) as table:
        consumer = SPAWN.Process(target=decode_worker, args=(name, 0, dconf, results, stop))
        try:
            consumer.start()
            with (
                open_engine(config.engine, config.owner_host) as engine,
                RemoteServer(
                    table,
                    engine,
                    commit_timeout_s=config.commit_timeout_s,
                    late_write_window_s=config.late_write_window_s,
                ) as server,
                remote_writer(
                    server,
                    owner_host=config.owner_host,
                    writer_host=config.writer_host,
                    prefix=config.writer_prefix,
                    options=options,
                ) as writer,
            ):
                link = writer.link

                def deliver(grants: Sequence[Grant]) -> None:
                    """The bootstrap: the one place grants leave the owner."""
                    link.send({"grants": [g.encode() for g in grants]})

                settled, aborted = _grant_all(config, server, deliver, started)
                link.send({"stop": True})
                uncommitted: list[int] = link.recv(START_S)["uncommitted"]
                # late commits of aborted grants may still be on the wire: let them land
                late_due = len(set(aborted) - set(uncommitted))
                settle = time.monotonic() + 5.0
                while server.stats.late < late_due and time.monotonic() < settle:
                    settled.extend(server.poll())
                    time.sleep(0.01)
                remote = server.stats
            stop.set()
            decode = DecodeReport(worker=0, final=False)
            while not decode.final:
                _check_deadline(started, config.timeout_s)
                _fold(results, decode)
            consumer.join(30)
        finally:
            stop.set()
            if consumer.is_alive():
                consumer.kill()
            consumer.join(5)
        return RemoteFlowResult(
            remote,
            settled,
            aborted,
            uncommitted,
            decode,
            table.stats(),
            table.check_consistency(),
            time.monotonic() - started,
        )


def _grant_all(
    config: RemoteFlowConfig,
    server: RemoteServer,
    deliver: Callable[[Sequence[Grant]], None],
    started: float,
) -> tuple[Settled, list[int]]:
    """Grant every request, `window` at a time; cancel some right after their grant left."""
    rng = random.Random(config.seed)
    settled, aborted = Settled(), []
    left = config.requests
    while left or server.pending:
        _check_deadline(started, config.timeout_s)
        grants = grant_batch(server, config.requests - left + 1, left, config.window, config.batch)
        left -= len(grants)
        if grants:
            deliver(grants)
        for grant in grants:
            if rng.random() < config.abort_fraction and server.abort(grant):
                aborted.append(grant.tag)
        settled.extend(server.poll())
    return settled, aborted


def grant_batch(
    server: RemoteServer, first_tag: int, left: int, window: int, batch: int
) -> list[Grant]:
    """Grants for tags first_tag, first_tag + 1, ...: at most `batch` and `left`, while fewer
    than `window` are pending and a slot is free (the consumer, or the server's quarantine,
    may hold them all)."""
    grants: list[Grant] = []
    while len(grants) < min(batch, left) and server.pending < window:
        try:
            grants.append(server.grant(first_tag + len(grants), timeout=0.0))
        except SlotsExhausted:
            break
    return grants


def _fold(results: mp.Queue[DecodeReport], into: DecodeReport) -> None:
    """Add decode reports to `into` (the final one sets `into.final`)."""
    for report in drain(results):
        into.verified += report.verified
        into.corrupted += report.corrupted
        into.consumed += report.consumed
        into.aborted += report.aborted
        into.final = into.final or report.final


def _check_deadline(started: float, timeout_s: float) -> None:
    if time.monotonic() - started > timeout_s:
        raise TimeoutError(f"remote flow did not finish in {timeout_s} s")


@contextmanager
def native_stderr_to(path: str) -> Iterator[None]:
    """Send what native code writes to stderr to `path`, here and in the processes started
    meanwhile; Python's own messages still reach the terminal.

    The Mooncake engine logs through glog straight to file descriptor 2 (before
    InitGoogleLogging, so GLOG_* settings do not reach it): about ten lines per engine.
    """
    sys.stderr.flush()
    terminal = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    python_stderr = sys.stderr
    sys.stderr = open(terminal, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.dup2(log, 2)
    os.close(log)
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        os.dup2(terminal, 2)
        os.close(terminal)
        sys.stderr = python_stderr


def main(argv: list[str] | None = None) -> int:
    """`python -m shmslots.workers.remote_flow [--requests N] [--netns] [--engine-log PATH]`:
    run the flow, print its fates."""
    default_log = os.path.join(tempfile.gettempdir(), "shmslots-remote-flow-engine.log")
    parser = argparse.ArgumentParser(
        prog="python -m shmslots.workers.remote_flow", description=__doc__
    )
    parser.add_argument("--requests", type=int, default=RemoteFlowConfig.requests)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--engine", choices=ENGINES, default=RemoteFlowConfig.engine)
    parser.add_argument("--netns", action="store_true", help="writer in its own network namespace")
    parser.add_argument(
        "--engine-log",
        default=default_log,
        metavar="PATH",
        help="file for the engines' own log, theirs and the writer's; '-' leaves it "
        "on stderr (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    config = RemoteFlowConfig(
        requests=args.requests, batch=args.batch, never_commit_every=97, engine=args.engine
    )
    with ExitStack() as stack:
        if args.engine_log != "-":
            stack.enter_context(native_stderr_to(args.engine_log))
        if args.netns:
            ns = stack.enter_context(veth_namespace())
            config = replace(
                config,
                owner_host=ns.outside_ip,
                writer_host=ns.inside_ip,
                writer_prefix=ns.prefix,
            )
        result = run_remote_flow(config)
    s, d = result.settled, result.decode
    print(f"granted {result.remote.granted} rows in {result.seconds:.1f} s")
    print(
        f"published {len(s.published)}, aborted by the owner {len(result.aborted)} "
        f"(late writes discarded: {result.remote.late}), expired {len(s.expired)} "
        f"(writer never committed {len(result.uncommitted)}), rejected {len(s.rejected)}; "
        f"slots held back for late writes {result.remote.quarantined}"
    )
    print(
        f"decode: verified {d.verified}, corrupted {d.corrupted}, aborted {len(d.aborted)}; "
        f"slots still owned {result.final.owned}"
    )
    if args.engine_log != "-":
        print(f"the engines' own log: {args.engine_log}")
    ok = d.corrupted == 0 and result.final.owned == 0 and not result.consistency
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
