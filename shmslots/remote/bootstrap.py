"""How grants reach a remote writer: one small framed channel over TCP.

A server with its own control plane (the router, HTTP, ZMQ) sends
`Grant.encode()` bytes its own way and never needs this module; the flow in
`workers/remote_flow.py` hands grants to one `deliver` function.  A link
starts with a shared token so that a stray process cannot inject grants;
it is not encryption, and the engine's own port accepts any peer that can
reach it: run remote writers on a trusted network.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import time
from typing import Any

import msgpack

from ..errors import ShmSlotsError

_FRAME = struct.Struct("<I")
MAX_FRAME = 64 * 1024 * 1024
MAX_TOKEN_FRAME = 256


class LinkError(ShmSlotsError, ConnectionError):
    """The peer closed the link, sent a bad frame, or failed the token check."""


class GrantLink:
    """Length-prefixed msgpack messages over one connected socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, message: Any) -> None:
        blob: bytes = msgpack.packb(message)
        self._sock.sendall(_FRAME.pack(len(blob)) + blob)

    def recv(self, timeout: float | None, limit: int = MAX_FRAME) -> Any:
        """The next message; TimeoutError if it is not whole within `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        (n,) = _FRAME.unpack(self._read(_FRAME.size, deadline))
        if n > limit:
            raise LinkError(f"frame of {n} bytes exceeds {limit}")
        blob = self._read(n, deadline)
        try:
            return msgpack.unpackb(blob, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise LinkError(f"bad frame: {exc}") from None

    def _read(self, n: int, deadline: float | None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("link: message not whole before the deadline")
                self._sock.settimeout(left)
            else:
                self._sock.settimeout(None)
            try:
                chunk = self._sock.recv(n - len(buf))
            except TimeoutError:
                raise TimeoutError("link: message not whole before the deadline") from None
            if not chunk:
                raise LinkError("peer closed the link")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self._sock.close()


class GrantListener:
    """The owner's end: listens on `host`, accepts one writer presenting `token`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.token = secrets.token_hex(16)
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"

    def accept(self, timeout: float) -> GrantLink:
        """The first peer that presents the token; others are dropped.  TimeoutError if none."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no writer with the token connected within {timeout} s")
            self._sock.settimeout(left)
            conn, _ = self._sock.accept()
            link = GrantLink(conn)
            try:
                token = link.recv(min(left, 5.0), limit=MAX_TOKEN_FRAME)
            except (OSError, LinkError):
                link.close()
                continue
            if isinstance(token, str) and hmac.compare_digest(token, self.token):
                return link
            link.close()

    def close(self) -> None:
        self._sock.close()


def connect(address: str, token: str, timeout: float = 10.0) -> GrantLink:
    """The writer's end of a link."""
    host, _, port = address.rpartition(":")
    link = GrantLink(socket.create_connection((host, int(port)), timeout=timeout))
    link.send(token)
    return link
