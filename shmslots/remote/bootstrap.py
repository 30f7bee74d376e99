"""How grants reach a remote writer: one small framed channel over TCP.

A server with its own control plane (the router, HTTP, ZMQ) sends
`Grant.encode()` bytes its own way and never needs this module; the flow in
`workers/remote_flow.py` only calls `GrantLink.send`.  A link starts with a
shared token so that a stray local process cannot inject grants.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
from typing import Any

import msgpack

from ..errors import ShmSlotsError

_FRAME = struct.Struct("<I")
MAX_FRAME = 64 * 1024 * 1024


class LinkError(ShmSlotsError, ConnectionError):
    """The peer closed the link, sent a bad frame, or failed the token check."""


class GrantLink:
    """Length-prefixed msgpack messages over one connected socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, message: Any) -> None:
        blob: bytes = msgpack.packb(message)
        self._sock.sendall(_FRAME.pack(len(blob)) + blob)

    def recv(self, timeout: float | None) -> Any:
        """The next message; TimeoutError if none arrives within `timeout` s."""
        self._sock.settimeout(timeout)
        (n,) = _FRAME.unpack(self._read(_FRAME.size))
        if n > MAX_FRAME:
            raise LinkError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        try:
            return msgpack.unpackb(self._read(n), raw=False)
        except Exception as exc:
            raise LinkError(f"bad frame: {exc}") from None

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
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
        self._sock.settimeout(timeout)
        conn, _ = self._sock.accept()
        link = GrantLink(conn)
        try:
            token = link.recv(timeout)
        except (OSError, LinkError):
            link.close()
            raise
        if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
            link.close()
            raise LinkError("a peer connected without the link's token")
        return link

    def close(self) -> None:
        self._sock.close()


def connect(address: str, token: str, timeout: float = 10.0) -> GrantLink:
    """The writer's end of a link."""
    host, _, port = address.rpartition(":")
    link = GrantLink(socket.create_connection((host, int(port)), timeout=timeout))
    link.send(token)
    return link
