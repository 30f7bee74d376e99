"""The engines there are, by the name the grant link and the command lines use."""

from __future__ import annotations

from ..errors import InvalidArgument
from .engine import Engine
from .mooncake import MooncakeEngine
from .nixl import NixlEngine

ENGINES = ("mooncake", "nixl")


def open_engine(kind: str = "mooncake", host: str = "127.0.0.1") -> Engine:
    """A started engine of `kind`: Mooncake listens on `host` (an address of this machine);
    NIXL's UCX finds and advertises the machine's interfaces itself."""
    if kind == MooncakeEngine.kind:
        return MooncakeEngine(host)
    if kind == NixlEngine.kind:
        return NixlEngine()
    raise InvalidArgument(f"unknown engine {kind!r}: one of {', '.join(ENGINES)}")
