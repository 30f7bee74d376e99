"""Remote writers: rows of a table filled from another machine by the Mooncake Transfer Engine.

Importing this package needs nothing extra; `Engine()` needs
`pip install shmslots[remote]` (and Debian's libibverbs1) and raises
RemoteUnavailable without them.
"""

from .bootstrap import GrantLink, GrantListener, LinkError, connect
from .engine import Engine, EngineError, RemoteUnavailable
from .grant import Grant, GrantError
from .server import RemoteServer, RemoteStats, Settled
from .writer import RemoteWriter

__all__ = [
    "Engine",
    "EngineError",
    "Grant",
    "GrantError",
    "GrantLink",
    "GrantListener",
    "LinkError",
    "RemoteServer",
    "RemoteStats",
    "RemoteUnavailable",
    "RemoteWriter",
    "Settled",
    "connect",
]
