"""The transfer -> decode flow with each consumption policy, as spawned workers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import shmslots.workers.decode
from conftest import SPAWN, Children
from shmslots.workers.decode import Policy
from shmslots.workers.launcher import FlowConfig, FlowResult, run_flow

from shmslots import State

REQUESTS = 20_000


def _flow(policy: Policy) -> FlowResult:
    return run_flow(
        FlowConfig(
            requests=REQUESTS,
            transfer_workers=2,
            decode_workers=2,
            slots=64,
            policy=policy,
            burst=64,
            transfer_abort=0.02,
            decode_abort=0.02,
            timeout_s=200,
        )
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["hold", "clone"])
def test_correct_policies_deliver_every_row_intact(policy: Policy) -> None:
    result = _flow(policy)
    p = result.progress
    assert result.published + result.transfer_aborted == REQUESTS
    assert result.transfer_aborted > 0 and p.decode_aborted > 0
    assert p.corrupted == 0
    assert p.verified + p.decode_aborted == result.published
    assert result.accounted  # published = consumed + aborted, tag by tag
    assert result.final.owned == 0 and result.final.queued == 0
    assert result.final.counters["leaked_views"] == 0
    assert p.copies == (p.verified + p.decode_aborted if policy == "clone" else 0)


@pytest.mark.timeout(240)
def test_early_release_is_caught() -> None:
    """Views kept past release must show up: as corrupted rows, leaked views, or both."""
    result = _flow("early-release")
    p = result.progress
    leaked = result.final.counters["leaked_views"]
    assert p.corrupted > 0 or leaked > 0
    assert leaked > 0  # every early release keeps views: the detector must see them
    assert result.accounted and result.final.owned == 0


def _run_big_flow() -> None:
    run_flow(FlowConfig(requests=2_000_000, timeout_s=120))


def _spawned_children(pid: int) -> list[int]:
    """Live worker processes (multiprocessing spawn children) whose parent is `pid`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except OSError:
            continue
        if int(ppid) == pid and spawned and state != "Z":
            found.append(int(entry))
    return found


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_reaps_workers_and_unlinks_the_table(
    children: Children,
) -> None:
    launcher = SPAWN.Process(target=_run_big_flow)  # not daemonic: it has children of its own
    launcher.start()
    children.procs.append(launcher)  # reaped by the fixture whatever happens
    pid = launcher.pid
    assert pid is not None

    def tables() -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"shmslots-flow-{pid}-")]

    deadline = time.monotonic() + 60
    while not (tables() and len(_spawned_children(pid)) == 4) and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _spawned_children(pid)
    assert tables() and len(workers) == 4, "the flow never got going"
    os.kill(pid, signal.SIGTERM)
    launcher.join(60)
    assert launcher.exitcode == 128 + signal.SIGTERM
    assert tables() == []
    assert [w for w in workers if os.path.exists(f"/proc/{w}")] == []


DECODE = os.path.abspath(shmslots.workers.decode.__file__)
TAKER = "DecodeScheduler.pop_transferred"


def _taking_lines() -> set[int]:
    """The lines of pop_transferred that take leases: its poll and its blocking take."""
    with open(DECODE) as f:
        lines = {i for i, text in enumerate(f, 1) if re.search(r"self\.table\.(poll|take)\(", text)}
    assert len(lines) == 2, lines
    return lines


def _names_the_taker(message: str) -> bool:
    """The SlotsExhausted message names pop_transferred's lines as the top holder."""
    top = message.split("top holders by call site: ", 1)[-1]
    return any(top.startswith(f"decode.py:{line} in {TAKER} (") for line in _taking_lines())


@pytest.mark.timeout(240)
def test_an_injected_leak_runs_the_table_out_and_names_the_call_site() -> None:
    leak_every, slots = 5, 16
    result = run_flow(
        FlowConfig(requests=20_000, slots=slots, burst=64, leak_every=leak_every, timeout_s=200)
    )
    p = result.progress
    e = p.exhaustion
    assert e is not None, "the leak never ran the table out"
    assert e.message.startswith("no free slot to claim within 1.0 s; top holders by call site:")
    assert _names_the_taker(e.message), e.message
    # the table as read right after: every leaked request's slot HELD, attributed to the
    # decode line that took it (the leak is in the cancel path; the site is the taker's)
    leaked = set(p.leaked_tags)
    assert len(leaked) == len(p.leaked_tags)  # each leaked once
    held = [s for s in e.snapshot.slot_states if s.state is State.HELD and s.tag in leaked]
    assert held, "no leaked slot was still HELD when the table ran out"
    lines = _taking_lines()
    for s in held:
        assert s.site is not None and s.owner >= 0
        assert (s.site.file, s.site.function) == (DECODE, TAKER) and s.site.line in lines
    # nothing but the leak holds a slot for the second the claim waited: the leaked ones
    # are most of the table (the rest: rows in flight when the snapshot was read)
    assert len(held) >= slots // 2, (len(held), e.snapshot.states)
    # 1 in leak_every of the requests decode took leaked (per worker, counted from its first)
    taken = len(leaked) + len(p.consumed_tags) + len(p.aborted_tags)
    assert taken // leak_every - 2 <= len(leaked) <= taken // leak_every
    # and the flow still ends cleanly: everything accounted, the slots handed back at close
    assert result.accounted and result.final.owned == 0 and p.corrupted == 0
    assert result.published < 20_000  # it stopped at the full table


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    """`shmslots demo ARGS` as a user runs it, at the terminal width a pipe gets."""
    return subprocess.run(
        [sys.executable, "-m", "shmslots", "demo", *args],
        capture_output=True,
        text=True,
        timeout=200,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )


@pytest.mark.timeout(240)
def test_demo_with_a_leak_prints_the_holder_and_unlinks_its_table() -> None:
    r = _demo("--requests", "20000", "--slots", "16", "--leak-every", "5", "--hidden", "256")
    assert r.returncode == 0, (r.stdout, r.stderr)
    out = r.stdout
    [table] = re.findall(r"table (shmslots-flow-\d+-\d+) \(16 slots\)", out)
    assert not os.path.exists(f"/dev/shm/{table}")  # unlinked on the way out
    [error] = [line for line in out.splitlines() if "SlotsExhausted:" in line]
    assert re.match(r"transfer-\d: SlotsExhausted: no free slot to claim within 1.0 s;", error)
    assert _names_the_taker(error.split("SlotsExhausted: ", 1)[1]), error
    assert "slots held per call site" in out and "leaked slots (never released)" in out
    assert "the table ran out of slots" in out


@pytest.mark.timeout(240)
def test_demo_exits_1_when_it_saw_corrupted_rows() -> None:
    """`demo --policy early-release` exited 0 after thousands of corrupted rows (#28)."""
    r = _demo("--requests", "3000", "--slots", "16", "--policy", "early-release", "--hidden", "256")
    [corrupted] = re.findall(r"corrupted\s+│\s+([\d,]+)", r.stdout)
    assert r.returncode == (1 if int(corrupted.replace(",", "")) else 0), (r.stdout, r.stderr)


@pytest.mark.timeout(240)
def test_a_demo_whose_table_is_unlinked_from_outside_ends_with_its_summary() -> None:
    """`shmslots unlink --force` during a demo: workers printed tracebacks and the demo exited
    2 with no summary (#28)."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "shmslots", "demo", "--requests", "200000", "--slots", "16",
         "--hidden", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )  # fmt: skip
    try:
        assert demo.stdout is not None
        table = None
        while table is None:
            found = re.search(r"table (shmslots-flow-\d+-\d+) ", demo.stdout.readline())
            table = found.group(1) if found else None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the workers are at work: decode has taken rows
            ls = subprocess.run(
                [sys.executable, "-m", "shmslots", "inspect", table, "--json"],
                capture_output=True, text=True,
            )  # fmt: skip
            if ls.returncode == 0 and '"takes": 0' not in ls.stdout:
                break
            time.sleep(0.2)
        unlinked = subprocess.run([sys.executable, "-m", "shmslots", "unlink", "--force", table])
        assert unlinked.returncode == 0
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    assert demo.returncode == 1, (out, err)  # stopped early: not a complete run
    assert "Traceback" not in out + err, err
    assert "demo summary" in out and "unlinked from outside" in out
