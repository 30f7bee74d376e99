"""The measurements of tools/bench.py and the run that writes its report.

Imported by tools/bench.py once its arguments are parsed and the bench extras found;
not run on its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from . import cli, iceoryx, peers, shm
from .common import (
    CTX,
    KINDS,
    SMALL,
    TENSOR_1M,
    TENSOR_64M,
    Kind,
    Spread,
    get_result,
    pin_plan,
    pinned,
    results_queue,
    spawned_all,
    spread,
    unique_name,
)
from .session import (
    BY_NAME,
    SHM_BATCH,
    SHM_BLOCK,
    SHM_BUSY,
    SHM_COPYING,
    SHM_LOAN,
    TRANSPORTS,
    Plan,
    Session,
    run_session,
)


@dataclass(frozen=True)
class Config:
    """How long each measurement runs; `plans` gives the two-process sessions per record."""

    mode: str
    plans: dict[str, Plan]
    one_process_ops: int
    repeats: int
    contend_s: float
    idle_s: float
    rss_rows: int
    rss_every: int
    cli_runs: int
    sglang_requests: int


def row_plan(trips: int, budget_s: float) -> Plan:
    return Plan(
        warmup=trips // 10,
        trips=trips,
        rtt_repeats=3,
        rtt_budget_s=budget_s,
        stream_rows=1_000_000,
        stream_repeats=3,
        stream_budget_s=budget_s,
    )


def tensor_plan(kind: Kind, budget_s: float) -> Plan:
    """Few trips: one 64 MiB round trip over a Queue takes about 0.2 s."""
    warmup = 2 if kind == TENSOR_64M else 10
    return replace(row_plan(1000, budget_s), warmup=warmup, stream_rows=10_000, check_every=1)


FULL = Config(
    mode="full",
    plans={
        "small": row_plan(5000, 0.6),
        "eagle": row_plan(5000, 0.6),
        TENSOR_1M.name: tensor_plan(TENSOR_1M, 0.6),
        TENSOR_64M.name: tensor_plan(TENSOR_64M, 0.6),
    },
    one_process_ops=20_000,
    repeats=3,
    contend_s=1.0,
    idle_s=2.0,
    rss_rows=1_000_000,
    rss_every=100_000,
    cli_runs=7,
    sglang_requests=20_000,
)
QUICK = Config(
    mode="quick",
    plans={
        "small": row_plan(1000, 0.1),
        "eagle": row_plan(1000, 0.1),
        TENSOR_1M.name: tensor_plan(TENSOR_1M, 0.1),
        TENSOR_64M.name: tensor_plan(TENSOR_64M, 0.1),
    },
    one_process_ops=5_000,
    repeats=3,
    contend_s=0.3,
    idle_s=0.5,
    rss_rows=100_000,
    rss_every=10_000,
    cli_runs=3,
    sglang_requests=5_000,
)


# -- measurements -----------------------------------------------------------------------------


def measure_sessions(cfg: Config, pins: tuple[int, int] | None) -> list[Session]:
    """Every transport with every record kind it carries, one pair of processes each."""
    sessions = []
    for kind in KINDS:
        for transport in TRANSPORTS:
            if kind in transport.kinds:
                session = run_session(transport, kind, cfg.plans[kind.name], pins)
                print(f"  {transport.name} / {kind.name}: {session.seconds:.1f} s", flush=True)
                sessions.append(session)
    return sessions


def measure_one_process(cfg: Config, pins: tuple[int, int] | None) -> dict[str, Spread]:
    """claim+abort and the full local cycle, in this process pinned to A's CPU."""
    with pinned(pins[0] if pins else None):
        runs = shm.bench_one_process(cfg.one_process_ops, cfg.repeats)
    return {name: spread(values) for name, values in runs.items()}


def measure_gather(cfg: Config, pins: tuple[int, int] | None) -> dict[str, Spread]:
    """µs per batch: gather of 64 EAGLE hidden states against cat and stack of clones."""
    with pinned(pins[0] if pins else None):
        runs = shm.bench_gather(cfg.one_process_ops // 20, cfg.repeats)
    return {name: spread(values) for name, values in runs.items()}


def claims_per_second(cfg: Config, cpus: list[int | None]) -> Spread:
    """Total claims/s of one spawned contender per entry in `cpus`, all on one table."""
    barrier = CTX.Barrier(len(cpus))
    with (
        shm.created_table(unique_name("contend"), SMALL) as table,
        results_queue() as out,
        spawned_all(
            [
                (
                    shm.contend_main,
                    (table.name, cpu, cfg.contend_s, cfg.repeats, barrier, out),
                )
                for cpu in cpus
            ]
        ) as procs,
    ):
        per_child: list[list[float]] = [get_result(out, procs) for _ in cpus]
    return spread([sum(rates) for rates in zip(*per_child, strict=True)])


def measure_contention(cfg: Config, pins: tuple[int, int] | None) -> dict[str, Spread]:
    pair: list[int | None] = list(pins) if pins else [None, None]
    return {
        "1 process": claims_per_second(cfg, pair[:1]),
        "2 processes": claims_per_second(cfg, pair),
    }


def measure_idle_cpu(cfg: Config) -> dict[str, Spread]:
    """% of a core used by readers blocked with nothing to read; the three run side by side."""
    with (
        shm.created_table(unique_name("idle"), SMALL) as table,
        iceoryx.scratch_place("idle") as place,
        results_queue() as shm_out,
        results_queue() as queue_out,
        results_queue() as iox_out,
        results_queue() as idle_queue,
        spawned_all(
            [
                (shm.blocked_reader_main, (table.name, cfg.idle_s, cfg.repeats, shm_out)),
                (
                    peers.queue_blocked_reader_main,
                    (idle_queue, cfg.idle_s, cfg.repeats, queue_out),
                ),
                (
                    iceoryx.blocked_listener_main,
                    (place, cfg.idle_s, cfg.repeats, iox_out),
                ),
            ]
        ) as procs,
    ):
        return {
            "shmslots take(timeout)": spread(get_result(shm_out, procs)),
            "mp.Queue get(timeout)": spread(get_result(queue_out, procs)),
            "iceoryx2 Listener.timed_wait": spread(get_result(iox_out, procs)),
        }


def measure_rss(cfg: Config, pins: tuple[int, int] | None) -> dict[str, Any]:
    """A fresh consumer's RSS over `rss_rows` small rows through shmslots (blocking take),
    once per repeat; growth is from the first checkpoint (100k rows) to the last (1M)."""
    plan = Plan(
        warmup=0,
        trips=0,
        rtt_repeats=0,
        rtt_budget_s=0.0,
        stream_rows=cfg.rss_rows,
        stream_repeats=1,
        stream_budget_s=600.0,
        rss_every=cfg.rss_every,
    )
    runs = [run_session(BY_NAME[SHM_BLOCK], SMALL, plan, pins) for _ in range(cfg.repeats)]
    points = [run.rss_mib for run in runs]
    return {
        "checkpoints": [[(rows, round(mib, 2)) for rows, mib in run] for run in points],
        "between": f"{points[0][0][0]:,} -> {points[0][-1][0]:,} rows",
        "growth_mib": spread([run[-1][1] - run[0][1] for run in points]),
        "rows_s": spread([run.rows_s[0] for run in runs]),
    }


CLI_CALLS = ("shmslots ls", "shmslots inspect NAME")


def measure_cli(cfg: Config) -> dict[str, Spread]:
    """Wall seconds of one CLI call, each a fresh process, on a live table (benchkit/cli.py)."""
    with cli.sample_table() as name:
        argv = cli.commands(name)
        return {label: spread(cli.wall_s(argv[label], cfg.cli_runs)) for label in CLI_CALLS}


def measure_sglang(cfg: Config, pins: tuple[int, int] | None) -> dict[str, Any]:
    """µs per request of SGLang's decode path, its own clone at commit against shmslots
    (benchkit/sglang.py), in this process pinned to A's CPU; why not, without SGLang."""
    from . import sglang

    why = sglang.missing()
    if why:
        return {"missing": why}
    with pinned(pins[0] if pins else None):
        theirs, ours = sglang.measure(cfg.sglang_requests, 5 if cfg.mode == "full" else 3)
    return {"sglang_us": spread(theirs), "shmslots_us": spread(ours)}


def profile_round_trip(cfg: Config, pins: tuple[int, int] | None, out_dir: Path) -> list[str]:
    """cProfile both sides of the shmslots busy round trip of small rows; the files written."""
    prefix = out_dir / "profile"
    plan = replace(cfg.plans["small"], stream_repeats=0, profile_to=str(prefix))
    run_session(BY_NAME[SHM_BUSY], SMALL, plan, pins)
    return [f"{prefix}-a.txt", f"{prefix}-b.txt"]


# -- main -------------------------------------------------------------------------------------


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def notes() -> list[str]:
    return [
        "Round trip: rows are echoed whole; a tensor request is answered with a small row. "
        "Readers take the id as an int (shmslots: lease.item) and every other field (zero-copy "
        "views where the transport has them); tensor payloads are touched, one byte per 4 KiB "
        "page.",
        "Throughput: rows sent back to back, at most the record's slot count in flight "
        "(64 rows, 16 x 1 MiB, 4 x 64 MiB: shmslots slots, bounded queues, ring cells).",
        "Targets use shmslots busy polling for the round trip and a blocking consumer "
        "(take(timeout)) for throughput; both modes appear in the tables.",
        "torch.mp Queue puts each tensor in fresh shared memory (one copy) and passes fds.",
        "Claim+release = claim() then abort() of the WriteSlot (the slot is FREE again).",
        f"{SHM_BATCH}: claim_n + a scatter per field from batch tensors + publish_all out; "
        "poll + gather of the id + release_all in; tables with room for two batches (128 "
        "rows: one filled while the other is read); the round trip flushes a batch of one.",
        f"{SHM_BUSY} and {SHM_BLOCK} write a row by table.send (claim, write and publish in "
        "one compiled call); the reply is sent from the request's views (lease.views), "
        "before its release.",
        f"{SHM_LOAN}: as shmslots busy, but the tensor is filled into ws.alloc (a loaned "
        "arena tensor) by one memmove, the copy the bare ring makes into its cell; shmslots "
        "busy hands send() a private tensor (one memmove too, made by send).",
        f"{SHM_COPYING}: code as a user first writes it: claim, write and publish a step "
        "each, blocking take(timeout), lease.copy() of every field, release, and write() of "
        "those copies for the reply.",
        f"CLI: {', '.join(CLI_CALLS)} as fresh processes on a live 64-slot EAGLE table, "
        "each timed from spawn to exit (`python tools/bench.py cli` has every command).",
        "Gather: 64 EAGLE rows' hidden bf16[4096] (512 KiB) into one tensor, one process; "
        "torch.cat reads the same bytes from 64 private (1, 4096) tensors; stack of clones "
        "is lease.copy per request, then torch.stack (SGLang's way).",
        f"iceoryx2 {version('iceoryx2')}, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}.",
    ]


def run_all(cfg: Config, pins: tuple[int, int] | None) -> tuple[dict[str, Any], list[Session]]:
    """Every measurement, in order; the dict becomes bench.json."""
    steps_s: dict[str, float] = {}

    def step(name: str, started: float) -> None:
        steps_s[name] = round(time.perf_counter() - started, 2)
        print(f"{name}: {steps_s[name]:.1f} s", flush=True)

    r: dict[str, Any] = {"meta": {"mode": cfg.mode, "load_before": load()}}
    started = time.perf_counter()
    r["one_process"] = measure_one_process(cfg, pins)
    step("one process", started)
    started = time.perf_counter()
    r["gather"] = measure_gather(cfg, pins)
    step("gather", started)
    started = time.perf_counter()
    r["contention"] = measure_contention(cfg, pins)
    step("contention", started)
    started = time.perf_counter()
    r["idle_cpu_percent"] = measure_idle_cpu(cfg)
    step("idle readers", started)
    started = time.perf_counter()
    sessions = measure_sessions(cfg, pins)
    step("sessions", started)
    started = time.perf_counter()
    r["rss"] = measure_rss(cfg, pins)
    step("rss", started)
    started = time.perf_counter()
    r["cli_s"] = measure_cli(cfg)
    step("cli", started)
    started = time.perf_counter()
    r["sglang"] = measure_sglang(cfg, pins)
    step("sglang", started)
    r["meta"].update(
        load_after=load(),
        pins=pins,
        cpus=sorted(os.sched_getaffinity(0)),
        notes=notes(),
        steps_s=steps_s,
        config=asdict(cfg),
    )
    return r, sessions


def to_json(value: Any) -> Any:
    if isinstance(value, Spread):
        return asdict(value)
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


PLOTS = ("latency_cdf.png", "throughput_vs_payload.png", "gather.png")


def write_outputs(r: dict[str, Any], sessions: list[Session], out_dir: Path) -> str:
    """bench.json, bench.md and the two plots; returns the Markdown."""
    # Imported here, not at the top: spawned children re-import this module, and matplotlib
    # would add ~0.5 s to every one of them.
    from . import report

    figs = [report.figures(s) for s in sessions]
    r["sessions"] = [
        {**asdict(f), "rtt_quantiles_us": report.quantiles_us(s)}
        for f, s in zip(figs, sessions, strict=True)
    ]
    text = report.markdown(r, figs)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(to_json(r), indent=1) + "\n")
    (out_dir / "bench.md").write_text(text)
    latency, throughput, gather = (out_dir / name for name in PLOTS)
    report.plot_latency(sessions, latency)
    report.plot_throughput(figs, throughput)
    report.plot_gather(r["gather"], gather)
    return text


def run(quick: bool, out_dir: Path, profile: bool) -> int:
    """The whole benchmark; prints the report and where it was written."""
    cfg = QUICK if quick else FULL
    pins = pin_plan()
    torch.set_num_threads(1)
    started = time.perf_counter()
    r, sessions = run_all(cfg, pins)
    r["meta"]["runtime_s"] = round(time.perf_counter() - started, 1)
    text = write_outputs(r, sessions, out_dir)
    print()
    print(text)
    if profile:
        for path in profile_round_trip(cfg, pins, out_dir):
            print(f"\n## {path}\n")
            print(Path(path).read_text())
    print(f"Wrote {out_dir}/bench.json, bench.md and {', '.join(PLOTS)}")
    return 0
