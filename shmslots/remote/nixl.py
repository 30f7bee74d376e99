"""The one file that touches NIXL (`pip install shmslots[nixl]`, the UCX backend).

NIXL peers do not find each other by address: a writer loads the owner's agent metadata
(`contact()`, which lists its registered memory) before it writes, and loads it again after
the owner registers more.  NIXL's notifications carry bytes and no name, so a notify
travels as `name NUL message`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from .engine import Engine, EngineError, RemoteUnavailable

SPIN_POLLS = 2000  # about a millisecond of polls before a write waits in naps


@contextlib.contextmanager
def _agent_settings() -> Iterator[None]:
    """NIXL's and UCX's settings for the agent being made, each only where the user has not
    set it, and only while the agent is made (UCX reads them when its context starts):
    afterwards the process's environment is as it was, for every other UCX user in it.

    - NIXL_LOG_LEVEL=WARN: its INFO lines go to stdout;
    - UCX_MODULES=^ib*,rdmacm without an RDMA device: those modules are of no use then, and
      loading them brings the wheel's own libnl-route, whose destructor crashes every
      process that made an agent as it exits (SIGSEGV in rtnl_tc_unregister, nixl-cu12 1.5.1);
    - UCX_TLS=^cma: on one host UCX would write with CMA (process_vm_writev), landing bytes
      in the owner's memory with no step of the owner's, so closing its engine would not
      stop a writer that has not yet seen the disconnect; over TCP the owner's worker
      applies each write, and a closed engine applies none (RemoteServer.close relies on it).
    """
    wanted = {"NIXL_LOG_LEVEL": "WARN", "UCX_TLS": "^cma"}
    if not _rdma_devices():
        wanted["UCX_MODULES"] = "^ib*,rdmacm"
    added = [key for key in wanted if key not in os.environ]
    for key in added:
        os.environ[key] = wanted[key]
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def load() -> tuple[Any, tuple[type[Exception], ...]]:
    """NIXL's agent class and its error classes; RemoteUnavailable without the wheel."""
    try:  # the `nixl` meta-package where installed (as SGLang imports it), else the wheel
        from nixl import _api, _bindings
    except ImportError:
        try:
            from nixl_cu12 import _api, _bindings
        except ImportError as exc:
            raise RemoteUnavailable(
                f"NIXL cannot be imported ({exc}); install `pip install shmslots[nixl]` "
                "(the nixl-cu12 wheel, which runs on the CPU too)"
            ) from exc
    errors = tuple(
        error
        for name, error in vars(_bindings).items()
        if name.startswith("nixl") and name.endswith("Error") and isinstance(error, type)
    )
    return _api, errors


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


class NixlEngine(Engine):
    """One NIXL agent with the UCX backend, DRAM to DRAM.

    UCX finds this machine's interfaces itself (once per process: an interface made later,
    such as a network namespace's link, is not seen by a process that already made an
    agent) and advertises them in the metadata; it connects both ways.  Over TCP it
    emulates remote writes with messages that the receiving side applies without checking
    them against its registrations (NIXL checks on the sending side, against the metadata
    it loaded): so `refuses_unregistered` is False, and the RemoteServer that used this
    engine closes it, which ends every connection to it.
    """

    kind = "nixl"
    refuses_unregistered = False

    def __init__(self, transfer_timeout_s: float = 5.0) -> None:
        """`transfer_timeout_s`: how long a write waits for its transfer before it fails.
        The bytes may still land after that, so a RemoteServer's late-write window must
        exceed it on every writer's engine (the default window is 10 s)."""
        super().__init__()
        if not 0 < transfer_timeout_s < float("inf"):
            raise InvalidArgument(f"transfer timeout must be > 0 s, got {transfer_timeout_s!r}")
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.session = f"shmslots-{os.getpid()}-{secrets.token_hex(4)}"  # the agent's name
        with _agent_settings():
            api, self._errors = load()
            try:
                agent = api.nixl_agent(self.session, api.nixl_agent_config(backends=[]))
                agent.create_backend("UCX")
            except Exception as exc:
                raise EngineError(f"NIXL agent with UCX failed to start: {exc}") from None
        self._agent: Any = agent
        self._registered: dict[int, Any] = {}  # address -> its registration
        self._peers: set[str] = set()

    def contact(self) -> bytes:
        blob: bytes = self._call(lambda agent: agent.get_agent_metadata())
        return blob

    def connect(self, contact: bytes) -> str:
        peer = self._call(lambda agent: agent.add_remote_agent(contact))
        session = peer.decode() if isinstance(peer, bytes) else str(peer)
        self._peers.add(session)
        return session

    def register(self, address: int, length: int) -> None:
        if address in self._registered:
            raise EngineError(f"the buffer at {address:#x} is registered already")
        self._registered[address] = self._call(
            lambda agent: agent.register_memory([(address, length, 0, "")], "DRAM"),
            f"cannot register {length} bytes at {address:#x}",
        )

    def unregister(self, address: int) -> None:
        descs = self._registered.get(address)
        if descs is None:
            raise EngineError(f"no buffer registered at {address:#x}")
        self._call(lambda agent: agent.deregister_memory(descs), f"cannot unregister {address:#x}")
        del self._registered[address]

    def close(self) -> None:
        """Ends the agent: its connections close, and a peer's later write fails there."""
        agent, self._agent = self._agent, None
        if agent is not None:
            for descs in self._registered.values():
                # a refusal changes nothing: the agent goes now, its registrations with it
                with contextlib.suppress(*self._errors):
                    agent.deregister_memory(descs)
            self._registered.clear()
            del agent  # the last reference: the agent and its UCX worker go now

    def _transfer(
        self,
        session: str,
        sources: list[int],
        targets: list[int],
        lengths: list[int],
        notify: tuple[str, str] | None,
    ) -> None:
        if session not in self._peers:
            raise EngineError(f"no contact loaded for {session!r}: connect() to it first")
        message = b"" if notify is None else f"{notify[0]}\0{notify[1]}".encode()
        entries = [(s, t, n) for s, t, n in zip(sources, targets, lengths, strict=True) if n]
        if not entries:
            if message:
                self._call(lambda agent: agent.send_notif(session, message), "notify failed")
            return
        local = np.array([(s, n, 0) for s, _, n in entries], dtype=np.uint64)
        remote = np.array([(t, n, 0) for _, t, n in entries], dtype=np.uint64)
        failed = f"transfer of {len(entries)} buffer(s) to {session} failed"

        # The transfer request holds the agent: it lives in `request` only, emptied when
        # released, so that no frame an error keeps holds the agent past close().
        request = [
            self._call(
                lambda agent: agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(local, "DRAM"),
                    agent.get_xfer_descs(remote, "DRAM"),
                    session,
                    message,
                ),
                failed,
            )
        ]
        try:  # released on every way out, a failed post included
            state = self._call(lambda agent: agent.transfer(request[0]), failed)
            deadline = time.monotonic() + self.transfer_timeout_s
            polls = 0
            while state == "PROC" and time.monotonic() < deadline:
                # the agent's progress thread moves it: yield at first, then nap
                time.sleep(0 if polls < SPIN_POLLS else 1e-4)
                polls += 1
                state = self._call(lambda agent: agent.check_xfer_state(request[0]), failed)
        finally:
            self._call(lambda agent: agent.release_xfer_handle(request.pop()), failed)
        if state != "DONE":
            why = f"timed out after {self.transfer_timeout_s} s" if state == "PROC" else state
            raise EngineError(f"{failed} ({why}; its bytes may still land)")

    def _received(self) -> Iterable[tuple[str, str]]:
        notes: dict[str, list[bytes]] = self._call(lambda agent: agent.get_new_notifs())
        for messages in notes.values():
            for blob in messages:
                name, _, message = blob.decode(errors="replace").partition("\0")
                yield name, message

    def _call(self, step: Any, failed: str = "NIXL call failed") -> Any:
        """`step(agent)`, NIXL's own errors turned into EngineError."""
        if self._agent is None:
            raise EngineError("this NIXL engine is closed")
        try:
            return step(self._agent)
        except self._errors as exc:
            error = EngineError(f"{failed}: {type(exc).__name__} {exc}")
        # raised out here, with no context: NIXL's error's frames hold the agent, and an
        # error the caller keeps must not keep the agent alive past close()
        raise error
