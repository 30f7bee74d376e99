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
  as SGLang's heartbeat would after 2 x 5 s, and its rank entries are noted dead, by
  identity.  A room is safe to release at once when every rank entry of every live
  receiver of its id is (a dead process writes nothing; clients choose room ids and SGLang
  asks by id, so one id may have several receivers); a heartbeat's failure, which cannot
  tell dead from slow, keeps SGLang's own path;
- `_deferred_abort_ack_tracker` (read): SGLang counts a room's ABORT_ACKs against the
  number of ranks it aborted, so a dead rank's missing ACK held the room for the timeout;
  here a room is safe once each rank its ABORT went to, and each rank that may write it,
  is dead or was sent that ABORT and acked this generation.  The watcher looks at the
  ranks of every room awaiting ACKs, since SGLang forgets a failed server's ranks, and a
  failed room's (`clear`) before it sends the ABORT;
- `_send_abort_notification` (overridden) and `bootstrap_infos` (read), receiver: a
  receiver whose ranks are all dead sends no ABORT.  One bootstrapped after the watcher's
  look from SGLang's cached entries holds the very entries noted dead; one that fetched its
  own after `_handle_node_failure` emptied the cache sends its ABORT, and its ranks are
  watched as a room awaiting ACKs;
- `__init__`, `failure_exception` and `send_metadata` (extended), receiver: a receiver of
  a room id still in flight (in `request_status`, or failed after `send_metadata` and not
  yet released) is refused as SGLang refuses one under deferred allocation only, with a
  reason of its own: two receivers of one id share its status, failure and ACKs.  Where
  the id's state is another's: `_owns_bootstrap_room` False, the id Failed unless this
  rank's table has its Success, a `failure_records` entry if it had none, its own
  `addr_to_rooms_tracker` entry undone.  Beside a held receiver, the state SGLang's
  `__init__` made is the refused one's, Failed, and its `failure_exception` clears it;
- `_clear` (extended), receiver: only its first clear is its own (`_owns_bootstrap_room`
  False after it): SGLang clears a failed receiver again at its release, when a retry may
  hold the id.  So `abort()` after it only sets `conclude_state`, as SGLang's does for a
  receiver it does not own (no ABORT by id; 0.5.23 reaches that only from
  `_fail_prefill_recompute`, which then records a failure by id itself);
- `_get_bootstrap_info_from_server` (extended), receiver: each rank entry carries the rank
  number the rank's ACKs carry (`_prefill_unique_rank`), from the prefill's sizes;
- `teardown` (extended): the engine's registry goes with the manager.

The decode side's aux buffers are the plugin's shmslots table (`DecodeMetadataBuffers`),
whose columns lie in `/dev/shm`: the prefill writes each aux row straight into the decode's
slot through its own mapping of that segment, and the slot keeps the plugin's rules.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import re
import threading
import weakref
from collections.abc import Container, Iterable, Sequence
from typing import Any

from ..errors import InvalidArgument
from ..segment import SHM_DIR
from .samehost import PREFIX, PeerRegistry, SameHostEngine

NAME = "shmslots"
WATCH_ENV = "SHMSLOTS_PD_WATCH_S"
DEAD_RANK_ENTRIES = 1024  # dead prefills' rank entries remembered, told by identity
DEAD_ROOMS = 1 << 16  # rooms `_Aborts` keeps, the newest: far more than in flight
ACK_RANK = "shmslots_ack_rank"  # a bootstrap entry's rank, as its ABORT_ACKs number it
DUPLICATE = "Duplicate decode bootstrap room: another request holds this room id (shmslots)"
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


class _Holders:
    """The live receivers of each room id.  Clients choose room ids and SGLang keys rooms by
    id alone, so one id may be held by several receivers, of one prefill server or of
    several: a release asked by the id is made early only if it is safe for each.  Held
    weakly (SGLang drops a receiver once its pages are released or its transfer is done),
    and pruned as they go."""

    def __init__(self) -> None:
        self._held: dict[Any, weakref.WeakSet[Any]] = {}
        self._prune_at = 64  # room ids held, counting those whose receivers are gone
        self._lock = threading.Lock()

    def hold(self, receiver: object, room: Any) -> None:
        with self._lock:
            self._held.setdefault(room, weakref.WeakSet()).add(receiver)
            if len(self._held) > self._prune_at:
                self._held = {k: held for k, held in self._held.items() if len(held)}
                self._prune_at = 2 * len(self._held) + 64

    def holding(self, entries: Iterable[dict[str, Any]]) -> list[Any]:
        """The live receivers holding any of `entries` (the same objects)."""
        ids = {id(e) for e in entries}  # `entries` live through the call: ids are theirs
        with self._lock:
            receivers = [r for held in self._held.values() for r in list(held)]
        return [r for r in receivers if any(id(e) in ids for e in _entries(r))]

    def entries(self) -> list[dict[str, Any]]:
        """The rank entries of every live receiver that still owns its room id."""
        with self._lock:
            receivers = [r for held in self._held.values() for r in list(held)]
        return [e for r in receivers if r._owns_bootstrap_room for e in _entries(r)]

    def of(self, room: Any) -> list[Any]:
        """The live receivers of `room`."""
        with self._lock:
            return list(self._held.get(room, ()))

    def awaiting_release(self, room: Any) -> bool:
        """A live receiver of `room` failed after its pages were asked for, not yet released."""
        return any(r.awaiting_release() for r in self.of(room))

    def writers(self, room: Any) -> list[dict[str, Any]]:
        """The rank entries of every live receiver of `room`: whoever may write its pages."""
        return [e for r in self.of(room) for e in _entries(r)]


class _Aborts:
    """The rooms whose ABORT_ACKs SGLang awaits: each with its generation and the rank
    entries its ABORT went to, which `is_abort_release_safe` checks the ACKs against and
    the watcher watches.  A second ABORT to a room noted, armed or not, is another
    receiver's of the same room id (or a race of two threads on one): the room is noted as
    None, and SGLang's own count decides it.  Cleared with SGLang's tracker
    (`clear_deferred_abort_state`); only the newest DEAD_ROOMS are kept."""

    def __init__(self) -> None:
        self._rooms: dict[int, tuple[int, list[dict[str, Any]]] | None] = {}
        self._lock = threading.Lock()

    def note(self, room: int, generation: int | None, entries: Sequence[dict[str, Any]]) -> None:
        """An ABORT sent to `entries`, arming `generation` (None: it armed nothing)."""
        with self._lock:
            if room in self._rooms:
                self._rooms[room] = None
            elif generation is not None:
                self._rooms[room] = (generation, list(entries))
                _trim(self._rooms, DEAD_ROOMS)

    def get(self, room: int) -> tuple[int, list[dict[str, Any]]] | None:
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

    def alive(self, name: str, until_exited: bool = False) -> bool:
        """False once the registry seen alive under `name` is unlocked, removed or replaced,
        or its owner has begun to exit (before its lock goes: `PeerRegistry.owner_gone`),
        and no live registry has taken the name since.  With `until_exited` (this decode
        takes copies into GPU memory, which a dying owner's GPU may still run), an owner
        that began to exit lives until it has exited whole (`PeerRegistry.exited`).  A rank
        restarted under the name is alive: rooms bootstrapped to it must not be released
        as the dead one's (those keep SGLang's path).  A name never seen is alive: not this
        host's engine, or not up yet."""
        reg = self._seen.pop(name, None)
        if reg is not None:
            if _lives(reg, reg.named(), until_exited):
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
        if _lives(reg, True, until_exited):
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


def _lives(reg: PeerRegistry, named: bool, until_exited: bool) -> bool:
    """`_Ranks.alive`'s test of one registry.  Its lock is read before its owner's exit:
    a dying owner sets its exit flags before its lock goes, so a lock found gone with no
    exit seen after was let go of by a live owner, which has ended its transfers first."""
    held = reg.alive() and named
    if reg.owner_gone():
        return until_exited and not reg.exited()
    return held


def watch_interval() -> float:
    """Seconds between the decode watcher's looks (WATCH_ENV, 0.02 by default): refused at
    the manager's start unless a finite number above 0, not a dead or spinning watcher."""
    raw = os.environ.get(WATCH_ENV, "0.02")
    try:
        interval = float(raw)
    except ValueError:
        interval = math.nan
    if not 0 < interval < math.inf:
        raise InvalidArgument(f"{WATCH_ENV}={raw!r}: expected seconds, a number above 0")
    return interval


def _entries(receiver: object) -> list[dict[str, Any]]:
    """A receiver's prefill rank entries (SGLang's `bootstrap_infos`): none before `init`."""
    return list(getattr(receiver, "bootstrap_infos", None) or ())


def _known_dead(entries: Iterable[dict[str, Any]], dead: dict[int, dict[str, Any]]) -> bool:
    """Every rank entry is one noted dead: the same object (see `writers_gone`)."""
    return all(dead.get(id(e)) is e for e in entries)


def _acked_or_dead(
    entries: Sequence[dict[str, Any]],
    writers: Sequence[dict[str, Any]],
    acked: Container[int],
    dead: dict[int, dict[str, Any]],
) -> bool:
    """Every rank an ABORT went to (`entries`), and every rank that may write the room
    (`writers`), is dead or was sent that ABORT and acked it: `acked` holds the rank numbers
    the ACKs carried (ACK_RANK), and a number answers only for a rank the ABORT went to."""
    aborted = {id(e): e for e in entries}
    return all(
        dead.get(id(e)) is e or (aborted.get(id(e)) is e and e.get(ACK_RANK) in acked)
        for e in (*entries, *writers)
    )


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
    from sglang.srt.disaggregation.common.conn import KVTransferError
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
            self._holders = _Holders()  # a room id's receivers: its possible writers
            self._dead_ranks: dict[int, dict[str, Any]] = {}  # by id: see writers_gone
            self._aborts = _Aborts()
            self._ranks = _Ranks()
            self._watch_stop = threading.Event()
            if self.disaggregation_mode == DisaggregationMode.DECODE:
                interval = watch_interval()
                self._watcher = threading.Thread(
                    target=self._watch_prefills,
                    args=(interval,),
                    name="ShmslotsPrefillWatch",
                    daemon=True,
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

        def _watch_prefills(self, interval: float) -> None:
            while not self._watch_stop.wait(interval):
                try:
                    self._check_prefills()
                except Exception:  # the watcher must outlive any one bad registry
                    log.exception("shmslots: checking prefill engines failed")

        def _check_prefills(self) -> None:
            """Each prefill server (bootstrap address) with a dead rank has its rooms failed,
            as SGLang's heartbeat would after 2 x 5 s.  The dead ranks' entries, and those
            of rooms awaiting ACKs, are noted by identity: a room is safe to release at once
            only when every rank that may write it is (`is_abort_release_safe`)."""
            # before any look, so each look is after its entry's fetch: the ranks of rooms
            # awaiting ACKs, and of every room in flight (SGLang drops a server's cached
            # entries, `invalidate_cached_bootstrap_infos`, while receivers still hold them)
            held = [*self._aborts.entries(), *self._holders.entries()]
            with self.connection_lock:
                entries_of: dict[str, list[dict[str, Any]]] = {}  # each server's rank entries
                addrs = list(self.prefill_info_table)  # the scheduler adds servers unlocked
                for key, entries in self.connection_pool.items():
                    for addr in addrs:
                        if key.startswith(f"{addr}_"):  # bootstrap_key: addr_dp_cp_tp
                            entries_of.setdefault(addr, []).extend(entries)
            alive: dict[str, bool] = {}  # each name looked at once a pass

            gpu = self.engine.holds_device_memory

            def lives(name: str) -> bool:
                if name not in alive:
                    alive[name] = self._ranks.alive(name, until_exited=gpu)
                return alive[name]

            for addr, entries in entries_of.items():
                dead = [e for e in entries if not lives(_rank_registry(e))]
                if dead:
                    self._note_dead(dead)
                    self._handle_node_failure(addr)
            # SGLang forgets a failed server's ranks, a failed room's before it aborts the
            # room, and a server's whenever one request times out: a room's ranks are
            # watched here until it is released
            self._note_dead(e for e in held if not lives(_rank_registry(e)))
            self._ranks.keep_only(alive)  # let go of forgotten servers' registries

        def _note_dead(self, entries: Iterable[dict[str, Any]]) -> None:
            """Note dead ranks' entries, and fail the room of every receiver holding one, as
            `_handle_node_failure` fails its server's: a dead rank's entries noted from the
            rooms awaiting ACKs may be held by receivers whose server SGLang no longer lists,
            and whose rooms it would then fail only at its heartbeat's timeout."""
            dead = self._dead_ranks
            gone = {id(e): e for e in entries if dead.get(id(e)) is not e}
            if not gone:
                return
            # rebound, never mutated: the scheduler thread reads it without a lock
            self._dead_ranks = _newest({**dead, **gone}, DEAD_RANK_ENTRIES)
            for receiver in self._holders.holding(gone.values()):
                if not receiver._owns_bootstrap_room:  # cleared (its id may be a retry's now)
                    continue  # or refused: a failure by id would fail another's request
                room = receiver.bootstrap_room
                if room in self.request_status and self.check_status(room) != KVPoll.Success:
                    self.record_failure(room, "shmslots: a prefill rank of this room died")
                    self.update_status(room, KVPoll.Failed)

        def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
            """Safe at once when every rank that may write the room is dead: a dead process
            writes nothing.  Safe too once every such rank has acked this generation's ABORT
            or is dead: SGLang counts the ACKs, and a dead rank's never comes.  The ranks
            that may write are those of every live receiver of the room id (`_Holders`):
            clients choose ids, and SGLang asks by id."""
            dead, writers = self._dead_ranks, self._holders.writers(bootstrap_room)
            if writers and _known_dead(writers, dead):
                return True
            if super().is_abort_release_safe(bootstrap_room, required_acks):
                return True
            noted = self._aborts.get(bootstrap_room)
            state = self._deferred_abort_ack_tracker.get(bootstrap_room)
            if noted is None or state is None or state.generation != noted[0]:
                return False
            entries = noted[1]
            return len(entries) >= required_acks and _acked_or_dead(
                entries, writers, state.prefill_ranks, dead
            )

        def writers_gone(self, bootstrap_room: int, receiver: object = None) -> bool:
            """Every prefill rank that could write this receiver's pages (with no receiver:
            any receiver's of the room id) is dead, by its rank entries' identity: the
            plugin frees the metadata slot at once instead of quarantining it, and no ABORT
            need be sent.

            A receiver made after the watcher's look at SGLang's tables took its rank
            entries from SGLang's cache, and SGLang failed its room with the rest
            (`_handle_node_failure` reads the rooms again): those entries are the ones
            noted dead.  One bootstrapped afresh, perhaps to a prefill restarted at that
            address, has entries of its own, and keeps SGLang's path."""
            if receiver is None:
                entries = self._holders.writers(bootstrap_room)
            else:
                entries = _entries(receiver)
            return bool(entries) and _known_dead(entries, self._dead_ranks)

        def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
            self._aborts.discard(bootstrap_room)
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
            """A receiver of a room id still in flight is refused, as SGLang refuses it under
            deferred allocation (`common/conn.py:2500`) but nowhere else: the two would share
            the id's status, failure and ACKs, and one's Success would read as the other's,
            a row consumed before its bytes land.  In flight: in SGLang's table, or failed
            and awaiting its release (SGLang has let go of the id, but the prefill may still
            write the pages it was asked for, and its ACK and any late status name only the
            id: a retry's ABORT_ACK released them early).  Unless the first had its Success,
            the id fails with it."""
            room = bootstrap_room
            in_table = room is not None and room in mgr.request_status
            held = room is not None and mgr._holders.awaiting_release(room)
            tracked = room in mgr.addr_to_rooms_tracker.get(bootstrap_addr, ())
            mgr._holders.hold(self, room)
            super().__init__(mgr, bootstrap_addr, room)
            if not (in_table or held) or not getattr(self, "_owns_bootstrap_room", True):
                return  # not a duplicate, or SGLang refused it itself
            self._refused = True
            self.conclude_state = KVPoll.Failed
            if not in_table:  # the status SGLang just made is this receiver's: its clear goes
                mgr.update_status(room, KVPoll.Failed)
                return
            self._owns_bootstrap_room = False  # the id's state is the first's: left to it
            if not tracked:
                mgr.addr_to_rooms_tracker[bootstrap_addr].discard(room)
            if mgr.check_status(room) != KVPoll.Success:
                with mgr.failure_lock:  # the first's own reason, if it has one, stays its
                    mgr.failure_records.setdefault(room, DUPLICATE)
                mgr.update_status(room, KVPoll.Failed)

        _refused = False
        _asked = False  # its page indices went to the prefill: they may be written
        _clears = 0

        def send_metadata(self, *args: Any, **kwargs: Any) -> None:
            self._asked = True  # before: a write may start as soon as the message is out
            super().send_metadata(*args, **kwargs)

        def awaiting_release(self) -> bool:
            """Failed after its pages were asked for, and not yet released: SGLang clears a
            failed receiver at its failure and again at its release (`_do_release`)."""
            return self._asked and self._clears == 1 and self.conclude_state != KVPoll.Success

        def failure_exception(self) -> None:
            """A refused receiver's reason is its own: the id's one record is the first
            receiver's to take (whichever asked first took it, and the other was told
            "unknown reason from another rank").  One refused beside a held receiver owns
            the id's state, and clears it with any record made since, as SGLang's does."""
            if not self._refused:
                super().failure_exception()
                return
            if self._owns_bootstrap_room:  # refused beside a held one: the id's state is
                with contextlib.suppress(KVTransferError):  # its own, and so is any record
                    super().failure_exception()  # made since: SGLang's clears and pops them
            raise KVTransferError(self.bootstrap_room, DUPLICATE)

        def _clear(self) -> None:
            """Only the first clear is the receiver's own.  SGLang's decode clears a failed
            receiver twice (`failure_exception`, then `_do_release`); by the second a retry
            may hold the id, and the second clear popped the retry's status, failing it.
            SGLang stops it so under deferred allocation only (`common/conn.py:2942`)."""
            super()._clear()
            self._owns_bootstrap_room = False
            self._clears += 1

        def _send_abort_notification(self, *, force_arm: bool = False) -> None:
            """A receiver whose prefill ranks are dead needs no ABORT, and no ACK is awaited:
            nothing is left to stop, and none would come.  Every ABORT of SGLang's receiver
            comes here (an abort, a failure, a wait timed out, a clear)."""
            mgr, room = self.kv_mgr, self.bootstrap_room
            if mgr.writers_gone(room, self):
                return
            before = self._abort_generation
            super()._send_abort_notification(force_arm=force_arm)
            armed = self._abort_generation  # a new one if this call armed the room
            mgr._aborts.note(room, None if armed == before else armed, self.bootstrap_infos)

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
