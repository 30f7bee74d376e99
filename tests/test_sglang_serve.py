"""SGLang 0.5.23 served as users run it, on this CPU: `python -m sglang.launch_server`, HTTP in,
tokens out (#38).

A single server is the reference.  Beside it, a prefill/decode pair on one host with
`--disaggregation-transfer-backend shmslots` and `SHMSLOTS_SGLANG=1` on both, behind SGLang's
router: the plugin's table holds the decode's metadata rows, and the same-host backend moves
the KV pages and those rows.  The pair must give the single server's tokens, its table must be
visible to `shmslots ls` / `inspect` while it serves, every slot must be FREE once requests
end (finished, or aborted by a client that goes away or by `/abort_request`), a prefill
SIGKILLed mid-transfer must fail what was in flight at once and be replaceable, and stopping
the servers as a user does (`kill PID`) must leave nothing behind.

Each deployment starts once per module (about 20 s for a server on 2 cores, 60 s for the
pair); `sglang_cpu/harness.py` stops every process it started on every exit path.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sglang_env import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang_cpu import standins
from sglang_cpu.harness import (
    DECODE_FLAGS,
    PD_FLAGS,
    Deployment,
    Process,
    free_port,
    generate,
    post,
    server_env,
    sweep_dead_load_files,
)
from sglang_cpu.model import make_model

from shmslots.snapshot import TableView

pytestmark = pytest.mark.timeout(600)
PROMPTS = ["hello", "def scheduler", "hello world 1", "hello world 2", "hello world 3", "x = 1"]
SHMSLOTS = str(Path(sys.executable).with_name("shmslots"))
PLUGIN = {"SHMSLOTS_SGLANG": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("sglang-model"))


@pytest.fixture(scope="module")
def single(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    with Deployment(model, tmp_path_factory.mktemp("single-logs")) as deployment:
        yield deployment.server("single")


class Pair:
    """A prefill/decode pair on the same-host backend, behind SGLang's router."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        bootstrap = free_port()
        self.flags = ["--disaggregation-transfer-backend", "shmslots",
                      "--disaggregation-bootstrap-port", str(bootstrap), *PD_FLAGS]  # fmt: skip
        self.prefill = self._prefill("prefill")
        self.decode = deployment.server(
            "decode", "--disaggregation-mode", "decode", *self.flags, *DECODE_FLAGS, env=PLUGIN
        )
        self.router = deployment.router(self.prefill, bootstrap, self.decode)

    def _prefill(self, name: str, port: int | None = None) -> Process:
        return self.deployment.server(
            name, "--disaggregation-mode", "prefill", *self.flags, env=PLUGIN, port=port
        )

    def restart_prefill(self) -> None:
        """A new prefill server where the old one was (the router knows it by its URL)."""
        self.prefill = self._prefill("prefill-again", urllib.parse.urlsplit(self.prefill.url).port)

    @property
    def table(self) -> str:
        """The plugin's table of the decode's scheduler (`sglang-<port>-tp0-<pid>-<n>`)."""
        port = urllib.parse.urlsplit(self.decode.url).port
        [name] = [n for n in os.listdir("/dev/shm") if n.startswith(f"sglang-{port}-tp0-")]
        return name


@pytest.fixture(scope="module")
def pair(
    model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Pair]:
    failed = request.session.testsfailed
    with Deployment(model, tmp_path_factory.mktemp("pair-logs")) as deployment:
        served = Pair(deployment)
        table = served.table
        yield served
        if request.session.testsfailed > failed:  # what each server is doing, stacks and all
            terminal = request.config.pluginmanager.get_plugin("terminalreporter")
            if terminal is not None:  # None under -p no:terminal
                terminal.write_line(deployment.report())
    # stopped as `kill PID` stops a server: its own exit removes the tables and same-host
    # registries its schedulers left (the harness counts and removes what its servers left)
    assert table not in deployment.left_in_shm
    left = deployment.tables_left()
    assert not left, left


def _outputs(url: str, max_new_tokens: int = 12) -> list[list[int]]:
    return [generate(url, p, max_new_tokens)["output_ids"] for p in PROMPTS]


def _inspect(name: str) -> dict[str, Any]:
    out = subprocess.run([SHMSLOTS, "inspect", "--json", name], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def _all_free(name: str, timeout: float = 60.0) -> dict[str, Any]:
    """The table once every slot is FREE (SGLang settles an abort on its next loop), or
    as it is at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        seen = _inspect(name)
        if seen["states"]["FREE"] == seen["header"]["slots"] or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def test_the_stand_ins_can_be_named_but_refuse_every_call() -> None:
    """So a server that answers proves SGLang never ran anything of torchvision or sgl_kernel."""
    module = standins._PlaceholderModule("sgl_kernel")
    op = module.ops.copy_all_layer_kv_cache_cpu
    with pytest.raises(RuntimeError, match=r"sgl_kernel\.ops\.copy_all_layer_kv_cache_cpu was"):
        op(1, key=2)

    class Defined(module.Base):  # type: ignore[misc,name-defined]  # no call
        pass

    assert Defined() is not None


def test_mooncakes_sender_takes_the_plain_path_on_cpu_in_a_server_process() -> None:
    """The one workaround (standins.py): set after SGLang's own module is imported."""
    code = "from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender as S; print("
    shown = subprocess.run(
        [sys.executable, "-c", code + "S.supports_host_tensor_indices)"],
        env=server_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert shown.stdout.strip() == "False", shown.stderr[-2000:]


def test_the_pair_gives_the_single_servers_tokens(single: Process, pair: Pair) -> None:
    want = _outputs(single.url)
    assert len({tuple(o) for o in want}) > 1  # the prompts give different outputs
    assert _outputs(pair.router.url) == want  # one at a time
    with ThreadPoolExecutor(4) as pool:  # four at once
        together = list(pool.map(lambda p: generate(pair.router.url, p, 12)["output_ids"], PROMPTS))
    assert together == want
    body = {"model": "m", "prompt": "hello", "max_tokens": 6, "temperature": 0}
    completions = [
        post(u, "/v1/completions", body)["choices"][0]["text"]
        for u in (single.url, pair.router.url)
    ]
    assert completions[0] == completions[1]


def test_shmslots_sees_the_schedulers_table_while_it_serves(pair: Pair) -> None:
    listed = json.loads(
        subprocess.run([SHMSLOTS, "ls", "--json"], capture_output=True, text=True).stdout
    )
    [table] = [t for t in listed["tables"] if t["name"] == pair.table]
    assert table["participants_alive"] >= 1
    before = _inspect(pair.table)["counters"]["reserves"]
    generate(pair.router.url, "hello", 4)
    seen = _all_free(pair.table)
    assert seen["counters"]["reserves"] > before  # the request's row went through this table


def test_every_slot_is_free_after_finished_and_aborted_requests(
    single: Process, pair: Pair
) -> None:
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: generate(pair.router.url, p, 8), PROMPTS))
    # a client that goes away mid-request (SGLang's router does not pass that on, so the
    # decode may finish the request: short, so the servers are idle again when this ends)
    _disconnect_mid_request(pair.router.url, "hello world 1", max_new_tokens=100)
    # /abort_request, to both servers, for a request under way
    rid = "abort-me"
    worker = threading.Thread(
        target=lambda: _swallow(lambda: generate(pair.router.url, "x = 1", 1500, rid=rid))
    )
    worker.start()
    time.sleep(1.0)
    for server in (pair.prefill, pair.decode):
        post(server.url, "/abort_request", {"rid": rid})
    worker.join(120)
    assert not worker.is_alive()
    _wait_until_idle(pair)
    seen = _all_free(pair.table)
    assert seen["states"]["FREE"] == seen["header"]["slots"], seen["states"]
    # and the pair still serves, with the single server's tokens
    assert (
        generate(pair.router.url, "def scheduler", 12)["output_ids"]
        == generate(single.url, "def scheduler", 12)["output_ids"]
    )


def _disconnect_mid_request(url: str, prompt: str, max_new_tokens: int) -> None:
    """Send a generation and close the connection before the reply."""
    parts = urllib.parse.urlsplit(url)
    body = json.dumps(
        {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    ).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(1.0)  # under way: prefilled, decoding


def _swallow(call: Any) -> None:
    with contextlib.suppress(OSError):  # the aborted request's reply: an error, or a close
        call()


def test_a_prefill_killed_mid_transfer_fails_its_requests_at_once_and_a_new_one_serves(
    single: Process, pair: Pair
) -> None:
    """SIGKILL of the whole prefill server while the decode waits for its transfers: every
    client has an answer within seconds (an error for what was in flight, not a hang), the
    decode has every slot and page back, and a prefill started again serves as before."""
    loads_before = _wait_until_idle(pair)
    ends: list[tuple[str, float]] = []

    def send(prompt: str) -> None:
        try:
            generate(pair.router.url, prompt, 32, timeout=60)
            ends.append(("ok", time.monotonic()))
        except OSError:  # urllib's HTTPError included
            ends.append(("error", time.monotonic()))

    prompts = [f"hello world {i} " * 90 for i in range(8)]  # about 900 tokens each
    with TableView.open(pair.table) as view, ThreadPoolExecutor(len(prompts)) as pool:
        sent = [pool.submit(send, p) for p in prompts]
        deadline = time.monotonic() + 60
        while view.snapshot().states["RESERVED"] == 0:  # a transfer under way
            assert time.monotonic() < deadline, "no transfer was ever under way"
            time.sleep(0.002)  # the servers need the cores
        killed_at = time.monotonic()
        pair.deployment.kill(pair.prefill)
        for future in sent:
            future.result(timeout=90)
    assert len(ends) == len(prompts)
    assert "error" in {kind for kind, _ in ends}  # what was in flight failed
    assert max(end for _, end in ends) - killed_at < 10  # no 30 s timeout, no hang
    seen = _all_free(pair.table, timeout=5)
    assert seen["states"]["FREE"] == seen["header"]["slots"], seen["states"]
    loads = _decode_loads(pair)
    assert loads["num_used_tokens"] == loads_before["num_used_tokens"]  # every page back
    assert loads["num_running_reqs"] == 0
    assert loads["disaggregation"]["decode_transfer_queue_reqs"] == 0
    pair.restart_prefill()
    assert (
        generate(pair.router.url, "def scheduler", 12)["output_ids"]
        == generate(single.url, "def scheduler", 12)["output_ids"]
    )


def _wait_until_idle(pair: Pair, timeout: float = 120.0) -> dict[str, Any]:
    """The decode's loads once it runs and waits for nothing."""
    deadline = time.monotonic() + timeout
    while True:
        loads = _decode_loads(pair)
        queues = loads["disaggregation"]
        busy = loads["num_running_reqs"] + loads["num_waiting_reqs"]
        busy += queues["decode_prealloc_queue_reqs"] + queues["decode_transfer_queue_reqs"]
        if busy == 0:
            return loads
        assert time.monotonic() < deadline, loads
        time.sleep(0.2)


def _decode_loads(pair: Pair) -> dict[str, Any]:
    with urllib.request.urlopen(f"{pair.decode.url}/v1/loads", timeout=10) as reply:
        [loads] = json.loads(reply.read())["loads"]
    return dict(loads)


def test_a_dead_servers_load_snapshot_is_swept_and_a_live_ones_kept() -> None:
    """SGLang never unlinks its load-snapshot files: one no live process maps, made over a
    minute ago, is a dead server's and goes; one mapped (a live server's) or just made (a
    server between making and mapping it) stays."""
    names = [f"sglang_loads_shmslots-test-{kind}-{os.getpid()}.shm" for kind in "dmf"]
    dead, mapped, fresh = (f"/dev/shm/{n}" for n in names)
    for path in (dead, mapped, fresh):
        Path(path).write_bytes(bytes(4096))
    old = time.time() - 3600
    os.utime(dead, (old, old))
    os.utime(mapped, (old, old))
    try:
        with open(mapped, "r+b") as held, mmap.mmap(held.fileno(), 4096):
            swept = sweep_dead_load_files()
            assert names[0] in swept and not os.path.exists(dead)
            assert os.path.exists(mapped) and os.path.exists(fresh)
            assert names[1] not in swept and names[2] not in swept
    finally:
        for path in (dead, mapped, fresh):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
