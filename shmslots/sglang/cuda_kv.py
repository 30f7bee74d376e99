"""GPU memory for the same-host engine: CUDA IPC of an allocation's base plus an offset.

SGLang registers raw pointers (its pools' `data_ptr()`s), not tensors, so torch's own
sharing (which starts from a storage) cannot describe them; the CUDA driver API can, from
the pointer alone.  Registering a device range asks the driver for the allocation that holds
it (`cuMemGetAddressRange`) and an IPC handle of that allocation; the peer opens the handle
once per allocation and writes at the range's offset in it.  Memory the legacy IPC cannot
share — VMM memory, as torch's `expandable_segments` and SGLang's `--enable-memory-saver`
make — is refused at registration where a peer would write it, with the reason, rather
than failing at a transfer; an engine that only sends (a prefill's) copies from any device
memory, VMM's too, in its own process.

The peer's allocation is opened in the context of the GPU that copies into it (the
source's), so between two GPUs that can reach each other the copy goes peer to peer.  A
transfer's copies are queued on a stream of the source's GPU, all in one driver call where the
driver has `cuMemcpyBatchAsync` (CUDA 12.8 and later; set SHMSLOTS_CUDA_BATCH=0 for the
other way), else one `cuMemcpyAsync` per block; the stream is synchronized before the call
returns, on error too: when `copy` returns or raises, no copy of it can still land.
The driver is loaded only when a registered range is not host memory, so a machine without
CUDA never loads it.

Devices are named by UUID, never by index: the two processes may see different
CUDA_VISIBLE_DEVICES.  This path runs only where a GPU is lent (tools/gpu_check.sh).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import ShmSlotsError

# cuda.h (CUpointer_attribute, CUmemorytype, CUresult)
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_MEMORYTYPE_DEVICE = 2
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_STREAM_NON_BLOCKING = 1
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3


class DeviceError(ShmSlotsError):
    """A CUDA call of the same-host engine failed, or device memory cannot be shared."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _CopyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (CUDA 12.8): the source read in stream order, both location hints
    (read for managed memory only) naming the copying GPU."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location_type", ctypes.c_int),
        ("src_location_id", ctypes.c_int),
        ("dst_location_type", ctypes.c_int),
        ("dst_location_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


@dataclass(frozen=True)
class DeviceRange:
    """A registered device range: its GPU's UUID, the IPC handle of the allocation holding
    it, and its offset in that allocation (all hex or ints, for the registry's JSON); a range
    only copied from, never shared, has neither handle nor offset."""

    uuid: str
    handle: str | None
    offset: int


class Driver:
    """The CUDA driver (libcuda), its primary contexts and this engine's streams."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._devices: dict[str, int] = {}  # uuid: this process's CUdevice
        self._contexts: dict[int, int] = {}  # CUdevice: its retained primary context
        self._idle: dict[int, list[ctypes.c_void_p]] = {}  # CUdevice: streams not in use
        self._check(lib.cuInit(0), "cuInit")
        # the 12.8 entry point, which libcuda keeps under this name (13.0's, without
        # failIdx, is cuMemcpyBatchAsync_v2)
        batch = getattr(lib, "cuMemcpyBatchAsync", None)
        self.batched = batch is not None and os.environ.get("SHMSLOTS_CUDA_BATCH") != "0"

    def _check(self, result: int, what: str) -> None:
        if result:
            raise self._error(result, what)

    def _error(self, result: int, what: str) -> DeviceError:
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(result, ctypes.byref(name))
        return DeviceError(f"{what} failed: {(name.value or b'?').decode()} ({result})")

    # -- devices and contexts -----------------------------------------------------------
    def _device(self, uuid: str) -> int:
        found = self._visible(uuid)
        if found is None:
            raise DeviceError(f"GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES)")
        return found

    def _visible(self, uuid: str) -> int | None:
        """This process's CUdevice of the GPU `uuid`, or None where it does not see it."""
        with self._lock:
            if not self._devices:
                count = ctypes.c_int()
                self._check(self._lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
                for ordinal in range(count.value):
                    self._devices[self._uuid_of(ordinal)] = self._ordinal_device(ordinal)
            return self._devices.get(uuid)

    def _ordinal_device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        return dev.value

    def _uuid_of(self, ordinal: int) -> str:
        uuid = _Uuid()
        dev = self._ordinal_device(ordinal)
        self._check(self._lib.cuDeviceGetUuid_v2(ctypes.byref(uuid), dev), "cuDeviceGetUuid")
        return bytes(uuid).hex()

    @contextlib.contextmanager
    def current(self, dev: int) -> Iterator[None]:
        """`dev`'s primary context (torch's) current on this thread, then the one before."""
        with self._lock:
            ctx = self._contexts.get(dev)
            if ctx is None:
                handle = ctypes.c_void_p()
                self._check(
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev),
                    "cuDevicePrimaryCtxRetain",
                )
                ctx = self._contexts[dev] = handle.value or 0
        self._check(self._lib.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    # -- the owner's side ---------------------------------------------------------------
    def describe(self, ptr: int, length: int, shared: bool = True) -> DeviceRange | None:
        """The device range at `ptr`, or None where `ptr` is not CUDA device memory;
        DeviceError where it is to be `shared` but cannot be shared by IPC, or runs past its
        allocation.  A range not shared is only copied from, in this process, where any
        device memory will do (VMM memory too: its mappings may span allocations).
        On a thread with no current context, under the first GPU's primary context."""
        ctx = ctypes.c_void_p()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            return self._describe(ptr, length, shared)
        with self.current(self._ordinal_device(0)):
            return self._describe(ptr, length, shared)

    def _describe(self, ptr: int, length: int, shared: bool) -> DeviceRange | None:
        ordinal = self._ordinal_at(ptr)
        if ordinal is None:
            return None
        if not shared:  # its last byte on the same GPU (a VMM range is not one allocation)
            if self._ordinal_at(ptr + length - 1) != ordinal:
                raise DeviceError(
                    f"{length} bytes at {ptr:#x} are not all device memory of one GPU"
                )
            return DeviceRange(self._uuid_of(ordinal), None, 0)
        dev = self._ordinal_device(ordinal)
        with self.current(dev):
            capable = ctypes.c_int()
            self._check(
                self._lib.cuPointerGetAttribute(
                    ctypes.byref(capable),
                    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                    ctypes.c_uint64(ptr),
                ),
                "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)",
            )
            if not capable.value:
                raise DeviceError(
                    f"{length} bytes at {ptr:#x} are device memory that CUDA IPC cannot share "
                    "(VMM memory, as torch's expandable_segments and SGLang's "
                    "--enable-memory-saver make, or a cudaMallocAsync pool's): register "
                    "memory from cudaMalloc (torch's caching allocator's default)"
                )
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            self._check(
                self._lib.cuMemGetAddressRange_v2(
                    ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
                ),
                "cuMemGetAddressRange",
            )
            if ptr + length > base.value + size.value:
                raise DeviceError(
                    f"{length} bytes at {ptr:#x} run past the end of their CUDA allocation "
                    f"({size.value} bytes at {base.value:#x})"
                )
            handle = _IpcHandle()
            self._check(
                self._lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle"
            )
        return DeviceRange(self._uuid_of(ordinal), bytes(handle).hex(), ptr - base.value)

    def _ordinal_at(self, ptr: int) -> int | None:
        """The ordinal of the GPU whose device memory holds `ptr`, or None where it is not
        device memory CUDA knows."""
        kind = ctypes.c_uint()
        got = self._lib.cuPointerGetAttribute(
            ctypes.byref(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(ptr)
        )
        if got in (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED):
            return None
        self._check(got, "cuPointerGetAttribute(MEMORY_TYPE)")
        if kind.value != CU_MEMORYTYPE_DEVICE:
            return None
        ordinal = ctypes.c_int()
        self._check(
            self._lib.cuPointerGetAttribute(
                ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(ptr)
            ),
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
        )
        return ordinal.value

    # -- the writer's side --------------------------------------------------------------
    def open(self, uuid: str, handle: str, owner: str) -> tuple[int, int, str]:
        """The peer's allocation `handle` (on the GPU `owner`) mapped here: (address, size,
        the GPU whose context holds the mapping, for `close`).  Opened in the context of
        the GPU `uuid` that copies into it (the sources'), which enables peer access, so the
        copy goes GPU to GPU, and the owner's GPU need not be visible here; where the two
        cannot reach each other, in the owner's context, and CUDA stages the copy through
        the host.  CUDA counts opens of one handle in one context; each is closed once."""
        dev = self._device(uuid)
        theirs = self._visible(owner)
        if theirs is not None and theirs != dev:
            can = ctypes.c_int()
            self._check(
                self._lib.cuDeviceCanAccessPeer(ctypes.byref(can), dev, theirs),
                "cuDeviceCanAccessPeer",
            )
            if not can.value:
                dev, uuid = theirs, owner
        raw = bytes.fromhex(handle)
        if len(raw) != ctypes.sizeof(_IpcHandle):
            raise DeviceError(f"a CUDA IPC handle is 64 bytes, not {len(raw)}")
        with self.current(dev):
            address = ctypes.c_uint64()
            self._check(
                self._lib.cuIpcOpenMemHandle_v2(
                    ctypes.byref(address),
                    _IpcHandle.from_buffer_copy(raw),
                    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                ),
                "cuIpcOpenMemHandle",
            )
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            got = self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address)
            if got:
                self._lib.cuIpcCloseMemHandle(address)
                self._check(got, "cuMemGetAddressRange")
        return address.value, size.value, uuid

    def close(self, uuid: str, address: int) -> None:
        with self.current(self._device(uuid)):
            self._check(
                self._lib.cuIpcCloseMemHandle(ctypes.c_uint64(address)), "cuIpcCloseMemHandle"
            )

    def copy(
        self, uuid: str, sources: np.ndarray, targets: np.ndarray, lengths: np.ndarray
    ) -> None:
        """Blocks of `lengths[i]` bytes from `sources[i]` to `targets[i]` (int64 arrays),
        queued on a stream of the GPU `uuid` (the sources') and waited for: on return or
        raise, none can still land.  The stream does not wait for others: the caller's
        sources must be complete (SGLang synchronizes its forward before it sends, as
        Mooncake and NIXL need too)."""
        dev = self._device(uuid)
        srcs, dsts, sizes = (
            np.ascontiguousarray(a, dtype=np.uint64) for a in (sources, targets, lengths)
        )
        # a batch's copies run in no set order: blocks whose targets overlap go one by one,
        # in order, so the later lands last (SGLang's never overlap)
        batch = self.batched and not overlapping(dsts, sizes)
        queue = self._queue_batch if batch else self._queue_each
        with self.current(dev), self._stream(dev) as stream:
            failure: DeviceError | None = None
            try:
                failure = queue(dev, srcs, dsts, sizes, stream)
            finally:
                synced = self._lib.cuStreamSynchronize(stream)  # whatever was queued ends here
            if failure is not None:
                raise failure
            self._check(synced, "cuStreamSynchronize")

    def _queue_each(
        self,
        dev: int,
        srcs: np.ndarray,
        dsts: np.ndarray,
        sizes: np.ndarray,
        stream: ctypes.c_void_p,
    ) -> DeviceError | None:
        """One `cuMemcpyAsync` per block; the first refusal ends the queueing."""
        for src, dst, n in zip(srcs.tolist(), dsts.tolist(), sizes.tolist(), strict=True):
            got = self._lib.cuMemcpyAsync(
                ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(n), stream
            )
            if got:
                return self._error(got, f"cuMemcpyAsync of {n} bytes to {dst:#x}")
        return None

    def _queue_batch(
        self,
        dev: int,
        srcs: np.ndarray,
        dsts: np.ndarray,
        sizes: np.ndarray,
        stream: ctypes.c_void_p,
    ) -> DeviceError | None:
        """Every block in one `cuMemcpyBatchAsync`, with one set of attributes."""
        count = len(sizes)
        if not count:
            return None
        attrs = _CopyAttributes(
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            CU_MEM_LOCATION_TYPE_DEVICE,
            dev,
            CU_MEM_LOCATION_TYPE_DEVICE,
            dev,
            0,
        )
        failed = ctypes.c_size_t(count)
        got = self._lib.cuMemcpyBatchAsync(
            ctypes.c_void_p(dsts.ctypes.data),
            ctypes.c_void_p(srcs.ctypes.data),
            ctypes.c_void_p(sizes.ctypes.data),  # size_t: a uint64 on every CUDA platform
            ctypes.c_size_t(count),
            ctypes.byref(attrs),
            (ctypes.c_size_t * 1)(0),
            ctypes.c_size_t(1),
            ctypes.byref(failed),
            stream,
        )
        if not got:
            return None
        at = failed.value
        where = f" (block {at}: {sizes[at]} bytes to {int(dsts[at]):#x})" if at < count else ""
        return self._error(got, f"cuMemcpyBatchAsync of {count} blocks{where}")

    @contextlib.contextmanager
    def _stream(self, dev: int) -> Iterator[ctypes.c_void_p]:
        """A stream of `dev` for one call, from a pool that holds as many as ever ran at
        once (threads come and go; streams are not made per thread)."""
        with self._lock:
            idle = self._idle.setdefault(dev, [])
            stream = idle.pop() if idle else None
        if stream is None:
            stream = ctypes.c_void_p()
            self._check(
                self._lib.cuStreamCreate(ctypes.byref(stream), CU_STREAM_NON_BLOCKING),
                "cuStreamCreate",
            )
        try:
            yield stream
        finally:
            with self._lock:
                self._idle[dev].append(stream)


def overlapping(targets: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether any two of the blocks at `targets` share a byte (such blocks must land in
    their call's order, so they are not copied side by side: here, and by the same-host
    engine's copy threads)."""
    order = np.argsort(targets, kind="stable")
    ends = (targets + lengths)[order]
    return bool(np.any(ends[:-1] > targets[order][1:]))


_driver: Driver | None = None
_loaded = False
_load_lock = threading.Lock()


def driver() -> Driver | None:
    """The process's CUDA driver, loaded on first use; None where there is none."""
    global _driver, _loaded
    with _load_lock:
        if not _loaded:
            _loaded = True
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError:
                return None
            try:
                _driver = Driver(lib)
            except DeviceError:  # a driver without a usable device
                _driver = None
        return _driver
