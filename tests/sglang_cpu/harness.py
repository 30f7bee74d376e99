"""SGLang servers started as a user starts them (`python -m sglang.launch_server`, SGLang's
router), on this CPU, and stopped on every exit path.

`Deployment` is a context manager: each server or router it starts runs in a session of its
own, and leaving the block (normally, by an exception, or by a test's timeout) SIGTERMs
each, SIGKILLs what is left of its session after a grace period, and waits for it.  The /dev/shm
entries SGLang made meanwhile (its own `sglang*` segments and multiprocessing's semaphores)
are removed then, and counted in `left_in_shm`: a clean run leaves none.  SGLang's load
snapshots left by servers of a run that died before its stop are removed at the start of the
next (`sweep_dead_load_files`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmslots.errors import ShmSlotsError
from shmslots.sglang import samehost

SITE = Path(__file__).resolve().parent / "site"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
START_TIMEOUT_S = 300.0  # a server is up in 40-90 s on a loaded 2-core machine
REPORT_LINES = 200  # of each log, in a failed test's report: its stacks and what came before
# What makes SGLang 0.5.23 serve on a CPU (the source line behind each):
FLAGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",  # the CPU attention backend with no kernels
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--tp", "1",
    "--dtype", "float32",
    "--max-total-tokens", "8192",  # without it SGLang sizes the KV cache from free memory
    "--max-running-requests", "8",
    "--chunked-prefill-size", "1024",
    "--host", "127.0.0.1",
    "--sleep-on-idle",  # an idle scheduler polls without end: a core lost to the others
]  # fmt: skip
# A prefill/decode pair on CPU: overlap scheduling makes a torch.cuda.Event()
# (disaggregation/prefill.py:1496), and the decode's default retraction backup registers CUDA
# host memory (mem_cache/pool_host/common.py:147).
PD_FLAGS = ["--disable-overlap-schedule"]
DECODE_FLAGS = ["--disaggregation-decode-retraction-backup", "cpu_tensor"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a server: the stand-ins on PYTHONPATH (site/sitecustomize.py), and
    `SGLANG_USE_CPU_ENGINE=1`, without which `is_cpu()` is false (`srt/utils/common.py:222`)
    and the rotary embedding imports vLLM's ops (`layers/rotary_embedding/base.py:138`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHMSLOTS_SGLANG", "PYTEST"))}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p),
        SHMSLOTS_SGLANG_CPU="1",
        SGLANG_USE_CPU_ENGINE="1",
        MOONCAKE_PROTOCOL="tcp",
    )
    env.update(extra or {})
    return env


@dataclass
class Process:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float  # time.monotonic() at its start
    up_s: float | None = None  # how long it took to answer /health

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class ServerFailed(RuntimeError):
    """A server that exited, or was not up in time; the message carries its log's tail."""


class Deployment:
    """Servers and routers started by this harness, all stopped when the block ends."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model = model
        self.logs = logs
        self.started: list[Process] = []
        self.left_in_shm: list[str] = []
        self.outlived_grace: list[str] = []  # servers whose processes stop SIGKILLed, named
        self.swept = sweep_dead_load_files()
        self._shm_before = set(os.listdir("/dev/shm"))
        self._pids: set[int] = set()  # every process of its servers seen, for what they left

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:  # pytest shows what a failed test printed: each server's state
            print(self.report())
        self.stop()

    def tables_left(self) -> str:
        """The plugin tables and same-host registries its servers left in /dev/shm (a stop
        as `kill PID` leaves none), and the servers SIGKILLed after the grace; "" if none."""
        left = [e for e in self.left_in_shm if e.startswith(("sglang-", "shmslots-"))]
        return f"left {left}; SIGKILLed after the grace: {self.outlived_grace}" if left else ""

    def report(self) -> str:
        """Each process started: how long it took to come up (or how long it has waited),
        whether it still runs, and its log's tail, which ends with the stacks of every thread
        of each of its processes (sitecustomize.py dumps them on SIGUSR2)."""
        for p in self.started:
            for pid in _session_members(p.proc.pid):  # one at a time: they share the log
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
                time.sleep(0.3)  # each process's own faulthandler writes its dump
        now = time.monotonic()
        parts = []
        for p in self.started:
            up = f"up in {p.up_s:.0f} s" if p.up_s is not None else "not up"
            state = "running" if p.proc.poll() is None else f"exited {p.proc.returncode}"
            waited = now - p.started
            parts.append(f"== {p.name} (pid {p.proc.pid}, {up}, {state}, {waited:.0f} s ago)")
            parts.append(p.tail(REPORT_LINES))
        return "\n".join(parts)

    def server(
        self, name: str, *flags: str, env: dict[str, str] | None = None, port: int | None = None
    ) -> Process:
        """`python -m sglang.launch_server` with the CPU flags and `flags`; up when this returns."""
        port = port or free_port()
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
               *FLAGS, "--port", str(port), *flags]  # fmt: skip
        return self._start(name, cmd, f"http://127.0.0.1:{port}", env)

    def router(self, prefill: Process, bootstrap_port: int, decode: Process) -> Process:
        """SGLang's router in front of a prefill/decode pair (0.5.23 has no
        `sglang.srt.disaggregation.mini_lb`; `sglang_router`'s mini-lb is its successor)."""
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--mini-lb", "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url,
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        return self._start("router", cmd, f"http://127.0.0.1:{port}", None)

    def _start(self, name: str, cmd: list[str], url: str, env: dict[str, str] | None) -> Process:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=server_env(env),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        started = Process(name, url, proc, log, time.monotonic())
        self.started.append(started)
        deadline = started.started + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerFailed(f"{name} exited with {proc.returncode}:\n{started.tail()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        started.up_s = time.monotonic() - started.started
                        return started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerFailed(f"{name} not up after {START_TIMEOUT_S:.0f} s:\n{started.tail()}")

    def kill(self, process: Process) -> None:
        """SIGKILL a server and everything it spawned at once, as the OOM killer or a crash
        would, and reap them all."""
        self._pids.update(_session_members(process.proc.pid))
        _signal_session(process.proc, signal.SIGKILL)
        process.proc.wait()
        _wait_for_session_gone([process.proc.pid], time.monotonic() + 30)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM each process started (as `kill PID` does: SGLang then shuts its own
        children down), SIGKILL what is left of its session after `grace_s`, reap each; then
        remove (and count) the /dev/shm entries SGLang made."""
        for p in self.started:
            self._pids.update(_session_members(p.proc.pid))
        for p in reversed(self.started):  # the router first, then decode, then prefill
            p.proc.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.1, deadline - time.monotonic()))
        sessions = [p.proc.pid for p in self.started]
        while any(map(_session_members, sessions)) and time.monotonic() < deadline:
            time.sleep(0.1)  # a server's children get the grace too
        for p in self.started:
            left = _session_members(p.proc.pid)
            if left:  # their exit never ran
                self.outlived_grace.append(f"{p.name} ({', '.join(map(_named, left))})")
            _signal_session(p.proc, signal.SIGKILL)
            p.proc.wait()
        _wait_for_session_gone([p.proc.pid for p in self.started], deadline + 10)
        self.started.clear()
        for entry in sorted(set(os.listdir("/dev/shm")) - self._shm_before):
            if entry.startswith(("sglang", "shmslots-", "sem.mp-", "psm_")):
                owner = _maker(entry)
                if owner is not None and owner not in self._pids:
                    continue  # another run's on this machine: not ours to count or remove
                if owner is None and _mapped(entry):
                    continue  # in use by a live process (another run's semaphore, say)
                self.left_in_shm.append(entry)
                with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                    os.unlink(f"/dev/shm/{entry}")


LOAD_FILES = "sglang_loads_"  # SGLang's load snapshots (managers/load_snapshot.py)
SETTLED_S = 60.0  # a live server maps its file within milliseconds of making it


def sweep_dead_load_files() -> list[str]:
    """Remove (and name) the load-snapshot files of SGLang servers that are gone.  SGLang
    never unlinks them; `stop` removes its own servers', but a harness SIGKILLed before its
    stop leaves them.  A live server or reader maps its file from just after making it until
    it exits, so one no live process maps, made over a minute ago, is a dead server's."""
    swept = []
    now = time.time()
    for entry in sorted(os.listdir("/dev/shm")):
        if not entry.startswith(LOAD_FILES):
            continue
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile
            if now - os.stat(f"/dev/shm/{entry}").st_mtime > SETTLED_S and not _mapped(entry):
                os.unlink(f"/dev/shm/{entry}")
                swept.append(entry)
    return swept


def _maker(entry: str) -> int | None:
    """The pid that made a plugin table (in its name) or a same-host registry (in its
    header); None for what does not say (SGLang's and multiprocessing's own entries)."""
    if entry.startswith("sglang-"):  # sglang-<port>-tp<rank>-<pid>-<n>
        return int(entry.rsplit("-", 2)[1])
    if entry.startswith(samehost.PREFIX):
        try:
            registry = samehost.PeerRegistry(entry, None)
        except ShmSlotsError:
            return None  # unreadable: counted
        try:
            registry.refresh()
            return int(registry.pid) or None  # 0: never published, counted
        except ShmSlotsError:
            return None
        finally:
            registry.close()
    return None


def _mapped(entry: str) -> bool:
    """Whether a live process maps /dev/shm/`entry` (a semaphore or segment in use)."""
    path = f"/dev/shm/{entry}"
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                    if line.split(maxsplit=5)[5:] in ([path], [f"{path} (deleted)"]):
                        return True
    return False


def _die_with_parent() -> None:
    """In the child before exec: SIGKILLed if this harness dies first (even by SIGKILL, when
    no exit path of ours runs); SGLang's own children die with their parent in turn
    (`kill_itself_when_parent_died`, `srt/managers/scheduler.py:6269`)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        os._exit(127)


def _signal_session(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # its session's group: the server and what it spawned


def _wait_for_session_gone(sessions: Sequence[int], deadline: float) -> None:
    """Until no process is left in these sessions (children exit after their parent)."""
    while time.monotonic() < deadline:
        alive = [s for s in sessions if _session_members(s)]
        if not alive:
            return
        for s in alive:
            for pid in _session_members(s):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    raise RuntimeError(f"processes left in sessions {list(sessions)}")


def _named(pid: int) -> str:
    """A process as a report names it: its pid and command name."""
    try:
        return f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}"
    except OSError:
        return str(pid)


def _session_members(session: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[3]) == session and fields[0] != "Z":  # session id; not a zombie
                members.append(int(entry))
    return members


def generate(
    url: str, text: str, max_new_tokens: int = 8, timeout: float = 120.0, **extra: Any
) -> dict[str, Any]:
    """POST /generate at temperature 0; the reply as a dict."""
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    body.update(extra)
    reply: dict[str, Any] = post(url, "/generate", body, timeout)
    return reply


def post(url: str, path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def get(url: str, path: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url + path, timeout=timeout) as r:
        return json.loads(r.read())
