"""`--disaggregation-transfer-backend shmslots`: SGLang 0.5.23's own Mooncake manager, moving
its bytes through `SameHostEngine` instead of Mooncake's, for prefill and decode on one host.

Everything but the bytes is SGLang's, unchanged: bootstrap, ZMQ messages, room states, TP/PP
and head-slice mapping, state buffers, deferred-release ACKs, heartbeats.  The manager is a
subclass of `MooncakeKVManager` that relies on these of its (0.5.23) methods:

- `init_engine` (overridden): the engine is this host's, named after the manager's ZMQ port,
  so a decode can find the registry of each prefill rank it talks to; a prefill's only sends
  (no peer may write into it, and its KV may be VMM memory, which CUDA IPC cannot share);
- `register_to_bootstrap` (extended): a prefill makes its engine first, so that any rank a
  decode can fetch from the bootstrap server has its registry: a name whose registry is dead
  at a look made after the fetch names a dead rank, the one the entry was fetched from;
- `_poison_unsettled_send` (overridden): Mooncake poisons a failed room because its timed-out
  batch may still be writing; `SameHostEngine` returns only when no write can still land, so
  a failed or aborted room is acknowledged at once and decode frees its pages at once;
- `_handle_node_failure` (called) and `is_abort_release_safe` (extended, decode side): a
  watcher thread reads every known prefill rank's registry lock, and whether its owner has
  begun to exit, every `SHMSLOTS_PD_WATCH_S` (0.02 s); a dead rank fails its server's rooms
  as SGLang's heartbeat would after 2 x 5 s, and when every rank of that server is dead
  those rooms are safe to release at once, since a dead process writes nothing (save a
  room id that a live receiver of another server holds: clients choose ids); a
  heartbeat's failure, which cannot tell dead from slow, keeps SGLang's own path;
- `_deferred_abort_ack_tracker` (read): SGLang counts a room's ABORT_ACKs against the
  number of ranks it aborted, so a dead rank's missing ACK held the room for the timeout;
  here a room is safe once each rank its ABORT went to has acked this generation or is
  dead.  The watcher looks at the ranks of every room awaiting ACKs, since SGLang forgets
  a failed server's ranks, and a failed room's (`clear`) before it sends the ABORT;
- `_send_abort_notification` (overridden) and `bootstrap_infos` (read), receiver: a room
  whose ranks are all dead sends no ABORT, and one bootstrapped after the watcher's look is
  told as the dead ranks' by its rank entries, SGLang's cached ones.  This relies on
  `_handle_node_failure` deleting every cached entry of the server under its lock, and on
  a receiver listing its room (`__init__`) before it reads that cache (`init`);
- `_get_bootstrap_info_from_server` (extended), receiver: each rank entry carries the rank
  number the rank's ACKs carry (`_prefill_unique_rank`), from the prefill's sizes;
- `teardown` (extended): the engine's registry goes with the manager.

The decode side's aux buffers are the plugin's shmslots table (`DecodeMetadataBuffers`),
whose columns lie in `/dev/shm`: the prefill writes each aux row straight into the decode's
slot through its own mapping of that segment, and the slot keeps the plugin's rules.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import threading
import weakref
from collections.abc import Container, Iterable, Sequence
from typing import Any

from ..segment import SHM_DIR
from .samehost import PREFIX, PeerRegistry, SameHostEngine

NAME = "shmslots"
WATCH_ENV = "SHMSLOTS_PD_WATCH_S"
DEAD_RANK_ENTRIES = 1024  # dead prefills' rank entries remembered, told by identity
DEAD_ROOMS = 1 << 16  # rooms `_RoomMarks` and `_Aborts` keep, the newest: far more than in flight
ACK_RANK = "shmslots_ack_rank"  # a bootstrap entry's rank, as its ABORT_ACKs number it
UTILS = "sglang.srt.disaggregation.utils"

log = logging.getLogger(__name__)


def registry_name(ip: str, port: int) -> str:
    """The registry of the manager listening at ip:port on this host."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{ip}-{port}")


def _rank_registry(entry: dict[str, Any]) -> str:
    """The registry of the prefill rank a bootstrap entry names."""
    return registry_name(str(entry["rank_ip"]), int(entry["rank_port"]))


def register_hooks() -> None:
    """Add `shmslots` to SGLang's transfer backends: the parser's choices, the enum (same
    members plus SHMSLOTS, propagated to every module that imported it) and `get_kv_class`."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    original = utils.TransferBackend
    if not hasattr(original, "SHMSLOTS"):
        members = {m.name: m.value for m in original} | {"SHMSLOTS": NAME}
        extended = enum.Enum(  # type: ignore[misc]
            original.__name__, members, module=original.__module__, qualname=original.__qualname__
        )
        HookRegistry.register(f"{UTILS}.TransferBackend", extended, HookType.REPLACE)
    HookRegistry.register(f"{UTILS}.get_kv_class", _get_kv_class, HookType.AROUND)


class _DeadSessions(set[str]):
    """Mooncake's manager blacklists a decode session after any failed transfer, since a
    network engine cannot tell a dead peer from a refused write; this engine can, so a
    session is blacklisted only while its engine is gone."""

    def __init__(self, engine: SameHostEngine) -> None:
        super().__init__()
        self.engine = engine

    def add(self, session: str) -> None:
        if self.engine.send_probe(session) != 0:
            super().add(session)


class _RoomMarks:
    """Rooms the watcher found every writer of dead, each with the prefill server (bootstrap
    address) that died, and the live receivers of each room id with their servers.  SGLang
    keys rooms by id alone and clients may choose ids, so a room id may be held by
    receivers of two servers at once: a release asked by the id must then be safe for each
    (`alone`).  A receiver registers (`hold`) before SGLang lists its room, so a watcher's
    look that sees the room sees the receiver.

    A mark goes when SGLang releases its room (`clear_deferred_abort_state`), or when the room
    is bootstrapped afresh.  With deferred release off SGLang never clears a room, so only
    the newest DEAD_ROOMS marks are kept: a decode whose prefills keep dying does not grow
    without end.  The watcher thread marks, the scheduler thread holds, marks, reads and
    clears."""

    def __init__(self) -> None:
        self._marks: dict[int, str] = {}  # room: its dead server, oldest mark first
        self._held: dict[Any, weakref.WeakKeyDictionary[Any, str]] = {}  # room: receiver: server
        self._prune_at = 64  # rooms held, counting those whose receivers are gone
        self._lock = threading.Lock()

    def hold(self, receiver: object, room: Any, server: str, afresh: bool) -> None:
        """`receiver` bootstraps `room` from `server`; `afresh`: SGLang lists no room of the
        id, so a mark made before is not about the writers bootstrapping now.  It is held
        until it is garbage (SGLang drops a receiver once its pages are released)."""
        with self._lock:
            self._held.setdefault(room, weakref.WeakKeyDictionary())[receiver] = server
            if len(self._held) > self._prune_at:
                self._held = {k: held for k, held in self._held.items() if len(held)}
                self._prune_at = 2 * len(self._held) + 64
            if afresh:
                self._marks.pop(room, None)

    def add(self, rooms: Iterable[int], server: str) -> None:
        """Mark `rooms`, whose writers on `server` are all dead."""
        with self._lock:
            for room in rooms:
                self._marks.pop(room, None)
                self._marks[room] = server
            _trim(self._marks, DEAD_ROOMS)

    def server(self, room: int) -> str | None:
        """The dead server of `room`'s mark, or None if it has none."""
        with self._lock:
            return self._marks.get(room)

    def alone(self, room: int, server: str, dead: dict[int, dict[str, Any]]) -> bool:
        """No live receiver of `room` from a server other than `server` may still be written:
        each has no rank entries, or only entries in `dead` (by identity).  Clients choose
        room ids and SGLang keys rooms by id alone, so a release asked by the id must not
        reach another server's receiver whose ranks may live: SGLang's own count decides
        it then, or its timeout."""
        with self._lock:
            held = self._held.get(room)
            others = [r for r, at in list(held.items()) if at != server] if held else []
        return all(_known_dead(getattr(r, "bootstrap_infos", None) or (), dead) for r in others)

    def discard(self, room: int) -> None:
        with self._lock:
            self._marks.pop(room, None)

    def __len__(self) -> int:
        return len(self._marks)


_Abort = tuple[int, list[dict[str, Any]], str]  # an armed ABORT: generation, entries, server


class _Aborts:
    """The rooms whose ABORT_ACKs SGLang awaits: each with its generation, the rank entries
    its ABORT went to, which `is_abort_release_safe` checks the ACKs against and the
    watcher watches, and the server they belong to.  A second ABORT to a room noted, armed
    or not, is another receiver's of the same room id (or a race of two threads on one):
    the room is noted as None, and SGLang's own count decides it.  Cleared with SGLang's
    tracker (`clear_deferred_abort_state`); only the newest DEAD_ROOMS are kept."""

    def __init__(self) -> None:
        self._rooms: dict[int, _Abort | None] = {}
        self._lock = threading.Lock()

    def note(
        self,
        room: int,
        generation: int | None,
        entries: Sequence[dict[str, Any]],
        server: str,
    ) -> None:
        """An ABORT sent to `entries` of `server`, arming `generation` (None: it armed
        nothing)."""
        with self._lock:
            if room in self._rooms:
                self._rooms[room] = None
            elif generation is not None:
                self._rooms[room] = (generation, list(entries), server)
                _trim(self._rooms, DEAD_ROOMS)

    def get(self, room: int) -> _Abort | None:
        with self._lock:
            return self._rooms.get(room)

    def discard(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def entries(self) -> list[dict[str, Any]]:
        """Every noted room's rank entries."""
        with self._lock:
            return [e for noted in self._rooms.values() if noted for e in noted[1]]


class _Ranks:
    """The decode watcher's view of prefill ranks, by registry name: whether each lives.
    Only the watcher thread uses it."""

    def __init__(self) -> None:
        self._seen: dict[str, PeerRegistry] = {}  # registries seen alive, held open
        # names whose registry was seen alive, then lost or let go of: no file there now
        # means that engine is gone (a restart makes its registry before it registers)
        self._known: dict[str, None] = {}

    def alive(self, name: str) -> bool:
        """False once the registry seen alive under `name` is unlocked, removed or replaced,
        or its owner has begun to exit (before its lock goes: `PeerRegistry.owner_gone`),
        and no live registry has taken the name since.  A rank restarted under the name is
        alive: rooms bootstrapped to it must not be released as the dead one's (those keep
        SGLang's path).  A name never seen is alive: not this host's engine, or not up yet."""
        reg = self._seen.pop(name, None)
        if reg is not None:
            if reg.alive() and reg.named() and not reg.owner_gone():
                self._seen[name] = reg
                return True
            self._let_go(name, reg)
        try:
            reg = PeerRegistry(name, None)
        except Exception:  # no file: gone, if it was seen; any other trouble: looked at again
            return name not in self._known or os.path.exists(os.path.join(SHM_DIR, name))
        try:
            reg.refresh()  # its owner's pid and start time
        except Exception:
            reg.close()
            return True  # not published yet, or another format: looked at again
        if reg.alive() and not reg.owner_gone():
            self._seen[name] = reg
            return True
        reg.close()
        return False

    def keep_only(self, names: Container[str]) -> None:
        """Close the registries of every name not in `names`.  Each stays known: a live rank
        let go of here and then killed and swept before its next look is dead, not "never
        seen" (a room awaiting its ACK would wait out SGLang's timeout)."""
        for name in [n for n in self._seen if n not in names]:
            self._let_go(name, self._seen.pop(name))

    def _let_go(self, name: str, reg: PeerRegistry) -> None:
        reg.close()
        self._known.pop(name, None)  # the newest known stay: the ones still asked about
        self._known[name] = None
        _trim(self._known, DEAD_RANK_ENTRIES)


def _known_dead(entries: Iterable[dict[str, Any]], dead: dict[int, dict[str, Any]]) -> bool:
    """Every rank entry is one noted dead: the same object (see `writers_gone`)."""
    return all(dead.get(id(e)) is e for e in entries)


def _newest(items: dict[Any, Any], keep: int) -> dict[Any, Any]:
    """The last `keep` items of `items`, in order: a bounded memory of what died."""
    return dict(list(items.items())[-keep:])


def _trim(items: dict[Any, Any], keep: int) -> None:
    """`_newest` in place, for a memory kept under a lock rather than rebound."""
    while len(items) > keep:
        del items[next(iter(items))]


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", None) != NAME or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    classes = _classes()
    return classes.get(class_type.name)


def _classes() -> dict[str, type]:
    """SGLang's Mooncake classes with the same-host engine under them (built on first use, so
    that importing the plugin imports no SGLang disaggregation code)."""
    if _built:
        return _built
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import (
        MooncakeKVBootstrapServer,
        MooncakeKVManager,
        MooncakeKVReceiver,
        MooncakeKVSender,
    )
    from sglang.srt.disaggregation.utils import DisaggregationMode

    class ShmslotsKVManager(MooncakeKVManager):  # type: ignore[misc]
        """SGLang's Mooncake manager on `SameHostEngine` (see the module's docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.disaggregation_mode == DisaggregationMode.PREFILL:
                self.failed_sessions = _DeadSessions(self.engine)

        def register_to_bootstrap(self) -> None:
            """The engine (its registry) first: see the module's docstring."""
            self.init_engine()
            super().register_to_bootstrap()

        def init_engine(self) -> None:
            if getattr(self, "engine", None) is not None:  # made before registering
                return
            self.engine = SameHostEngine(
                registry_name(self.local_ip, self.rank_port),
                self.rank_port,
                receives=self.disaggregation_mode == DisaggregationMode.DECODE,
            )
            self._dead_rooms = _RoomMarks()  # every writer dead: safe at once
            self._dead_ranks: dict[int, dict[str, Any]] = {}  # by id: see writers_gone
            self._aborts = _Aborts()
            self._ranks = _Ranks()
            self._watch_stop = threading.Event()
            if self.disaggregation_mode == DisaggregationMode.DECODE:
                self._watcher = threading.Thread(
                    target=self._watch_prefills, name="ShmslotsPrefillWatch", daemon=True
                )
                self._watcher.start()

        def check_status(self, bootstrap_room: int) -> Any:
            """A room no longer in the table has been cleared, and takes no more writes:
            Failed, as the worker's own membership tests treat it.  SGLang's transfer worker
            tests membership, then looks the room up (`mooncake/conn.py:2534-2535`, `:2546-2547`,
            `:2856-2860`); cleared in between by the scheduler, the lookup's KeyError killed
            the worker thread and every later transfer of its queue hung (seen once in the
            spec serve test).  The race is SGLang's own Mooncake's too; a same-host write
            ends soon enough to lose it more often."""
            try:
                return self.request_status[bootstrap_room]
            except KeyError:
                return KVPoll.Failed

        def _poison_unsettled_send(self, room: int) -> None:
            """Nothing is left writing after a failed same-host call: ack as usual."""

        def _watch_prefills(self) -> None:
            interval = float(os.environ.get(WATCH_ENV, "0.02"))
            while not self._watch_stop.wait(interval):
                try:
                    self._check_prefills()
                except Exception:  # the watcher must outlive any one bad registry
                    log.exception("shmslots: checking prefill engines failed")

        def _check_prefills(self) -> None:
            """Each prefill server (bootstrap address) with a dead rank has its rooms failed,
            as SGLang's heartbeat would after 2 x 5 s.  Only if every rank it holds is dead
            are its rooms safe to release at once: a live rank may still be writing.  The
            dead ranks' entries, and those of rooms awaiting ACKs, are noted by identity."""
            awaiting = self._aborts.entries()  # before any look: each look is after its fetch
            with self.connection_lock:  # ranks and rooms in one look: a room bootstrapped
                ranks: dict[str, set[str]] = {}  # after it may be a restarted prefill's
                entries_of: dict[str, list[dict[str, Any]]] = {}
                for key, entries in self.connection_pool.items():
                    for addr in self.prefill_info_table:
                        if key.startswith(f"{addr}_"):  # bootstrap_key: addr_dp_cp_tp
                            ranks.setdefault(addr, set()).update(map(_rank_registry, entries))
                            entries_of.setdefault(addr, []).extend(entries)
                rooms = {addr: set(self.addr_to_rooms_tracker.get(addr, ())) for addr in ranks}
            alive: dict[str, bool] = {}  # each name looked at once a pass

            def lives(name: str) -> bool:
                if name not in alive:
                    alive[name] = self._ranks.alive(name)
                return alive[name]

            for addr, names in ranks.items():
                dead = {name for name in names if not lives(name)}
                if not dead:
                    continue
                if dead == names:
                    status = self.request_status
                    self._dead_rooms.add(
                        (r for r in rooms[addr] if status.get(r) != KVPoll.Success), addr
                    )
                self._note_dead(e for e in entries_of[addr] if _rank_registry(e) in dead)
                self._handle_node_failure(addr)
            # SGLang forgets a failed server's ranks, and a failed room's before it aborts the
            # room: a room awaiting ACKs has its ranks watched here until it is released
            self._note_dead(e for e in awaiting if not lives(_rank_registry(e)))
            self._ranks.keep_only(alive)  # let go of forgotten servers' registries

        def _note_dead(self, entries: Iterable[dict[str, Any]]) -> None:
            gone = {id(e): e for e in entries}
            if gone:  # rebound, never mutated: the scheduler thread reads it without a lock
                self._dead_ranks = _newest({**self._dead_ranks, **gone}, DEAD_RANK_ENTRIES)

        def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
            """A room whose prefill died is safe at once: a dead process writes nothing.  So
            is one each rank of whose ABORT has acked this generation or is dead: SGLang
            counts the ACKs, and a dead rank's never comes.  Either only while no other
            server's receiver of the room id may still be written (`_alone`)."""
            if self._marked(bootstrap_room):
                return True
            if super().is_abort_release_safe(bootstrap_room, required_acks):
                return True
            noted = self._aborts.get(bootstrap_room)
            state = self._deferred_abort_ack_tracker.get(bootstrap_room)
            if noted is None or state is None or state.generation != noted[0]:
                return False
            (_, entries, server), dead, acked = noted, self._dead_ranks, state.prefill_ranks
            return (
                len(entries) >= required_acks
                and all(dead.get(id(e)) is e or e.get(ACK_RANK) in acked for e in entries)
                and self._alone(bootstrap_room, server)
            )

        def _marked(self, room: int) -> bool:
            """The room's prefill server died whole, and it is `_alone` on that server."""
            server = self._dead_rooms.server(room)
            return server is not None and self._alone(room, server)

        def _alone(self, room: int, server: str) -> bool:
            return self._dead_rooms.alone(room, server, self._dead_ranks)

        def writers_gone(self, bootstrap_room: int, receiver: object = None) -> bool:
            """Every prefill rank that could write this room is dead (the plugin frees its
            metadata slot at once instead of quarantining it; no ABORT need be sent).

            A receiver made after the watcher's look at SGLang's tables took its rank
            entries from SGLang's cache, and SGLang failed its room with the rest
            (`_handle_node_failure` reads the rooms again).  By those entries' identity (its
            `bootstrap_infos`) it is told from one bootstrapped afresh, perhaps to a prefill
            restarted at that address.  The answer is the receiver's, not the room's: a
            later receiver of the same room is asked afresh, and a mark covers only the
            receivers of the server it names."""
            server = self._dead_rooms.server(bootstrap_room)
            if server is not None and getattr(receiver, "bootstrap_addr", server) == server:
                return True
            infos = getattr(receiver, "bootstrap_infos", None) or ()
            return bool(infos) and _known_dead(infos, self._dead_ranks)

        def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
            self._aborts.discard(bootstrap_room)
            self._dead_rooms.discard(bootstrap_room)
            super().clear_deferred_abort_state(bootstrap_room)

        def teardown(self) -> None:
            self._watch_stop.set()
            super().teardown()
            self.close_engine()

        def close_engine(self) -> None:
            """Remove the registry (peers see this engine gone) and let go of peers."""
            self._watch_stop.set()
            watcher = getattr(self, "_watcher", None)
            if watcher is not None and watcher is not threading.current_thread():
                watcher.join(5)
            self._ranks.keep_only(())
            self.engine.close()

    class ShmslotsKVSender(MooncakeKVSender):  # type: ignore[misc]
        # indices stay on the host: the D2H-event path needs CUDA (prefill.py:1743-1760)
        supports_host_tensor_indices = False

    class ShmslotsKVReceiver(MooncakeKVReceiver):  # type: ignore[misc]
        def __init__(
            self, mgr: Any, bootstrap_addr: str, bootstrap_room: int | None = None
        ) -> None:
            """Held in the room marks before SGLang lists the room, so a watcher's look that
            sees the room sees the receiver.  A room SGLang does not list is bootstrapped
            afresh: whatever died before, its writers are the ones bootstrapping now.  A
            duplicate of a room still pending changes no mark (`CommonKVReceiver.__init__`,
            `common/conn.py:2482`); one from another server counts in `_alone`."""
            afresh = bootstrap_room not in mgr.request_status
            mgr._dead_rooms.hold(self, bootstrap_room, bootstrap_addr, afresh)
            super().__init__(mgr, bootstrap_addr, bootstrap_room)

        def _send_abort_notification(self, *, force_arm: bool = False) -> None:
            """A room whose prefill is dead needs no ABORT, and no ACK is awaited: nothing is
            left to stop, and none would come.  Every ABORT of SGLang's receiver comes here
            (an abort, a failure, a wait timed out, a clear), so the room is marked safe to
            release for each (while it is `_alone`)."""
            mgr, room = self.kv_mgr, self.bootstrap_room
            if mgr.writers_gone(room, self):
                if mgr.request_status.get(room) != KVPoll.Success:
                    mgr._dead_rooms.add([room], self.bootstrap_addr)
                return
            before = self._abort_generation
            super()._send_abort_notification(force_arm=force_arm)
            armed = self._abort_generation  # a new one if this call armed the room
            generation = None if armed == before else armed
            mgr._aborts.note(room, generation, self.bootstrap_infos, self.bootstrap_addr)

        def _get_bootstrap_info_from_server(
            self, prefill_dp_rank: int, prefill_cp_rank: int, tp_rank: int, pp_rank: int
        ) -> dict[str, Any] | None:
            """The entry, with the rank number its ACKs will carry (`_prefill_unique_rank`,
            `common/conn.py:1024`), so that `is_abort_release_safe` knows who has acked."""
            entry = super()._get_bootstrap_info_from_server(
                prefill_dp_rank, prefill_cp_rank, tp_rank, pp_rank
            )
            if entry is not None:
                p = self.prefill_info
                entry[ACK_RANK] = (
                    tp_rank * p.pp_size * p.attn_cp_size
                    + pp_rank * p.attn_cp_size
                    + prefill_cp_rank
                )
            return entry  # type: ignore[no-any-return]

    class ShmslotsKVBootstrapServer(MooncakeKVBootstrapServer):  # type: ignore[misc]
        pass

    _built.update(
        MANAGER=ShmslotsKVManager,
        SENDER=ShmslotsKVSender,
        RECEIVER=ShmslotsKVReceiver,
        BOOTSTRAP_SERVER=ShmslotsKVBootstrapServer,
    )
    return _built


_built: dict[str, type] = {}
