"""Prefill and decode on one host, each a spawned process running SGLang 0.5.23's own
transfer code: its manager, sender, receiver and bootstrap server, looked up by SGLang's
`get_kv_class` under the backend's name, over CPU KV pages, with the aux rows in SGLang's own
`MetadataBuffers` on the prefill side and in the plugin's shmslots table on the decode side.

What is SGLang's: `KVArgs`, the manager (`MooncakeKVManager`, under the backend), sender,
receiver, bootstrap server, `MetadataBuffers.set_buf`, the decode-side allocator and buffers
as its scheduler names them (the plugin's), `Req`.  What stands in, and why:
- the scheduler loops (`PrefillBootstrapQueue` / `DecodePreallocQueue` need a model): `Side`
  makes the calls they make, in their order: `try_ensure_parallel_info`, receiver `init`,
  `send_metadata`, sender `init`/`send`, `poll`, and on failure the deferred release
  (`failure_exception`, which clears the receiver, `ensure_abort_notified(force_arm=True)`,
  then `is_abort_release_safe`, as `DecodeTransferQueue.pop_transferred`, `_defer_release`
  and `resolve_deferred_releases` call them);
- the runtime context (no launcher): SGLang's `override_server_args` and the parallel ranks of
  each process (`get_parallel().override_permanently`): a prefill of `Shape.prefill_tp` ranks
  and a decode of `Shape.decode_tp`, a process each, the prefill's bootstrap server in its
  rank 0's;
- a PD role switch's scheduler (`Shape.role_switch`): `_tear_down_role` hands SGLang's
  `teardown_disaggregation` the parts of one it reads, and `switching_main` then builds the
  other role in the same process over the same pools.

Every KV byte is a function of (room, entry, page, offset), every aux row of the room, so the
decode side checks all it receives; a failed room's pages and slot are filled with a canary
when released and checked again later, so a write that lands after release is caught.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import numpy as np
import sglang_env as env
import torch

from shmslots.sglang import samehost
from shmslots.sglang.backend import WATCH_ENV

CANARY = 0xA5
HIDDEN, TOPK = 64, 4
STALL_S = 3.0  # a prefill run with no progress for this long gives up its rooms


@dataclass(frozen=True)
class Shape:
    """The KV layout both sides register: MHA (K and V entries per layer) or MLA (one)."""

    layers: int = 3
    pages: int = 64
    page_size: int = 4
    heads: int = 2
    head_dim: int = 16
    mla: bool = False
    backend: str = "shmslots"
    slots: int = 8  # aux rows (metadata slots) on the decode side
    late_write_window_s: float = 0.3
    verify: bool = True  # fill and check every byte (the benchmark moves them unread)
    nixl_params: str = ""  # SGLang's SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS (JSON)
    mooncake_batch: int = 0  # SGLang's SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES (pages)
    state: str = ""  # a state group beside the KV: "mamba" (conv and temporal rows), "swa", "dsa"
    device: str = "cpu"  # where the KV and state pools live ("cuda": tools/gpu_check.sh)
    vmm_prefill: bool = False  # the prefill's CUDA pools VMM memory, as expandable_segments'
    prefill_tp: int = 1  # prefill ranks (attention TP), each a process with its share of heads
    decode_tp: int = 1  # decode ranks, the same way
    rank: int = 0  # this process's rank within its side (Pair sets it)
    role_switch: bool = False  # SGLang's --enable-pd-role-switch (`switching_main`)

    @property
    def entries(self) -> int:
        return self.layers if self.mla else 2 * self.layers

    @property
    def item_len(self) -> int:  # bytes of one page of one entry (bf16)
        heads = 1 if self.mla else self.heads
        return self.page_size * heads * self.head_dim * 2

    def tp(self, mode: str) -> int:
        return self.prefill_tp if mode == "prefill" else self.decode_tp

    def rank_item_len(self, mode: str) -> int:
        """Bytes of one page of one entry in `mode`'s pools: a rank's share of the heads
        (SGLang slices heads between attention TP sizes, `send_kvcache_slice`); MLA's one
        latent is every rank's whole."""
        return self.item_len if self.mla else self.item_len // self.tp(mode)


MAMBA_DIMS = (6, 10)  # the TP-split dimension of one request's conv and temporal state
MAMBA_DIM_BYTES = 16  # bytes of each of those dims' rows (96 and 160 bytes a request whole)
SWA_LAYERS, SWA_PAGES = 2, 2  # sliding-window layers (K and V each), pages of the window
DSA_TOKEN_BYTES = 132  # DSA's indexer key of one token: 128 fp8 values and a float32 scale
STATE_ENTRY = 1000  # the state parts' entry numbers in `pattern`, after any KV entry's


def pattern(room: int, entry: int, page: int, item_len: int) -> torch.Tensor:
    """The bytes prefill sends for one page of one entry of `room`."""
    base = (room * 131 + entry * 17 + page * 7) % 256
    return ((torch.arange(item_len, dtype=torch.int64) + base) % 251).to(torch.uint8)


def _runtime(mode: str, shape: Shape, bootstrap_port: int) -> None:
    if _INSTANCE.role:  # a role switch: SGLang's flip of the one setting (role_switch.py)
        from sglang.srt.runtime_context import get_context

        get_context().override("role_switch.flip", disaggregation_mode=mode)
        _INSTANCE.role = mode
        return
    _INSTANCE.role = mode
    faulthandler.register(signal.SIGUSR1)  # Pair.reply asks for stacks when a side hangs
    faulthandler.enable()  # and a side that aborts (libzmq's asserts) prints its threads'
    env.load_sglang(plugin=True)
    from sglang.srt.runtime_context import get_context, get_parallel

    server_args = (
        get_context()
        .override_server_args(
            disaggregation_mode=mode,
            disaggregation_transfer_backend=shape.backend,
            disaggregation_bootstrap_port=bootstrap_port,
            enable_pd_role_switch=shape.role_switch,
            host="127.0.0.1",
            page_size=shape.page_size,
            tp_size=shape.tp(mode),
        )
        .install()
    )
    if shape.role_switch:  # the flag as launch's parser leaves it on the record, where the
        # managers read it (`_make_worker_recv`: receiving threads that poll, which teardown
        # can stop); the override above reaches only the resolved view (`get_disagg()`)
        import msgspec  # SGLang's

        msgspec.Struct.__setattr__(server_args, "enable_pd_role_switch", True)
    if shape.backend == "nixl":
        _nixl_under_its_import_name()
        if shape.nixl_params:
            os.environ["SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"] = shape.nixl_params
    if shape.mooncake_batch:  # read as the manager is made
        os.environ["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"] = str(shape.mooncake_batch)
    if shape.backend == "mooncake":  # its D2H-event path needs CUDA (prefill.py:1743-1760)
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as te

        MooncakeKVSender.supports_host_tensor_indices = False
        te.maybe_init_shared_mooncake_transfer_engine(gpu_id=0)  # as parallel_state does
    rank = shape.rank
    get_parallel().override_permanently(
        tp_rank=rank, attn_tp_rank=rank, attn_cp_rank=0, attn_dcp_rank=0, attn_dp_rank=0,
        pp_rank=0, dp_rank=0, moe_ep_rank=0, moe_tp_rank=0, moe_dp_rank=0, pp_group=None,
    )  # fmt: skip
    if shape.role_switch:  # SGLang then starts one on every instance, kept across flips
        _, cls = _classes(shape)  # (disagg_service.py:26-32)
        _INSTANCE.server = cls("BOOTSTRAP_SERVER")(host="127.0.0.1", port=bootstrap_port)


@dataclass
class _Instance:
    """This process's SGLang instance: its role once it has one, and under role switching
    the bootstrap server SGLang starts on every instance."""

    role: str = ""
    server: Any = None


_INSTANCE = _Instance()


def _nixl_under_its_import_name() -> None:
    """SGLang imports `nixl`, the meta-package that installs the build for a CUDA version
    and re-exports it; here that build is installed directly (`nixl-cu12`), the same API
    under `nixl_cu12`.  So its modules are entered under the meta-package's names."""
    import sys

    import nixl_cu12
    from nixl_cu12 import _api, _bindings

    sys.modules.setdefault("nixl", nixl_cu12)
    sys.modules.setdefault("nixl._api", _api)
    sys.modules.setdefault("nixl._bindings", _bindings)


def _kv_args(
    shape: Shape,
    mode: str,
    kv: list[torch.Tensor],
    aux: tuple[list[int], ...],
    state: list[torch.Tensor],
) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    args = get_kv_class(TransferBackend(shape.backend), KVClassType.KVARGS)()
    args.pp_rank = args.system_dp_rank = 0
    args.engine_rank = shape.rank
    args.kv_cache_dtype_str, args.kv_layout = "bfloat16", None
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.numel() for t in kv]
    args.kv_item_lens = [shape.rank_item_len(mode)] * shape.entries
    # NIXL registers by kind; SGLang says "VRAM" unless the pool is a host one (hisparse:
    # decode.py:629-633), and these pools are host memory
    args.kv_data_mem_kinds = ["DRAM"] * shape.entries
    args.kv_layer_ids = list(range(shape.layers)) * (1 if shape.mla else 2)
    args.num_draft_entries = 0
    args.total_kv_head_num = 1 if shape.mla else shape.heads
    args.kv_head_num = args.total_kv_head_num * shape.rank_item_len(mode) // shape.item_len
    args.page_size = shape.page_size
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = aux
    args.ib_device, args.gpu_id = None, 0
    args.state_types, args.state_data_ptrs, args.state_data_lens = [], [], []
    args.state_item_lens, args.state_layer_ids = [], []
    # as SGLang's kv_args builder labels an SWA pool's pages (utils.py:1554): NHD, the
    # default of its MHA pool, tokens x heads x dim
    args.swa_kv_cache_layout = "nhd" if shape.state == "swa" else None
    if state:
        from sglang.srt.disaggregation.base.conn import StateType

        args.state_data_ptrs = [[t.data_ptr() for t in state]]
        args.state_data_lens = [[t.numel() for t in state]]
        tp = shape.tp(mode)  # Mamba's dims tell SGLang how to split its rows between TP sizes
        args.state_dim_per_tensor = [_mamba_dims(tp)] if shape.state == "mamba" else []
        args.state_types = [StateType(shape.state)]
        args.state_item_lens = [list(_state_item_lens(shape, tp))]
        # Mamba's tensors and DSA's layers are paired by id; SWA's K and V by position
        args.state_layer_ids = [[] if shape.state == "swa" else list(range(len(state)))]
    args.prefill_start_layer, args.prefill_end_layer = 0, shape.layers
    return args


def _classes(shape: Shape) -> tuple[Any, Any]:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(shape.backend)
    return backend, lambda kind: get_kv_class(backend, getattr(KVClassType, kind))


def _manager(
    shape: Shape, mode: str, kv: list[torch.Tensor], aux: Any, state: list[torch.Tensor]
) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_server_args

    _, cls = _classes(shape)
    role = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    args = _kv_args(shape, mode, kv, aux, state)
    return cls("MANAGER")(args, role, get_server_args(), shape.mla)


def _kv(shape: Shape, mode: str) -> list[torch.Tensor]:
    n = shape.pages * shape.rank_item_len(mode)
    return [_pool(n, shape) for _ in range(shape.entries)]


@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (left as it is for None) while the block runs, then as before."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _shareable(pool: torch.Tensor) -> bool:
    """Whether CUDA IPC can share `pool` (not VMM memory)."""
    from shmslots.sglang import cuda_kv

    drv = cuda_kv.driver()
    assert drv is not None
    try:
        drv.describe(pool.data_ptr(), pool.numel())
    except cuda_kv.DeviceError:
        return False
    return True


def _pool(n: int, shape: Shape) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8, device=shape.device)


def _mamba_dims(tp: int) -> list[int]:
    """A rank's share of each Mamba state tensor's TP-split dimension, at attention TP `tp`."""
    return [d // tp for d in MAMBA_DIMS]


def _state_item_lens(shape: Shape, tp: int = 1) -> tuple[int, ...]:
    """Bytes of one index's item in each tensor of the state group, on a rank of attention
    TP `tp`: Mamba's conv and temporal rows (their dims split between ranks), SWA's K and V
    pages of its layers (their heads split, as the KV's), DSA's indexer-key page of each
    layer (fp8 keys and a float32 scale per token, DeepSeek-V3.2's 128 + 4 bytes)."""
    if shape.state == "mamba":
        return tuple(d * MAMBA_DIM_BYTES for d in _mamba_dims(tp))
    if shape.state == "swa":
        return (shape.item_len // tp,) * (2 * SWA_LAYERS)
    if shape.state == "dsa":
        return (shape.page_size * DSA_TOKEN_BYTES,) * shape.layers
    return ()


def _state(shape: Shape, mode: str) -> list[torch.Tensor]:
    """The state group's tensors, an item per KV page, so a room's state parts are found
    from its KV pages and, like them, reused only after the canary check."""
    return [_pool(shape.pages * n, shape) for n in _state_item_lens(shape, shape.tp(mode))]


def _state_indices(shape: Shape, pages: list[int]) -> list[list[int]] | None:
    """What a room's sender and receiver name of the state group: the Mamba row (its first
    page's), the SWA window (its last pages), or DSA's pages (the KV's own)."""
    if shape.state == "mamba":
        return [[pages[0]]]
    if shape.state == "swa":
        return [pages[-SWA_PAGES:]]
    if shape.state == "dsa":
        return [list(pages)]
    return None


def _state_parts(
    state: list[torch.Tensor], pages: list[int], shape: Shape, mode: str
) -> list[tuple[int, int, torch.Tensor]]:
    """(entry, part, bytes) of a room's state on a rank of `mode`: what prefill fills with
    its share of `pattern` and decode checks."""
    (indices,) = _state_indices(shape, pages) or [[]]
    lens = _state_item_lens(shape, shape.tp(mode))
    return [
        (k, j, t[i * n : (i + 1) * n])
        for k, (t, n) in enumerate(zip(state, lens, strict=True))
        for j, i in enumerate(indices)
    ]


def _state_share(room: int, k: int, j: int, shape: Shape, mode: str) -> torch.Tensor:
    """This rank's share of the `pattern` of a state part (entry `k`, part `j`)."""
    whole = pattern(room, STATE_ENTRY + k, j, _state_item_lens(shape)[k])
    if shape.state == "mamba":
        return _rank_rows(whole, 1, MAMBA_DIMS[k], shape, mode)
    if shape.state == "swa":
        return _rank_rows(whole, shape.page_size, shape.heads, shape, mode)
    return whole


@dataclass
class Outcome:
    """What the decode side saw of one room."""

    room: int
    status: str
    verified: bool = False
    failed_at: float = 0.0  # monotonic, when poll() first said Failed
    released_at: float = 0.0  # monotonic, when its pages and slot were let go
    required_acks: int = 0  # prefill ranks it waited on (0: none held its pages yet)
    acked: tuple[int, ...] = ()  # the ranks whose ABORT_ACK it had when released
    landed_at: float = 0.0  # monotonic, when poll() first said Success
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    reason: str = ""  # the failure SGLang recorded, if it was this receiver's to take
    asked: bool = False  # its metadata went to prefill (its handshake had not failed)
    given_up: bool = False  # aborted by the test's "give_up", still waiting then
    began_at: float = 0.0  # monotonic, when its receiver was made


Pools = tuple[list[torch.Tensor], list[torch.Tensor]]  # a side's KV and state pools


def prefill_main(
    conn: Connection, shape: Shape, bootstrap_port: int, sent: Any, pools: Pools | None = None
) -> Pools | None:
    """The prefill side: a bootstrap server and a manager; for each room it is told of, a
    sender that fills its own pages with the room's pattern and sends them.  It says, when
    up, whether CUDA IPC could share its pools (None on the CPU) and whether its engine
    receives (None but for shmslots').  Told to switch, it tears its role down as SGLang's
    PD role switch does and returns its pools (given `pools`, it took them over so)."""
    _runtime("prefill", shape, bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv, states = pools or (_kv(shape, "prefill"), _state(shape, "prefill"))
    buffers = env.SGLANG_CLASSES["buffers"](
        shape.slots, hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=16,
    )  # fmt: skip
    _, cls = _classes(shape)
    server = None  # a server's one bootstrap server, its first rank's here
    if shape.rank == 0 and not shape.role_switch:  # else the instance's (`_runtime`)
        server = cls("BOOTSTRAP_SERVER")(host="127.0.0.1", port=bootstrap_port)
    manager = _manager(shape, "prefill", kv, buffers.get_buf_infos(), states)
    shareable = _shareable(kv[0]) if shape.device == "cuda" else None
    receives = getattr(getattr(manager, "engine", None), "receives", None)
    conn.send(("up", os.getpid(), shareable, receives))
    addr = f"127.0.0.1:{bootstrap_port}"
    free_pages = list(range(shape.pages))
    free_slots = list(range(shape.slots))
    while True:
        msg = conn.recv()
        if msg[0] in ("stop", "switch"):
            break
        _, rooms, pages_per_room, window = msg
        todo = list(rooms)
        active: dict[int, tuple[Any, list[int], int, bool]] = {}
        done: dict[int, str] = {}
        sent_at: dict[int, float] = {}
        progress = time.monotonic()
        while todo or active:
            if time.monotonic() - progress > STALL_S:
                # no decode asks for these rooms (it died): abort them, as the bootstrap
                # timeout would, and start no more
                for sender, *_ in active.values():
                    sender.abort()
                todo.clear()
            while (
                todo and len(active) < window and len(free_pages) >= pages_per_room and free_slots
            ):
                room = todo.pop(0)
                sender = cls("SENDER")(manager, addr, room)
                pages = [free_pages.pop() for _ in range(pages_per_room)]
                active[room] = (sender, pages, free_slots.pop(), False)
            for room, (sender, pages, slot, started) in list(active.items()):
                state = sender.poll()
                if state == KVPoll.WaitingForInput and not started:
                    for e, t in enumerate(kv if shape.verify else ()):
                        for i, p in enumerate(pages):
                            _page(t, p, shape, "prefill").copy_(
                                _share(room, e, i, shape, "prefill")
                            )
                    for k, j, part in _state_parts(states, pages, shape, "prefill"):
                        part.copy_(_state_share(room, k, j, shape, "prefill"))
                    req = env.sglang_req(room, HIDDEN, TOPK)
                    req.metadata_buffer_index, req.bootstrap_room = slot, room
                    buffers.set_buf(req)
                    sender.init(len(pages), slot)
                    sender.send(
                        np.asarray(pages, dtype=np.int32),
                        state_indices=_state_indices(shape, pages),
                    )
                    active[room] = (sender, pages, slot, True)
                    sent_at[room] = time.monotonic()
                    sent.value += 1
                    progress = time.monotonic()
                elif state in (KVPoll.Success, KVPoll.Failed):
                    done[room] = "Success" if state == KVPoll.Success else "Failed"
                    sender.clear()
                    free_pages.extend(pages)
                    free_slots.append(slot)
                    del active[room]
                    progress = time.monotonic()
            time.sleep(0.0005)
        conn.send(("done", done, _refused(manager), sent_at))
    if msg[0] == "switch":
        _tear_down_role("prefill", manager, buffers)
        return kv, states
    getattr(manager, "close_engine", lambda: None)()  # the same-host engine's registry
    if server is not None:
        server.close()
    return None


def _tear_down_role(mode: str, manager: Any, buffers: Any, allocator: Any = None) -> None:
    """This side's role torn down by SGLang's own `teardown_disaggregation`, as its PD role
    switch does, over the scheduler's parts it reads (its queue's manager, the metadata
    buffers and allocator; no prefix cache here)."""
    from sglang.srt.disaggregation import role_switch
    from sglang.srt.disaggregation.utils import DisaggregationMode

    queue = SimpleNamespace(kv_manager=manager)
    role_switch.teardown_disaggregation(
        SimpleNamespace(
            disaggregation_mode=DisaggregationMode(mode),
            disagg_prefill_bootstrap_queue=queue,
            disagg_decode_prealloc_queue=queue,
            disagg_metadata_buffers=buffers,
            req_to_metadata_buffer_idx_allocator=allocator,
            disable_radix_cache=True,
        )
    )


def _refused(manager: Any) -> int:
    """Transfers the same-host engine refused as bad input (0 for another backend)."""
    return int(getattr(getattr(manager, "engine", None), "refused", 0))  # NIXL: no engine


def decode_main(
    conn: Connection, shape: Shape, bootstrap_port: int, landed: Any, pools: Pools | None = None
) -> Pools | None:
    """The decode side: the plugin's allocator and metadata buffers (a shmslots table), a
    manager and, for each room it is told of, a receiver over free pages and a free slot.
    Told to switch, it tears its role down as SGLang's PD role switch does and returns its
    pools (given `pools`, it took them over so)."""
    _runtime("decode", shape, bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.managers import scheduler

    kv, states = pools or (_kv(shape, "decode"), _state(shape, "decode"))
    allocator = scheduler.ReqToMetadataIdxAllocator(
        shape.slots, late_write_window_s=shape.late_write_window_s
    )
    buffers = scheduler.MetadataBuffers(
        shape.slots, hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=16, custom_mem_pool=None, kv_checksum_enabled=False,
        output_dsa_topk_indices_dim=0,
    )  # fmt: skip
    manager = _manager(shape, "decode", kv, buffers.get_buf_infos(), states)
    _, cls = _classes(shape)
    conn.send(("up", os.getpid(), buffers.table.name))
    free_pages = list(range(shape.pages))
    released: list[Outcome] = []
    while True:
        msg = conn.recv()
        if msg[0] in ("stop", "switch"):
            break
        if msg[0] == "give_up":  # came after the run it was for had ended
            continue
        if msg[0] == "settle":  # failed rooms' canaries intact; then their pages come back
            assert shape.verify, "settle checks the canaries, which only a checking run writes"
            intact = _canaries_intact(kv, states, released, shape)
            free_pages.extend(p for out in released for p in out.pages)
            released.clear()
            time.sleep(shape.late_write_window_s)
            allocator.sweep()  # the decode loop's beat: the failed rooms' slots are due now
            conn.send(("settled", intact, len(free_pages), allocator.available_size()))
            continue
        _, addrs, rooms, pages_per_room, window, abort_rooms, bad_rooms = msg
        deadline = time.monotonic() + 60
        while not all(manager.try_ensure_parallel_info(addr) for addr in addrs):
            if time.monotonic() > deadline:
                raise TimeoutError("no prefill bootstrap server")
            time.sleep(0.05)
        # a receiver of each room on each server: with two, each id is in flight twice, as
        # two clients' requests may be (ids are theirs to choose); outcomes by (room, server)
        todo = [(room, server) for room in rooms for server in range(len(addrs))]
        active: dict[Any, tuple[Any, Outcome, Any]] = {}
        outcomes: dict[Any, Outcome] = {}
        while todo or active:
            allocator.sweep()  # each turn, as the plugin does in resolve_deferred_releases
            if conn.poll():  # rooms that can no longer end are given up, as SGLang's waiting
                msg = conn.recv()  # timeout gives them up (300 s); or the test is over
                for receiver, out, _ in active.values():
                    if not out.failed_at:
                        out.given_up = True
                        receiver.abort()
                outcomes.update((key, Outcome(key[0], "NotStarted")) for key in todo)
                todo.clear()
            if todo and not active and len(free_pages) < pages_per_room:
                # every page is a failed room's, cooling until "settle": the rest never start
                outcomes.update((key, Outcome(key[0], "NotStarted")) for key in todo)
                todo.clear()
            while todo and len(active) < window and len(free_pages) >= pages_per_room:
                idx = allocator.alloc()
                if idx is None:
                    break
                key = todo.pop(0)
                room = key[0]
                req = SimpleNamespace(bootstrap_room=room, rid=key)
                allocator.bind(req, idx)
                pages = [free_pages.pop() for _ in range(pages_per_room)]
                receiver = cls("RECEIVER")(manager, addrs[key[1]], room)
                receiver.init(0)
                asked = [*pages[:-1], shape.pages + 3] if room in bad_rooms else pages
                out = Outcome(room, "", pages=pages, slot=idx, began_at=time.monotonic())
                if receiver.poll() != KVPoll.Failed:  # DecodePreallocQueue skips a failed one
                    receiver.send_metadata(
                        np.asarray(asked, dtype=np.int32), idx, _state_indices(shape, pages)
                    )
                    out.asked = True
                active[key] = (receiver, out, req)
            for key, (receiver, out, req) in list(active.items()):
                room = key[0]
                if room in abort_rooms and not out.failed_at:
                    abort_rooms.discard(room)
                    receiver.abort()
                state = receiver.poll()
                if state == KVPoll.Success:
                    out.status, out.landed_at = "Success", time.monotonic()
                    out.verified = _verify(kv, states, buffers, allocator, req, out, shape)
                    free_pages.extend(out.pages)
                    receiver.clear()
                    landed.value += 1
                elif state == KVPoll.Failed:
                    if not out.failed_at:
                        out.failed_at = time.monotonic()
                        # DecodeTransferQueue.pop_transferred's failed path, in its order: the
                        # receiver cleared (SGLang forgets the room), then the ABORT; then
                        # _defer_release
                        try:
                            receiver.failure_exception()
                        except KVTransferError as exc:
                            out.reason = str(exc)
                        if out.asked:  # else the handshake's failure (decode.py:1158): no
                            receiver.ensure_abort_notified(force_arm=True)  # ABORT, no hold
                        out.status = "Failed"
                    required = len(receiver.bootstrap_infos or ()) if receiver.abort_notified else 0
                    out.required_acks = required
                    if out.asked and not manager.is_abort_release_safe(room, required):
                        if time.monotonic() - out.failed_at < 30:
                            continue
                        out.status = "Failed-timeout"
                    # _do_release: pages, metadata slot, deferred state, receiver
                    out.released_at = time.monotonic()
                    acks = manager._deferred_abort_ack_tracker.get(room)  # SGLang's count
                    out.acked = tuple(sorted(acks.prefill_ranks)) if acks else ()
                    _fill_canary(kv, states, out, shape)
                    buffers.clear_slot(out.slot)
                    allocator.free(out.slot)
                    if out.asked:
                        manager.clear_deferred_abort_state(room)
                    receiver.clear()
                    released.append(out)  # its pages come back at "settle", after the check
                else:
                    continue
                outcomes[key] = out
                del active[key]
            time.sleep(0.0005)
        conn.send(("done", outcomes if len(addrs) > 1 else {k[0]: o for k, o in outcomes.items()}))
        if msg[0] == "stop":  # it came during the run
            break
    if msg[0] == "switch":
        _tear_down_role("decode", manager, buffers, allocator)
        return kv, states
    getattr(manager, "close_engine", lambda: None)()  # the same-host engine's registry
    buffers.close()
    return None


def switching_main(conn: Connection, shape: Shape, bootstrap_port: int, counters: Any) -> None:
    """One SGLang instance taking both roles in turn over its one set of pools, as SGLang's
    PD role switch flips an idle server, with its one bootstrap server at `bootstrap_port`
    throughout: `counters` is (its first role, the prefill's sent count, the decode's landed
    count)."""
    role, sent, landed = counters
    pools: Pools | None = None
    try:
        while True:
            if role == "prefill":
                pools = prefill_main(conn, shape, bootstrap_port, sent, pools)
            else:
                pools = decode_main(conn, shape, bootstrap_port, landed, pools)
            if pools is None:
                return
            role = "decode" if role == "prefill" else "prefill"
    finally:
        if _INSTANCE.server is not None:
            _INSTANCE.server.close()


def _bare_decode(conn: Connection, shape: Shape, bootstrap_port: int) -> tuple[Any, Any, Any]:
    """A decode side's manager, the plugin's buffers and the backend's classes, said up."""
    _runtime("decode", shape, bootstrap_port)
    from sglang.srt.managers import scheduler

    scheduler.ReqToMetadataIdxAllocator(shape.slots)  # the plugin's buffers come after it
    buffers = scheduler.MetadataBuffers(
        shape.slots, hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=16, custom_mem_pool=None, kv_checksum_enabled=False,
        output_dsa_topk_indices_dim=0,
    )  # fmt: skip
    manager = _manager(
        shape, "decode", _kv(shape, "decode"), buffers.get_buf_infos(), _state(shape, "decode")
    )
    _, cls = _classes(shape)
    conn.send(("up", os.getpid(), buffers.table.name))
    return manager, buffers, cls


def ids_main(conn: Connection, shape: Shape, bootstrap_port: int, _: Any) -> None:
    """A decode side that plays room ids' lives in SGLang's order, in its scheduler thread's
    calls, beside a prefill server that has no request of its own: a request made while
    another of its id is in flight; a retry of an id, failed before it asked for pages, and
    a retry of that retry made before SGLang's second clear of the failed one (its sweep);
    a retry made while a failed receiver that asked for pages awaits its release, and one
    after; a rank's death noted after its receiver was done and its id taken again."""
    manager, buffers, cls = _bare_decode(conn, shape, bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    def reason(receiver: Any) -> str:
        try:
            receiver.failure_exception()  # the decode's handshake- or transfer-failed path
        except KVTransferError as exc:
            return str(exc.failure_reason)
        return ""

    room, addr = 7, f"127.0.0.1:{bootstrap_port}"
    first = cls("RECEIVER")(manager, addr, room)
    second = cls("RECEIVER")(manager, addr, room)  # the same id, the first in flight
    facts: dict[str, Any] = {
        "failed": [first.poll() == KVPoll.Failed, second.poll() == KVPoll.Failed],
        # the prealloc queue (the refused one's) is polled before the transfer queue
        "reasons": [reason(second), reason(first)],
    }
    first.clear()  # its release
    retry = cls("RECEIVER")(manager, addr, room)
    facts["retry"] = retry.poll() == KVPoll.Bootstrapping
    retry.abort()
    reason(retry)  # failed: SGLang clears it here, and holds it for its release
    again = cls("RECEIVER")(manager, addr, room)  # the client retries at once
    retry.clear()  # _do_release: the failed one's second clear
    facts["again"] = again.poll() == KVPoll.Bootstrapping
    again.clear()
    while not manager.try_ensure_parallel_info(addr):
        time.sleep(0.05)
    asked = cls("RECEIVER")(manager, addr, 9)
    asked.init(0)  # bootstraps to the prefill
    asked.send_metadata(np.arange(3, dtype=np.int32), 0, None)  # its pages, asked for
    asked.abort()  # the ABORT goes to the prefill
    reason(asked)  # failed: SGLang clears it here, and holds it until the prefill's ACK
    early = cls("RECEIVER")(manager, addr, 9)  # a retry while it is held
    twice = cls("RECEIVER")(manager, addr, 9)  # and another, the first refused in the table
    facts["retry_while_held"] = [early.poll() == KVPoll.Failed, reason(early), reason(twice)]
    early.clear()  # the prealloc queue's sweep
    twice.clear()
    # nothing of theirs is left for a later request of the id: no status, no stale reason
    facts["left_after_refusals"] = [9 in manager.request_status, 9 in manager.failure_records]
    asked.clear()  # _do_release
    late = cls("RECEIVER")(manager, addr, 9)  # a retry once it is released
    facts["retry_once_released"] = late.poll() == KVPoll.Bootstrapping
    late.clear()
    # a receiver done with its id, whose prefill rank then dies while a new request holds
    # the id: the death is not the new one's
    done = cls("RECEIVER")(manager, addr, 8)
    done.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": bootstrap_port}]
    done.clear()
    new = cls("RECEIVER")(manager, addr, 8)
    manager._note_dead(done.bootstrap_infos)  # as the watcher notes a dead rank's entries
    facts["new_after_death"] = new.poll() == KVPoll.Bootstrapping
    new.clear()
    conn.send(("facts", facts))
    assert conn.recv() == ("stop",)
    manager.close_engine()
    buffers.close()


def forgotten_main(conn: Connection, shape: Shape, bootstrap_port: int, _: Any) -> None:
    """A decode side with a room in flight (its pages asked for) whose prefill's entries
    SGLang has forgotten: another request of the same server timed out waiting
    (`_check_waiting_timeout` -> `invalidate_cached_bootstrap_infos`) and was released at
    the prefill's ACK, as SGLang's decode does.  Then told of a prefill rank's SIGKILL,
    it says how long the room took to fail."""
    manager, buffers, cls = _bare_decode(conn, shape, bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = f"127.0.0.1:{bootstrap_port}"
    while not manager.try_ensure_parallel_info(addr):
        time.sleep(0.05)
    flight = cls("RECEIVER")(manager, addr, 1)
    flight.init(0)
    flight.send_metadata(np.arange(3, dtype=np.int32), 0, None)
    late = cls("RECEIVER")(manager, addr, 2)
    late.init(0)
    late.send_metadata(np.arange(3, 6, dtype=np.int32), 1, None)
    late.init_time -= manager.waiting_timeout + 1  # it waited past SGLang's timeout
    assert late.poll() == KVPoll.Failed
    with contextlib.suppress(Exception):
        late.failure_exception()  # as DecodeTransferQueue's failed path: its ABORT
    deadline = time.monotonic() + 10
    while not manager.is_abort_release_safe(2, len(late.bootstrap_infos)):
        assert time.monotonic() < deadline, "no ACK for the timed-out room"
        time.sleep(0.005)
    manager.clear_deferred_abort_state(2)  # SGLang's _do_release
    late.clear()
    del late
    forgotten = not any(k.startswith(f"{addr}_") for k in manager.connection_pool)
    time.sleep(0.2)  # the watcher's looks at the live ranks
    conn.send(("in flight", forgotten, str(flight.poll())))
    _, killed = conn.recv()
    while flight.poll() != KVPoll.Failed and time.monotonic() - killed < 20:
        time.sleep(0.005)
    conn.send(("failed after", flight.poll() == KVPoll.Failed, time.monotonic() - killed))
    assert conn.recv() == ("stop",)
    flight.clear()
    manager.close_engine()
    buffers.close()


def window_main(conn: Connection, shape: Shape, bootstrap_port: int, _: Any) -> None:
    """A decode side whose watcher looks only when told, with a room bootstrapped in the
    window between its look at SGLang's tables and SGLang's failing of a dead prefill's
    rooms (on a busy decode, the scheduler thread's receivers race the watcher there)."""
    os.environ[WATCH_ENV] = "3600"  # no look but this function's: the window on demand
    manager, buffers, cls = _bare_decode(conn, shape, bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = f"127.0.0.1:{bootstrap_port}"
    while not manager.try_ensure_parallel_info(addr):
        time.sleep(0.05)
    early = cls("RECEIVER")(manager, addr, 1)
    early.init(0)  # bootstraps, and SGLang caches the prefill's ranks
    manager._check_prefills()  # sees them alive
    conn.send(("bootstrapped",))
    assert conn.recv() == ("prefill killed",)
    late: list[Any] = []
    handle_node_failure = manager._handle_node_failure

    def in_the_window(failed: str) -> None:
        late.append(cls("RECEIVER")(manager, addr, 2))
        late[0].init(0)  # from SGLang's cache: the dead prefill's ranks
        handle_node_failure(failed)

    manager._handle_node_failure = in_the_window
    manager._check_prefills()
    [receiver] = late
    failed = [r.poll() == KVPoll.Failed for r in (early, receiver)]  # SGLang failed both
    receiver.ensure_abort_notified(force_arm=True)  # as DecodeTransferQueue's failed path
    facts = {
        "statuses": failed,
        "safe": [
            manager.is_abort_release_safe(room, len(r.bootstrap_infos))
            for room, r in ((1, early), (2, receiver))
        ],
        "marked": manager.writers_gone(2),  # the room itself, for SGLang's release check
        "armed": receiver._abort_generation is not None,  # an ACK awaited: none can come
        # the same ranks in entries of their own: one bootstrapped afresh keeps SGLang's path
        "fresh_entries_gone": manager.writers_gone(
            3, SimpleNamespace(bootstrap_infos=[dict(e) for e in receiver.bootstrap_infos])
        ),
    }
    # another receiver of room 1's id with entries of its own, not known dead, as a retry's
    # bootstrapped from a live server would hold (this one, made while room 1 is in flight,
    # is refused as a duplicate, and its entries are set by hand).  A release asked by the
    # id must wait for it, and need not once SGLang has let go of it
    twin = cls("RECEIVER")(manager, addr, 1)
    twin.bootstrap_infos = [dict(e) for e in early.bootstrap_infos]
    required = len(early.bootstrap_infos)
    facts["beside_a_live_twin"] = [
        manager.is_abort_release_safe(1, required),
        manager.writers_gone(1),
    ]
    twin.clear()
    del twin
    gc.collect()
    facts["once_let_go"] = [manager.is_abort_release_safe(1, required), manager.writers_gone(1)]
    for r in (early, receiver):
        r.clear()
    conn.send(("facts", facts))
    assert conn.recv() == ("stop",)
    manager.close_engine()
    buffers.close()


def _page(t: torch.Tensor, page: int, shape: Shape, mode: str = "decode") -> torch.Tensor:
    n = shape.rank_item_len(mode)
    return t[page * n : (page + 1) * n]


def _share(room: int, entry: int, page: int, shape: Shape, mode: str) -> torch.Tensor:
    """This rank's heads of a page's `pattern` (a page is tokens x heads x dim; MLA's one
    latent is every rank's whole)."""
    whole = pattern(room, entry, page, shape.item_len)
    return whole if shape.mla else _rank_rows(whole, shape.page_size, shape.heads, shape, mode)


def _rank_rows(whole: torch.Tensor, outer: int, rows: int, shape: Shape, mode: str) -> torch.Tensor:
    """This rank's share of an item laid out as outer x rows x bytes, its rows split between
    `mode`'s attention TP ranks, as SGLang splits KV heads and Mamba state dims."""
    per = rows // shape.tp(mode)
    by_row = whole.view(outer, rows, -1)
    return by_row[:, shape.rank * per : (shape.rank + 1) * per].reshape(-1)


def _verify(
    kv: list[torch.Tensor],
    state: list[torch.Tensor],
    buffers: Any,
    allocator: Any,
    req: Any,
    out: Outcome,
    shape: Shape,
) -> bool:
    """Every KV byte, the state rows and the aux row are the room's; the slot is then
    consumed and released."""
    ok = all(
        torch.equal(_page(t, p, shape).cpu(), _share(out.room, e, i, shape, "decode"))
        for e, t in enumerate(kv if shape.verify else ())
        for i, p in enumerate(out.pages)
    )
    ok = ok and all(
        torch.equal(part.cpu(), _state_share(out.room, k, j, shape, "decode"))
        for k, j, part in (_state_parts(state, out.pages, shape, "decode") if shape.verify else ())
    )
    output_ids, *_, topk_p, topk_index, hidden, _dsa, room = buffers.get_buf(out.slot)
    want_p, want_i, want_h = env.expected_draft(out.room, HIDDEN, TOPK)
    ok = ok and int(room[0]) == out.room and int(output_ids[0]) == out.room % 50_000
    ok = ok and torch.equal(topk_p[:TOPK], want_p) and torch.equal(topk_index[:TOPK], want_i)
    ok = ok and torch.equal(hidden, want_h)
    del output_ids, topk_p, topk_index, hidden, room, _
    buffers.clear_slot(out.slot)
    allocator.free(out.slot)
    allocator.release_consumed([req])
    return ok


def _released(
    kv: list[torch.Tensor], state: list[torch.Tensor], out: Outcome, shape: Shape
) -> Iterator[torch.Tensor]:
    """The bytes a released room owned: its pages of every entry, and its state parts."""
    yield from (_page(t, p, shape) for t in kv for p in out.pages)
    yield from (part for _, _, part in _state_parts(state, out.pages, shape, "decode"))


def _fill_canary(
    kv: list[torch.Tensor], state: list[torch.Tensor], out: Outcome, shape: Shape
) -> None:
    """A released room's pages and state rows get the canary (its aux slot is the plugin's
    to guard: a failed slot is quarantined for the late-write window, tests/test_sglang.py).
    Not when the bytes go unchecked (the benchmark): a decode fills nothing at release, and
    the fill (128 MiB a 1k-token room of 32 layers) would delay the next room's release."""
    for part in _released(kv, state, out, shape) if shape.verify else ():
        part.fill_(CANARY)


def _canaries_intact(
    kv: list[torch.Tensor], state: list[torch.Tensor], released: list[Outcome], shape: Shape
) -> bool:
    """No byte landed in a released room's pages or state rows after its release (neither
    reused since)."""
    return all(
        bool((part == CANARY).all())
        for out in released
        for part in _released(kv, state, out, shape)
    )


class Pair:
    """A prefill server and a decode server on one host, a process per rank; every process
    it starts is killed and reaped on exit, whatever happened."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.ctx = mp.get_context("spawn")
        self.port = env.free_port()
        self.sent = self.ctx.Value("i", 0)
        self.landed = self.ctx.Value("i", 0)
        self.procs: list[mp.process.BaseProcess] = []  # every process it started
        self.prefill_procs: list[mp.process.BaseProcess] = []  # the servers' now, by rank
        self.decode_procs: list[mp.process.BaseProcess] = []
        self.prefill: Connection | None = None  # rank 0's, of `prefills`
        self.prefills: list[Connection] = []
        self.second: Connection | None = None  # a second prefill server's, if started
        self.second_port = 0
        self.decode: Connection | None = None  # rank 0's, of `decodes`
        self.decodes: list[Connection] = []
        self.decode_table = ""
        self.other_port = 0  # under role switching, the decode instance's bootstrap port
        self.prefill_shareable: bool | None = None  # what the prefill said when up
        self.prefill_receives: bool | None = None

    def _start(
        self, target: Any, counter: Any, shape: Shape | None = None, port: int | None = None
    ) -> tuple[Connection, Any, tuple[Any, ...]]:
        parent, child = self.ctx.Pipe()
        shape = shape or self.shape
        port = port or self.port
        proc = self.ctx.Process(target=target, args=(child, shape, port, counter))
        proc.start()
        self.procs.append(proc)
        child.close()  # so that its death on the way up is an EOF here, not a wait
        if not parent.poll(120):
            raise TimeoutError(f"{target.__name__} did not come up")
        try:
            return parent, proc, parent.recv()
        except EOFError:
            proc.join(10)
            raise RuntimeError(
                f"{target.__name__} died on the way up (exit code {proc.exitcode})"
            ) from None

    def start_prefill(self) -> None:
        # torch reads its allocator's settings from the environment the prefill starts with
        vmm = "expandable_segments:True" if self.shape.vmm_prefill else None
        self.prefills, self.prefill_procs = [], []  # a server started again replaces the last
        with _environ("PYTORCH_CUDA_ALLOC_CONF", vmm):
            for rank in range(self.shape.prefill_tp):  # rank 0 first: its bootstrap server
                shape = dataclasses.replace(self.shape, rank=rank)
                conn, proc, up = self._start(prefill_main, self.sent, shape)
                self.prefills.append(conn)
                self.prefill_procs.append(proc)
        self.prefill = self.prefills[0]
        self.prefill_shareable, self.prefill_receives = up[2], up[3]

    def start_switching(self) -> None:
        """Two instances under SGLang's PD role switch, a prefill and a decode, each with
        its own bootstrap server and able to take the other's role (`switch_roles`)."""
        assert self.shape.role_switch
        self.prefill, proc, up = self._start(switching_main, ("prefill", self.sent, self.landed))
        self.prefills, self.prefill_procs = [self.prefill], [proc]
        self.prefill_shareable, self.prefill_receives = up[2], up[3]
        self.other_port = env.free_port()  # the decode's bootstrap server, idle until it flips
        self.decode, proc, up = self._start(
            switching_main, ("decode", self.sent, self.landed), port=self.other_port
        )
        self.decodes, self.decode_procs, self.decode_table = [self.decode], [proc], up[2]

    def switch_roles(self) -> None:
        """Each instance takes the other's role in its own process, as SGLang's PD role
        switch flips idle servers; rooms then go to the new prefill's bootstrap server."""
        assert self.prefill is not None and self.decode is not None
        self.prefill.send(("switch",))
        table = self.reply(self.prefill)[2]
        self.decode.send(("switch",))
        up = self.reply(self.decode)
        self.prefill_shareable, self.prefill_receives = up[2], up[3]
        self.prefill, self.decode = self.decode, self.prefill
        self.prefills, self.decodes, self.decode_table = [self.prefill], [self.decode], table
        self.prefill_procs, self.decode_procs = self.decode_procs, self.prefill_procs
        self.port, self.other_port = self.other_port, self.port

    def start_second_prefill(self) -> None:
        """Another prefill server (one rank) at its own bootstrap port, beside the first."""
        self.second_port = env.free_port()
        self.second, _, _ = self._start(prefill_main, self.sent, port=self.second_port)

    def start_decode(self, target: Any = decode_main) -> None:
        self.decodes, self.decode_procs = [], []  # a server started again replaces the last
        for rank in range(self.shape.decode_tp):
            shape = dataclasses.replace(self.shape, rank=rank)
            conn, proc, up = self._start(target, self.landed, shape)
            self.decodes.append(conn)
            self.decode_procs.append(proc)
            if rank == 0:
                self.decode_table = up[2]
        self.decode = self.decodes[0]

    def submit(
        self,
        rooms: list[int],
        pages: int,
        window: int,
        abort: frozenset[int] = frozenset(),
        bad: frozenset[int] = frozenset(),
    ) -> None:
        """Both sides get the rooms (as SGLang's router would tell them); decode aborts the
        `abort` rooms mid-transfer and asks for a page past its pool's end for the `bad`.
        With a second prefill server up, each room goes to both, under the same id."""
        assert self.prefills and self.decode is not None
        addrs = [f"127.0.0.1:{self.port}"]
        for conn in self.prefills:
            conn.send(("run", rooms, pages, window))
        if self.second is not None:
            self.second.send(("run", rooms, pages, window))
            addrs.append(f"127.0.0.1:{self.second_port}")
        for conn in self.decodes:
            conn.send(("run", addrs, rooms, pages, window, set(abort), bad))

    def reply(self, conn: Connection | None, timeout: float = 90) -> Any:
        assert conn is not None
        if not conn.poll(timeout):
            for proc in self.procs:  # their stacks, on stderr, for the report
                if proc.is_alive() and proc.pid is not None:
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1)
            raise TimeoutError("no reply")
        return conn.recv()

    def give_up(self) -> None:
        """Each decode rank aborts the rooms it still waits for and starts no more."""
        for conn in self.decodes:
            conn.send(("give_up",))

    def settle(self) -> tuple[bool, int, int] | list[tuple[bool, int, int]]:
        """(canaries intact, pages free, slots free) of the decode's ranks: one tuple when
        every rank says the same, else each rank's."""
        for conn in self.decodes:
            conn.send(("settle",))
        settled = [tuple(self.reply(conn)[1:]) for conn in self.decodes]
        return settled[0] if len(set(settled)) == 1 else settled

    def wait_until(self, counter: Any, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while counter.value < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"counter at {counter.value}, not {n}")
            time.sleep(0.001)

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in [*self.prefills, self.second, *self.decodes]:
            try:
                if conn is not None:
                    conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        samehost.sweep()  # the registries of the sides the test killed
