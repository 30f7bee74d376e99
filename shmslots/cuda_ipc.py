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
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .errors import SchemaError
from .torch_dtypes import DTYPE_NAMES, DTYPES


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
    """Rebuild the tensor in this process, on the device with the recorded UUID."""
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
            device, d["handle"], d["size"], d["soff"], d["rc"], d["rcoff"], d["event"], d["sync"]
        )
        shared_cache[key] = StorageWeakRef(storage)
    else:  # already mapped here: give the producer its ref-counter back
        torch.UntypedStorage._release_ipc_counter(d["rc"], d["rcoff"], device=device)
    tensor = torch.empty((0,), dtype=DTYPES[d["dtype"]], device=f"cuda:{device}")
    return tensor.set_(storage, d["off"], d["shape"], d["stride"])
