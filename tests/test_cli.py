"""The `shmslots` console script, run as a real subprocess against tables live processes use."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event

import posix_ipc
import pytest
import torch
from conftest import SMALL, SPAWN, Children, small_row
from prometheus_client.parser import text_string_to_metric_families

from shmslots import Field, SlotTable, TableNotFound
from shmslots.cli import _duration
from shmslots.layout import VERSION
from shmslots.participants import hold_gate, release_gate
from shmslots.segment import Segment, unlink

CLI_TIMEOUT = 60
# Tags the worker leaves its slots under.
STATE_BY_TAG = {1: "HELD", 2: "READY", 3: "WRITING", 4: "RESERVED"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [sys.executable, "-m", "shmslots", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        env=env,
    )


def assert_one_line_error(r: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def worker(name: str, ready: Event, stop: Event) -> None:
    """Leave one slot in each of HELD, READY, WRITING and RESERVED (see STATE_BY_TAG), wait."""
    with SlotTable.attach(name, "worker") as t:
        for tag in (1, 2):
            t.claim(tag=tag).write(**small_row(tag)).publish()
        lease = t.take(timeout=5.0)
        assert lease is not None and lease.tag == 1
        writing = t.claim(tag=3).write(**small_row(3))
        reservation = t.reserve(tag=4)
        ready.set()
        stop.wait(60)
        del lease, writing, reservation  # handed back by close()


def victim(name: str, ready: Event) -> None:
    """Hold one slot and write another, then wait to be SIGKILLed."""
    t = SlotTable.attach(name, "victim")
    t.claim(tag=1).write(**small_row(1)).publish()
    held = t.take(timeout=5.0)
    assert held is not None
    writing = t.claim(tag=2).write(**small_row(2))
    ready.set()
    time.sleep(60)
    del held, writing  # owned until the SIGKILL lands


@pytest.fixture
def busy(name: str, children: Children) -> Iterator[SlotTable]:
    """A table of 8 slots, created here, with a live worker process holding 4 of them."""
    table = SlotTable.create(name, SMALL, slots=8)
    ready, stop = SPAWN.Event(), SPAWN.Event()
    proc = children.start(worker, name, ready, stop)
    try:
        assert ready.wait(60), "worker did not get ready"
        yield table
    finally:
        stop.set()
        proc.join(30)
        table.close()
        with contextlib.suppress(TableNotFound):  # a test may have unlinked it
            table.unlink()
    assert proc.exitcode == 0


@contextlib.contextmanager
def foreign_segment(name: str) -> Iterator[None]:
    """A shared-memory object that is not a shmslots table."""
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=4096)
    try:
        with mmap.mmap(shm.fd, 4096) as mm:
            mm[:24] = b"somebody else's data...."
        os.close(shm.fd)
        yield
    finally:
        posix_ipc.unlink_shared_memory("/" + name)


def corrupt(name: str, offset: int, value: int) -> None:
    """Overwrite one u32 of a table's header."""
    shm = posix_ipc.SharedMemory("/" + name)
    try:
        with mmap.mmap(shm.fd, os.fstat(shm.fd).st_size) as mm:
            struct.pack_into("<I", mm, offset, value)
    finally:
        os.close(shm.fd)


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples by (name, labels), parsed by prometheus_client's own text parser."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# -- ls ----------------------------------------------------------------------------------
def test_ls_finds_tables_by_magic_and_skips_other_segments(busy: SlotTable, name: str) -> None:
    other = name + "-other"
    with foreign_segment(other):
        text = cli("ls")
        r = cli("ls", "--json")
    assert text.returncode in (0, 1) and "Traceback" not in text.stderr
    assert name in text.stdout and other not in text.stdout + text.stderr
    doc = json.loads(r.stdout)
    tables = {t["name"]: t for t in doc["tables"]}
    assert other not in tables and other not in {s["name"] for s in doc["skipped"]}
    ours = tables[name]
    assert ours["slots"] == 8 and ours["states"]["FREE"] == 4 and ours["queued"] == 1
    assert (ours["participants_alive"], ours["participants_dead"]) == (2, 0)
    assert ours["creator_pid"] == os.getpid() and ours["creator_uid"] == os.getuid()
    # other tests may be running: exit 1 exactly when some table has dead owners
    assert r.returncode == (1 if any(t["dead_owned_slots"] for t in tables.values()) else 0)


# -- inspect -----------------------------------------------------------------------------
def test_inspect_text_shows_everything(busy: SlotTable, name: str) -> None:
    r = cli("inspect", name, "--older-than", "1ms")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for word in (f"version {VERSION}", "worker", "alive", "bfloat16", "(2, 8)", "claims", "(old)"):
        assert word in out
    for state in STATE_BY_TAG.values():
        assert re.search(rf"\b{state}\b", out)
    assert "FREE 4" in out


def test_inspect_json_agrees_with_stats(busy: SlotTable, name: str) -> None:
    r = cli("inspect", name, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert r.stdout == json.dumps(doc, sort_keys=True, indent=2) + "\n"  # stable form
    stats = busy.stats()
    assert {k: doc["states"][k] for k in stats.states} == stats.states
    assert doc["counters"] == stats.counters and doc["queued"] == stats.queued
    assert doc["header"]["slots"] == 8 and doc["header"]["creator_pid"] == os.getpid()
    assert [f["name"] for f in doc["schema"]] == ["id", "p", "h"]
    assert sorted(p["role"] for p in doc["participants"]) == ["owner", "worker"]
    assert all(p["alive"] for p in doc["participants"]) and doc["problems"] == []
    slots = {s["tag"]: s for s in doc["slots"]}
    assert {tag: s["state"] for tag, s in slots.items()} == STATE_BY_TAG
    for tag, s in slots.items():
        state, generation, owner, slot_tag = busy.slot_info(s["slot"])
        assert (state.name, generation, owner, slot_tag) == (
            s["state"],
            s["generation"],
            s["owner"],
            tag,
        )
        assert s["owner_role"] == (None if s["state"] == "READY" else "worker")
    # the worker took one row and holds it still: one wait seen, no hold ended yet
    hists = doc["histograms"]
    assert (hists["held"]["count"], hists["held"]["sum_s"]) == (0, 0)
    wait = hists["ready_wait"]
    assert wait["count"] == sum(wait["counts"]) == 1 and 0 < wait["sum_s"] < 60


def test_inspect_slot_decodes_a_published_row(busy: SlotTable, name: str) -> None:
    ready = next(i for i in range(busy.slots) if busy.slot_info(i)[3] == 2)
    r = cli("inspect", name, "--slot", str(ready), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["slot"], doc["state"], doc["checksum_ok"]) == (ready, "READY", True)
    assert doc["sealed_generation"] == doc["generation"]
    values = {k: v["values"] for k, v in doc["fields"].items()}
    assert values == {"id": 2, "p": [2.0] * 4, "h": [[2.0] * 8] * 2}
    text = cli("inspect", name, "--slot", str(ready))
    assert text.returncode == 0 and "checksum ok" in text.stdout
    assert "[2.0, 2.0, 2.0, 2.0]" in text.stdout


def test_inspect_checks_every_published_rows_seal_and_names_a_bad_one(
    busy: SlotTable, name: str
) -> None:
    """`inspect NAME` exited 0 on a table whose published row failed its checksum (#28)."""
    assert cli("inspect", name).returncode == 0
    ready = next(i for i in range(busy.slots) if busy.slot_info(i)[3] == 2)
    at = busy._rows.item(ready, "id")
    busy._segment.mm[at] ^= 0xFF  # a stray write into a queued row
    text = cli("inspect", name)
    assert text.returncode == 1
    assert f"slot {ready} READY" in text.stdout and "checksum bad" in text.stdout
    doc = cli("inspect", name, "--json")
    assert doc.returncode == 1 and json.loads(doc.stdout)["broken_seals"] == [ready]
    busy._segment.mm[at] ^= 0xFF
    assert cli("inspect", name).returncode == 0


def test_inspect_slot_shows_what_a_ref_field_points_to(name: str) -> None:
    fields = (Field("id", "int64"), Field("blob", "float32", (None,), kind="ref"))
    with SlotTable.create(name, fields, slots=2, arena_bytes=1 << 20) as table:
        table.claim(tag=7).write(id=7, blob=torch.arange(10, dtype=torch.float32)).publish()
        r = cli("inspect", name, "--slot", "0", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["checksum_ok"] and doc["fields"]["id"]["values"] == 7
        ref = doc["fields"]["blob"]["ref"]
        assert (ref["b"], ref["dtype"], ref["shape"]) == ("shm", "float32", [10])
        text = cli("inspect", name, "--slot", "0")
        assert text.returncode == 0 and "shm ref, float32 (10,)" in text.stdout


# -- watch and metrics -------------------------------------------------------------------
def test_watch_prints_plain_snapshots_when_piped(busy: SlotTable, name: str) -> None:
    r = cli("watch", name, "--count", "2", "--interval", "0.1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"] {name}: 8 slots") == 2
    assert "claims 0.0" in r.stdout and "publishes 0.0" in r.stdout  # nobody moved
    assert "oldest" in r.stdout and "\x1b[" not in r.stdout


def test_metrics_are_prometheus_text(busy: SlotTable, name: str) -> None:
    r = cli("metrics", name)
    assert r.returncode == 0, r.stderr
    samples = parse_metrics(r.stdout)
    table = ("table", name)
    stats = busy.stats()
    assert samples["shmslots_claims_total", frozenset({table})] == stats.counters["claims"]
    assert samples["shmslots_takes_total", frozenset({table})] == 1
    for state in ("READY", "HELD", "WRITING", "RESERVED"):
        assert samples["shmslots_slots", frozenset({table, ("state", state)})] == 1
    assert samples["shmslots_slots", frozenset({table, ("state", "FREE")})] == 4
    assert samples["shmslots_participants", frozenset({table, ("alive", "true")})] == 2
    assert samples["shmslots_participants", frozenset({table, ("alive", "false")})] == 0
    assert samples["shmslots_queued", frozenset({table})] == stats.queued == 1
    assert samples["shmslots_dead_owned_slots", frozenset({table})] == 0
    # complete histograms: _count and _sum beside the buckets (one wait seen, no hold ended)
    for hist, n in (("shmslots_held_seconds", 0), ("shmslots_ready_wait_seconds", 1)):
        assert samples[hist + "_count", frozenset({table})] == n
        assert samples[hist + "_bucket", frozenset({table, ("le", "+Inf")})] == n
        assert (samples[hist + "_sum", frozenset({table})] > 0) == (n > 0)


# -- reap and unlink ---------------------------------------------------------------------
def test_reap_after_sigkill_hands_slots_back(name: str, children: Children) -> None:
    with SlotTable.create(name, SMALL, slots=8) as table:
        ready = SPAWN.Event()
        proc = children.start(victim, name, ready)
        assert ready.wait(60)
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(30)
        before = cli("inspect", name)
        assert before.returncode == 1, before.stderr  # a dead participant owns slots
        assert "dead" in before.stdout and "problem" in before.stdout
        # one verdict for every command that looks: watch and metrics say so too (#28)
        watched = cli("watch", name, "--count", "1", "--interval", "0.1")
        assert watched.returncode == 1 and "owned by dead" in watched.stderr
        metrics = cli("metrics", name)
        assert metrics.returncode == 1 and "shmslots_" in metrics.stdout
        r = cli("reap", name)
        assert r.returncode == 0, r.stdout + r.stderr
        for reason in ("reclaimed_writing", "redelivered", "participants_reaped", "victim"):
            assert reason in r.stdout
        stats = table.stats()
        assert (stats.states["READY"], stats.states["FREE"], stats.owned) == (1, 7, 1)
        assert stats.counters["reclaimed_writing"] == stats.counters["redelivered"] == 1
        assert [p.role for p in table.participants()] == ["owner"]  # cli-reap detached
        assert cli("inspect", name).returncode == 0
        assert cli("watch", name, "--count", "1").returncode == cli("metrics", name).returncode == 0
        again = cli("reap", name)
        assert again.returncode == 0 and "nothing to reap" in again.stdout


def test_unlink_refused_while_participants_live_unless_forced(busy: SlotTable, name: str) -> None:
    line = assert_one_line_error(cli("unlink", name), code=1)
    assert "live participant" in line and "--force" in line
    assert os.path.exists(f"/dev/shm/{name}")
    r = cli("unlink", name, "--force")
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(f"/dev/shm/{name}")
    assert busy.stats().states["HELD"] == 1  # attached processes keep working


def test_unlink_without_participants(name: str) -> None:
    SlotTable.create(name, SMALL, slots=2).close()
    try:
        r = cli("unlink", name)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        with contextlib.suppress(TableNotFound):
            unlink(name)


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [["inspect", "--json"], ["watch", "--count", "1"], ["reap"], ["unlink"]],
)
def test_unknown_table_is_one_line_exit_2(name: str, command: list[str]) -> None:
    line = assert_one_line_error(cli(command[0], name, *command[1:]))
    assert line.startswith("shmslots: error:") and name in line


def test_a_foreign_segment_is_refused(name: str) -> None:
    with foreign_segment(name):
        line = assert_one_line_error(cli("inspect", name))
        assert "not a shmslots table" in line
        assert_one_line_error(cli("unlink", name, "--force"))  # never ours to remove
        assert os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [(8, 99, "version 99"), (12, 128, "header size 128")],  # format version, header size
)
def test_a_corrupt_header_is_refused(name: str, offset: int, value: int, message: str) -> None:
    SlotTable.create(name, SMALL, slots=4).close()
    try:
        corrupt(name, offset, value)
        line = assert_one_line_error(cli("inspect", name))
        assert line.startswith("shmslots: error:") and message in line
        listing = cli("ls")
        assert name not in listing.stdout and f"skipped {name}: " in listing.stderr
        assert "Traceback" not in listing.stderr
        r = cli("unlink", name, "--force")  # it carries our magic: --force may remove it
        assert r.returncode == 0, r.stderr
    finally:
        with contextlib.suppress(TableNotFound):
            unlink(name)


def test_bad_arguments_are_one_line_exit_2(name: str) -> None:
    assert "invalid duration" in assert_one_line_error(cli("inspect", name, "--older-than", "5x"))
    assert "positive" in assert_one_line_error(cli("watch", name, "--interval", "0"))
    assert "table name" in assert_one_line_error(cli("inspect", "../etc/passwd"))


@pytest.mark.parametrize(
    ("text", "seconds"), [("500ms", 0.5), ("5s", 5.0), ("2m", 120.0), ("1.5", 1.5), ("1h", 3600)]
)
def test_durations(text: str, seconds: float) -> None:
    assert _duration(text) == pytest.approx(seconds)


# -- no torch, help that explains, and what a new user trips over ------------------------------
def imports_of(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the CLI with -X importtime; the modules it imported, by name."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shmslots", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return r, modules


def test_commands_that_only_look_or_repair_never_import_torch(busy: SlotTable, name: str) -> None:
    ready = next(i for i in range(busy.slots) if busy.slot_info(i)[3] == 2)
    commands = [
        ["--help"],
        ["inspect", "--help"],
        ["ls"],
        ["inspect", name],
        ["inspect", name, "--slot", str(ready), "--json"],
        ["watch", name, "--count", "1"],
        ["metrics", name],
        ["reap", name],
        ["unlink", name],  # refused: a worker lives
    ]
    for command in commands:
        r, modules = imports_of(*command)
        assert r.returncode in (0, 1), (command, r.stderr[-2000:])
        assert "shmslots.cli" in modules, command  # the measurement saw the CLI's imports
        assert not {m for m in modules if m.split(".")[0] in ("torch", "numpy")}, command


def test_every_subcommand_help_describes_it_and_its_exit_codes() -> None:
    for command in ("ls", "inspect", "watch", "metrics", "reap", "unlink", "demo"):
        r = cli(command, "--help")
        assert r.returncode == 0, r.stderr
        description = r.stdout.split("\n\n")[1]
        assert len(description) > 60, (command, description)
        assert "exit codes:" in r.stdout and "2  " in r.stdout and "0  " in r.stdout
        if command not in ("ls", "demo"):
            assert "/dev/shm" in r.stdout.split("options:")[0], command  # NAME is explained
    assert "(default: 1)" in cli("watch", "--help").stdout
    assert "exit codes:" in cli("--help").stdout


def test_inspect_of_a_never_used_slot_gives_the_tables_age(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as table:
        table.claim(tag=1).write(**small_row(1)).publish()
        time.sleep(0.3)
        doc = json.loads(cli("inspect", name, "--slot", "1", "--json").stdout)
        age = (time.time_ns() - doc["age_s"] * 1e9) / 1e9
        assert doc["state"] == "FREE" and 0.3 <= doc["age_s"] < 30, doc["age_s"]
        created = json.loads(cli("inspect", name, "--json").stdout)["header"]["created_ns"] / 1e9
        assert abs(age - created) < 5
        text = cli("inspect", name, "--slot", "1")
        assert text.returncode == 0, text.stderr
        assert "row not published" in text.stdout and "checksum" not in text.stdout


def test_watch_ends_with_exit_2_when_its_table_is_unlinked(name: str) -> None:
    table = SlotTable.create(name, SMALL, slots=2)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    watch = subprocess.Popen(
        [sys.executable, "-m", "shmslots", "watch", name, "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert watch.stdout is not None
        assert name in watch.stdout.readline()  # watching
        table.close()
        table.unlink()
        _, err = watch.communicate(timeout=CLI_TIMEOUT)
    finally:
        watch.kill()
        watch.wait(5)
    assert watch.returncode == 2
    assert err.strip() == f"shmslots: error: table {name!r} was unlinked while watched"


def test_watch_does_not_call_a_table_all_free_while_a_slot_changes(name: str) -> None:
    with SlotTable.create(name, SMALL, slots=2) as table:
        # A state word no version knows reads as a slot caught changing.
        struct.pack_into("<Q", table._segment.mm, table.layout.slot_entry(0), 0xFFFF)
        r = cli("watch", name, "--count", "1")
        struct.pack_into("<Q", table._segment.mm, table.layout.slot_entry(0), 0)
    assert r.returncode == 0, r.stderr
    assert "CHANGING 1" in r.stdout and "every slot is FREE" not in r.stdout
    assert "none steady (1 slot(s) changed while read)" in r.stdout


def test_ls_lists_a_table_its_creator_never_finished(name: str) -> None:
    """Sized, never given its header (its creator stopped or died there): listed, with its
    age and who holds its gate, so that `unlink --force` is found from `ls` (#36)."""
    segment = Segment.create(name, 8192)  # as SlotTable.create leaves it before its header
    try:
        hold_gate(segment.fd, name, time.monotonic() + 1)  # a creator at work holds it shared
        r = cli("ls")
        assert f"unfinished: {name}: no header after" in r.stdout, r.stdout + r.stderr
        assert f"pid {os.getpid()} (shared)" in r.stdout
        assert f"shmslots unlink --force {name}" in r.stdout
        doc = json.loads(cli("ls", "--json").stdout)
        ours = next(u for u in doc["unfinished"] if u["name"] == name)
        assert ours["age_s"] >= 0 and ours["gate"] == f"pid {os.getpid()} (shared)"
        release_gate(segment.fd)
        assert cli("unlink", "--force", name).returncode == 0
    finally:
        segment.close()
        if os.path.exists(f"/dev/shm/{name}"):
            unlink(name)


def test_ls_flags_a_table_nobody_is_attached_to(name: str) -> None:
    SlotTable.create(name, SMALL, slots=2).close()  # closed by its creator, never unlinked
    try:
        r = cli("ls")
        assert r.returncode in (0, 1), r.stderr
        assert f"orphaned: {name}: no live participant" in r.stdout
        assert f"shmslots unlink {name}" in r.stdout
        doc = json.loads(cli("ls", "--json").stdout)
        ours = next(t for t in doc["tables"] if t["name"] == name)
        assert ours["participants_alive"] == 0
    finally:
        unlink(name)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slots", "0"], "--slots: expected a positive number"),
        (["--requests", "0"], "--requests: expected a positive number"),
        (["--requests", "1"], "no request to some of the 2 transfer workers"),
        (["--hidden", "x"], "--hidden: expected a positive number"),
        (["--slots", str(1 << 21)], "--slots must be at most"),
        (["--leak-every", "0"], "--leak-every: expected a positive number"),
    ],
)
def test_demo_refuses_bad_options_in_one_line(args: list[str], message: str) -> None:
    assert message in assert_one_line_error(cli("demo", *args))


def test_unlink_force_removes_a_table_its_creator_never_finished(name: str) -> None:
    """The error for a half-made table says `unlink --force` removes it: it must (review)."""
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=1 << 16)
    os.close(shm.fd)
    try:
        line = assert_one_line_error(cli("unlink", name))
        assert "not finished" in line and "--force" in line
        assert cli("unlink", name, "--force").returncode == 0
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            posix_ipc.unlink_shared_memory("/" + name)
