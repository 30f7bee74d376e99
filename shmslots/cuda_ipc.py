# mypy: disable-error-code="no-untyped-call"
# (torch's CUDA IPC internals carry no type hints)
"""CUDA tensors by IPC handle: what torch's own sharing sends, as a plain dict.

The dict carries the fields that `torch.multiprocessing.reductions` puts in
a CUDA IPC reduction (IPC memory handle, storage size and offset, ref-counter
handle and offset, event handle, event-sync flag) plus the tensor's offset,
shape, stride and dtype, and the device's UUID — not its index, so processes
with different CUDA_VISIBLE_DEVICES agree on the device.  Opening reuses
torch's cache of opened handles, because a handle may be opened only once
per device per process.

Reference counts.  Each `_share_cuda_` puts the storage behind a new
ref-counter set to 1; when the producer's storage dies while a counter is
above 0, torch keeps its block out of use (in "limbo") until it drops to 0.
torch.multiprocessing pairs each share with exactly one consumer, whose
storage decrements the counter when it dies.  A row's handle has no such
consumer: it may be aborted, cancelled, overwritten, never opened, opened in
the producer itself, or opened several times by several processes
(redelivery).  So here the lifetime is the table's, as for the arena: the
producer keeps the tensor until the slot's generation moves on, and then
releases the share itself, exactly once (IpcLedger).  Consumers never touch
a counter: they open the storage with NO_COUNTER, and reuse a cached mapping
without releasing anything.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .errors import SchemaError
from .torch_dtypes import DTYPE_NAMES, DTYPES

# What a consumer's storage names as its ref-counter: not a valid shared-memory name (a
# slash inside), so the decrement its deleter attempts finds nothing, as torch allows for a
# producer that is gone.  The producer releases its share itself.
NO_COUNTER = b"/shmslots/consumers-release-nothing"


class DeviceIpc(Protocol):
    """The calls of device sharing (torch's CUDA IPC): the seam a test stands in for."""

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` travels by IPC (else it is copied into the arena)."""
        ...

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        """One share of the tensor's storage, described; released once by release()."""
        ...

    def release(self, description: dict[str, Any]) -> None: ...

    def open(self, description: dict[str, Any]) -> torch.Tensor:
        """The shared tensor, in a consumer; releases nothing."""
        ...


class IpcLedger:
    """Every share made by this process is released exactly once, by this process.

    `share(holder, tensor)` returns the description and its release, which runs
    at the first of: being called, or `holder` (the producer's pin) being
    collected.  `shared` and `released` count both, so `shared - released` is
    what this process still keeps out of torch's reuse.
    """

    def __init__(self, ipc: DeviceIpc) -> None:
        self.ipc = ipc
        self.shared = 0
        self.released = 0

    def takes(self, tensor: torch.Tensor) -> bool:
        return self.ipc.takes(tensor)

    def share(
        self, holder: object, tensor: torch.Tensor
    ) -> tuple[dict[str, Any], Callable[[], object]]:
        description = self.ipc.share(tensor)
        self.shared += 1
        return description, weakref.finalize(holder, self._release, description)

    def _release(self, description: dict[str, Any]) -> None:
        self.released += 1
        self.ipc.release(description)

    def open(self, description: dict[str, Any]) -> torch.Tensor:
        return self.ipc.open(description)


class CudaIpc:
    """torch's CUDA IPC calls."""

    def takes(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        return describe(tensor)

    def release(self, description: dict[str, Any]) -> None:
        torch.UntypedStorage._release_ipc_counter(description["rc"], description["rcoff"])

    def open(self, description: dict[str, Any]) -> torch.Tensor:
        return open_tensor(description)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """The local index of the GPU with this UUID (visible devices only)."""
    if not torch.cuda.is_available():
        raise SchemaError("a CUDA handle cannot be opened: CUDA is not available here")
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise SchemaError(f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """The IPC description of a CUDA tensor; the producer must keep `tensor` alive."""
    storage = tensor.untyped_storage()
    (
        device,
        handle,
        storage_size,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "b": "cuda",
        "pid": os.getpid(),
        "uuid": device_uuid(device),
        "handle": handle,
        "size": storage_size,
        "soff": storage_offset,
        "rc": ref_counter_handle,
        "rcoff": ref_counter_offset,
        "event": event_handle,
        "sync": bool(event_sync_required),
        "off": tensor.storage_offset(),
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "dtype": DTYPE_NAMES[tensor.dtype],
    }


def open_tensor(d: dict[str, Any]) -> torch.Tensor:
    """Rebuild the tensor in this process, on the device with the recorded UUID.

    No counter is taken or released (module docstring): a storage already mapped
    here is reused, a new one is opened with NO_COUNTER.
    """
    from torch.multiprocessing.reductions import (
        StorageWeakRef,
        shared_cache,
        storage_from_cache,
    )

    device = device_index(d["uuid"])
    key = (d["handle"], d["soff"])
    storage = storage_from_cache(torch.UntypedStorage, key)
    if storage is None:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            device, d["handle"], d["size"], d["soff"], NO_COUNTER, 0, d["event"], d["sync"]
        )
        shared_cache[key] = StorageWeakRef(storage)
    tensor = torch.empty((0,), dtype=DTYPES[d["dtype"]], device=f"cuda:{device}")
    return tensor.set_(storage, d["off"], d["shape"], d["stride"])
