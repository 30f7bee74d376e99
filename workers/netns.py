"""A second host on this machine: a network namespace joined to ours by a veth pair.

Lets the remote writer run behind a real (virtual) link instead of loopback.
Needs root and iproute2; `NamespaceUnavailable` says why when it cannot be made.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class NamespaceUnavailable(RuntimeError):
    """This machine (or user) cannot make network namespaces."""


@dataclass(frozen=True)
class Namespace:
    name: str
    outside_ip: str  # our end of the veth pair
    inside_ip: str  # the namespace's end

    @property
    def prefix(self) -> tuple[str, ...]:
        """Prepend to a command to run it inside the namespace."""
        return ("ip", "netns", "exec", self.name)


def _ip(*args: str) -> None:
    subprocess.run(("ip", *args), check=True, capture_output=True, timeout=30)


def _remove(name: str, link: str) -> None:
    for args in (("link", "del", link), ("netns", "del", name)):
        subprocess.run(("ip", *args), capture_output=True, timeout=30)


@contextmanager
def veth_namespace(name: str = "shmslots-w") -> Iterator[Namespace]:
    """Create the namespace and link, and always remove them (a stale pair is removed first).

    Interface names and the /24 subnet derive from `name`, so namespaces of
    different names do not collide.
    """
    digest = hashlib.blake2s(name.encode(), digest_size=4).digest()
    outside, inside = f"shm{digest.hex()}o", f"shm{digest.hex()}i"  # 15 bytes at most
    subnet = f"10.{200 + digest[0] % 50}.{digest[1]}"
    _remove(name, outside)
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NamespaceUnavailable(
            f"cannot create a network namespace (root and iproute2 needed): {exc}"
        ) from None
    try:
        ns = Namespace(name, f"{subnet}.1", f"{subnet}.2")
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{ns.outside_ip}/24", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns.inside_ip}/24", "dev", inside)
        _ip("netns", "exec", name, "ip", "link", "set", inside, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield ns
    finally:
        _remove(name, outside)
