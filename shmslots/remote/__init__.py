"""Remote writers: rows of a table filled from another machine by a transfer engine
(Mooncake or NIXL).

Importing this package needs nothing extra; an engine needs its wheel
(`pip install shmslots[remote]` for Mooncake, plus Debian's libibverbs1;
`pip install shmslots[nixl]` for NIXL) and raises RemoteUnavailable without it.
"""

from .bootstrap import GrantLink, GrantListener, LinkError, connect
from .engine import Engine, EngineError, RemoteUnavailable
from .engines import ENGINES, open_engine
from .grant import Grant, GrantError
from .mooncake import MooncakeEngine
from .nixl import NixlEngine
from .server import RemoteServer, RemoteStats, Settled
from .writer import RemoteWriter

__all__ = [
    "ENGINES",
    "Engine",
    "EngineError",
    "Grant",
    "GrantError",
    "GrantLink",
    "GrantListener",
    "LinkError",
    "MooncakeEngine",
    "NixlEngine",
    "RemoteServer",
    "RemoteStats",
    "RemoteUnavailable",
    "RemoteWriter",
    "Settled",
    "connect",
    "open_engine",
]
