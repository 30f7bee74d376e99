"""A transfer engine for peers on one host: Mooncake's `TransferEngine` calls, answered by
shared memory, `process_vm_writev` and CUDA IPC, with no network and no engine thread.

- `engine`: `SameHostEngine`, the calls SGLang's manager makes, and the copies of a transfer;
- `registry`: each engine's `/dev/shm` registry (what peers may write into, and the lock
  that says its owner lives) and the session ids that name it;
- `regions`: what registered memory is (`Region`, `RegionTable`, `classify`);
- `memfd`: anonymous memory moved in place onto a sealed memfd, so that peers can map it;
- `peer`: what an engine keeps of one peer, and the ways bytes go into it;
- `plan`: every block of a transfer checked and routed before any is written.

A transfer is synchronous: when it returns, or raises, no byte of it can still land.  Every
destination byte must lie inside a region the peer registered and every source byte inside
one registered here; otherwise nothing of the call is written.
"""

from .engine import SameHostEngine
from .errors import EngineClosed, PeerGone, TransferError
from .regions import Region
from .registry import PREFIX, PeerRegistry, parse_session, sweep

__all__ = [
    "PREFIX",
    "EngineClosed",
    "PeerGone",
    "PeerRegistry",
    "Region",
    "SameHostEngine",
    "TransferError",
    "parse_session",
    "sweep",
]
