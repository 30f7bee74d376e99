"""`SameHostEngine`: Mooncake's `TransferEngine` calls, answered for peers on one host.

SGLang's Mooncake manager moves every byte through five engine calls (`batch_register`,
`batch_deregister`, `get_session_id`, `send_probe`, `batch_transfer_sync`); `backend.py`
puts this class behind them.  A transfer is planned whole (plan.py), then its copies run on
the caller's thread and the engine's copy threads (peer.py says how bytes reach the peer),
and the call returns, or raises, only once none of them can still land.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from ..._core import copy_blocks, fence
from ...errors import InvalidArgument, ShmSlotsError
from .. import cuda_kv
from .errors import EngineClosed, PeerGone, TransferError
from .memfd import FileMapping, share, unshare
from .peer import DeviceMapping, Peer, allow_peers, close_all
from .plan import Plan, integer, plan
from .regions import EMPTY, Region, RegionTable, classify
from .registry import PREFIX, PeerRegistry, Registry, parse_session, session_id, sweep

log = logging.getLogger(__name__)


def _still_alive(reg: PeerRegistry, grace_s: float = 0.2) -> bool:
    """Whether the peer lives, once a write into it failed: a dying process loses its address
    space before its descriptors (and so its lock), so wait a moment before saying it lives."""
    deadline = time.monotonic() + grace_s
    while reg.lives():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.005)
    return False


class SameHostEngine:
    """Mooncake's `TransferEngine` surface as SGLang's manager calls it, for one host.

    `name` names the registry segment (one per engine; `session_port` is the number SGLang
    reads after the session id's last ':' to spread sessions over its queues).  An engine
    that only sends (`receives=False`: SGLang's prefill) publishes none of its memory, so no
    peer may write into it, and any GPU memory is a source (VMM memory too, which CUDA IPC
    cannot share: torch's expandable_segments, SGLang's --enable-memory-saver)."""

    def __init__(self, name: str, session_port: int = 0, *, receives: bool = True) -> None:
        if not name.startswith(PREFIX):
            raise InvalidArgument(f"a same-host engine's registry name starts with {PREFIX!r}")
        if receives:  # a sender is written by no peer: it lets none attach
            allow_peers()
        sweep()
        self.registry = Registry(name)
        self.session_port = session_port
        self.receives = receives
        self._own: RegionTable = EMPTY  # swapped whole, as a peer's table
        self._parts: dict[int, list[Region]] = {}  # a registered base: its published parts
        self._threads: ThreadPoolExecutor | None = None  # made by the first parallel copy
        self._peers: dict[str, Peer] = {}
        # SGLang's manager transfers from several threads at once (its queues, and executor
        # futures per layer): a peer is closed only by its last user, and retiring waits for
        # every peer in use, a dropped one's included
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._busy: set[Peer] = set()  # peers with a user: retired, the last one's end
        # removes the registry (Registry.close acts once, whoever calls it first)
        self._stop = threading.Event()  # ends the pruner (started with the first peer)
        self._pruner: threading.Thread | None = None
        _engines.add(self)
        self.refused = 0  # transfers refused for bad input (outside registered memory)
        self.failed = 0  # transfers that found their peer gone

    # -- Mooncake's calls ---------------------------------------------------------------
    def get_session_id(self) -> str:
        return session_id(self.registry, self.session_port)

    def batch_register(self, ptrs: Sequence[int], lens: Sequence[int]) -> int:
        """Publish the ranges (anonymous ones moved onto memfds first: memfd.py says how and
        why), or where this engine only sends, keep them as sources; a range overlapping one
        registered is refused, and a refused call publishes nothing of itself."""
        if len(ptrs) != len(lens):
            raise TransferError(f"{len(ptrs)} addresses and {len(lens)} lengths to register")
        try:
            ranges = [(integer(p), integer(n)) for p, n in zip(ptrs, lens, strict=True)]
        except TypeError:
            raise TransferError("addresses and lengths to register must be integers") from None
        new = [classify(p, n, shared=self.receives) for p, n in ranges if n]
        with self._lock:
            self._check_open()
            regions = sorted([*self._own.regions, *(r for r, _ in new)], key=lambda r: r.base)
            for a, b in itertools.pairwise(regions):
                if a.end > b.base:
                    raise TransferError(f"region at {b.base:#x} overlaps one registered before")
            parts = dict(self._parts)
            try:
                for region, movable in new:
                    parts[region.base] = self._share(region) if movable else [region]
                table = RegionTable.of(itertools.chain(*parts.values()))
                self._publish(table)
            except BaseException:
                unshare(p for base, p in parts.items() if base not in self._parts)
                raise
            self._parts = parts
            self._own = table
        return 0

    @staticmethod
    def _share(region: Region) -> list[Region]:
        try:
            return share(region)
        except OSError as exc:  # the range stays as it was: written by process_vm_writev
            log.warning(
                "shmslots: %d bytes at %#x stay private: %s", region.length, region.base, exc
            )
            return [region]

    def register(self, ptr: int, length: int) -> int:
        return self.batch_register([ptr], [length])

    @property
    def holds_device_memory(self) -> bool:
        """Whether it registered GPU memory: a peer's copies into it run on the peer's GPU,
        and may land until the peer's process has exited whole (`PeerRegistry.exited`)."""
        return any(r.handle is not None for r in self._own.regions)

    def batch_deregister(self, ptrs: Sequence[int]) -> int:
        """Withdraw the ranges registered at `ptrs`; a moved range goes back onto private
        pages, its bytes kept.  -1, and nothing withdrawn, if one was not registered (as
        Mooncake's engine answers: SGLang deregisters again after a release of its memory,
        and only logs a failure)."""
        with self._lock:
            self._check_open()
            try:  # read as batch_register reads them
                bases: set[int] | None = {integer(p) for p in ptrs}
            except TypeError:
                bases = None
            if bases is None or any(p not in self._parts for p in bases):
                log.warning("shmslots: deregistering %r: not registered; nothing withdrawn", ptrs)
                return -1
            gone = [r for p in bases for r in self._parts.pop(p)]
            table = RegionTable.of(itertools.chain(*self._parts.values()))
            self._publish(table)
            self._own = table
        unshare([gone])
        return 0

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this same-host engine is closed")

    def _publish(self, table: RegionTable) -> None:
        """What peers may write into: all this engine registered, or nothing if it only sends."""
        self.registry.publish(table.regions if self.receives else ())

    def send_probe(self, session: str) -> int:
        """0 while the peer's engine lives, -1 otherwise (and for anything malformed)."""
        try:
            peer = self._acquire(session)
        except ShmSlotsError:  # no registry, or no readable one, under its name
            return -1
        except OSError as exc:  # no descriptors left, say: never raised into SGLang's threads
            log.warning("shmslots: probing %r failed: %s", session, exc)
            return -1
        reg = peer.registry
        try:
            with peer.lock:
                reg.refresh()  # its owner's pid, for `exiting`
            if reg.lives():
                return 0
            self._drop(session, peer)
            return -1
        except TransferError:  # its registry is malformed
            return -1
        finally:
            self._release(peer)

    def batch_transfer_sync(
        self, session: str, sources: Sequence[int], targets: Sequence[int], lengths: Sequence[int]
    ) -> int:
        """Mooncake's contract: 0 when every byte landed, -1 otherwise (logged by SGLang)."""
        try:
            self.transfer(session, sources, targets, lengths)
        except (PeerGone, EngineClosed):
            # no fault of the caller's, so no warning: an exiting process's transfer threads
            # still start transfers after it retired its engines
            self.failed += 1
            return -1
        except ShmSlotsError as exc:
            log.warning("shmslots same-host transfer refused: %s", exc)
            self.refused += 1
            return -1
        except Exception:  # SGLang's transfer worker dies on an exception: fail the room
            log.exception("shmslots same-host transfer failed")
            self.refused += 1
            return -1
        return 0

    # -- the engine itself --------------------------------------------------------------
    def transfer(
        self, session: str, sources: Sequence[int], targets: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Write each `lengths[i]` bytes at `sources[i]` (registered here) to `targets[i]`
        (registered by the peer).  Every block is checked before the first is written."""
        peer = self._acquire(session)
        try:
            self._transfer(session, peer, sources, targets, lengths)
        finally:
            self._release(peer)

    def _transfer(
        self,
        session: str,
        peer: Peer,
        sources: Sequence[int],
        targets: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        reg = peer.registry
        if not reg.alive():
            self._drop(session, peer)
            raise PeerGone(f"the peer of session {session!r} is dead")
        with peer.lock:
            reg.refresh()
            table, seq = reg.table, reg.seq
        planned = plan(self._own, table, reg.name, sources, targets, lengths)
        parts = 1  # overlapping targets land in call order, the later last: not side by side
        if planned.n.sum() >= PARALLEL_BYTES and not cuda_kv.overlapping(planned.dst, planned.n):
            parts = COPY_THREADS
        try:
            writes, copies = self._jobs(peer, planned, parts)
            # a write first, alone: what refuses one (the owner's pid not vouched for, ptrace
            # access denied) refuses all, and so before any byte moved into the peer's files
            self._run(writes[:1], parallel=False)
            self._run(writes[1:] + copies, parallel=parts > 1)
        except (OSError, cuda_kv.DeviceError) as exc:
            alive = _still_alive(reg)
            self._drop(session, peer)
            kind = TransferError if alive else PeerGone
            raise kind(f"write into {reg.name!r} failed: {exc}") from None
        if not reg.lives():  # it died meanwhile: its shared pages or GPU
            # memory took the bytes (its lock goes only once its memory is torn down, which
            # takes 100s of ms for GiBs; its threads' exit flags are set at once)
            self._drop(session, peer)
            raise PeerGone(f"the peer of session {session!r} died during the transfer")
        _check_still_listed(peer, planned, seq)

    @staticmethod
    def _jobs(
        peer: Peer, plan: Plan, parts: int
    ) -> tuple[list[Callable[[], None]], list[Callable[[], None]]]:
        """The plan as jobs, (writes, copies): host blocks into the peer's anonymous memory
        by process_vm_writev, and into its mapped files by memmove, each split into up to
        `parts`; GPU blocks one copy job per source GPU, on a stream of it (cuda_kv)."""
        regions = plan.regions
        jobs: list[Callable[[], None]] = []
        write_jobs: list[Callable[[], None]] = []
        for route, gpu in enumerate(plan.routes):
            src, dst, n, held = plan.src, plan.dst, plan.n, plan.region
            if len(plan.routes) > 1:
                mine = plan.route == route
                src, dst, n, held = src[mine], dst[mine], n[mine], held[mine]
            used = set(held.tolist())
            delta = np.zeros(len(regions), dtype=np.int64)  # target address - region's base
            if gpu is not None:
                for i in used:
                    delta[i] = peer.device_mapping(regions[i], gpu) - regions[i].base
                drv = cuda_kv.driver()
                assert drv is not None  # device_mapping opened the targets through it
                jobs.append(functools.partial(drv.copy, gpu, src, dst + delta[held], n))
                continue
            files = np.zeros(len(regions), dtype=bool)
            for i in used:
                at = peer.mapping(regions[i]) if regions[i].mapped else None
                if at:
                    files[i], delta[i] = True, at - regions[i].base
            into = files[held]
            target = dst + delta[held]
            if into.all():  # all into mapped files (SGLang's pools, moved onto memfds)
                copies, writes = _triples(src, target, n), []
            else:
                copies = _triples(src[into], target[into], n[into])
                writes = _triples(src[~into], dst[~into], n[~into])
            jobs += [functools.partial(_copy, part) for part in _split(copies, parts)]
            write_jobs += [functools.partial(peer.write, part) for part in _split(writes, parts)]
        return write_jobs, jobs

    def _run(self, jobs: Sequence[Callable[[], None]], parallel: bool = True) -> None:
        """Run `jobs`: this thread runs the first, then each that no copy thread has begun
        (the copy threads are offered all but the first, and are busy at times with other
        calls' jobs: SGLang transfers on several threads at once); not `parallel`, all on this
        thread (a copy thread's wake-up costs more than a small call's copies).  No job
        begins once a failure is seen; the call returns, or raises a failure, only once
        every job begun has ended and no other can begin: no write may land after."""
        threads = None
        if parallel and len(jobs) > 1:
            with self._lock:
                if self._threads is None and not self._closed:  # none made once retired
                    self._threads = ThreadPoolExecutor(max(1, COPY_THREADS - 1), "shmslots-copy")
                threads = self._threads
        if threads is None:
            for job in jobs:
                job()
            return
        failed = threading.Event()

        def guarded(job: Callable[[], None]) -> None:
            if failed.is_set():
                return
            try:
                job()
            except BaseException:
                failed.set()
                raise

        futures: list[Future[None]] = []
        failure: BaseException | None = None
        try:
            for job in jobs[1:]:
                try:
                    futures.append(threads.submit(guarded, job))
                except RuntimeError as exc:  # close() shut the copy threads: the rest run here
                    if not str(exc).startswith("cannot schedule new futures"):
                        raise
                    break
            guarded(jobs[0])
            for i, job in enumerate(jobs[1:]):
                if i >= len(futures) or futures[i].cancel():  # no copy thread took it
                    guarded(job)
        except BaseException as exc:
            failure = exc
            failed.set()  # a job queued but not offered (a failed submit) stays undone
            for future in futures:
                future.cancel()
        begun = [future for future in futures if not future.cancelled()]
        while True:  # (a cancelled one counts as done only once a copy thread reaches it)
            try:
                wait(begun)
                break
            except BaseException as exc:  # an interrupt: still no return while one writes
                failure = failure or exc
                failed.set()
        for future in begun:
            failure = failure or future.exception()
        if failure is not None:
            raise failure

    def _acquire(self, session: str) -> Peer:
        """The session's peer, opened on first use, with one more user.  A new session
        first lets go of dead peers: a restarted decode's old mappings (its GPU memory
        above all, which its new process may be allocating again) go before the new ones."""
        doomed: list[Peer | FileMapping | DeviceMapping] = []
        try:
            with self._lock:
                if self._closed:
                    raise EngineClosed("this same-host engine is closed")
                peer = self._peers.get(session)
                if peer is None:
                    doomed = self._prune()
                    name, inode = parse_session(session)
                    peer = Peer(PeerRegistry(name, inode))
                    self._peers[session] = peer
                    if self._pruner is None:
                        self._pruner = threading.Thread(
                            target=_prune_every,
                            args=(weakref.ref(self), self._stop),
                            name="shmslots-prune",
                            daemon=True,
                        )
                        self._pruner.start()
                peer.users += 1
                self._busy.add(peer)
                return peer
        finally:
            close_all(doomed)

    def prune(self) -> None:
        """Let go of idle peers whose engine died, and of mappings a live peer no longer
        registers: each holds its file's or GPU allocation's memory.  (A restarted decode is
        a new session, and SGLang probes only failed ones: nothing else would drop the old
        one.)  The pruner thread calls it every PRUNE_EVERY_S."""
        with self._lock:
            doomed = [] if self._closed else self._prune()
        close_all(doomed)

    def _prune(self) -> list[Peer | FileMapping | DeviceMapping]:
        """What `prune` lets go of, taken out under the engine's lock (no transfer uses
        these peers) for the caller to close outside it."""
        doomed: list[Peer | FileMapping | DeviceMapping] = []
        for session, peer in list(self._peers.items()):
            if peer.users:
                continue
            try:
                if peer.registry.alive():
                    with contextlib.suppress(TransferError):  # malformed: the list as last read
                        peer.registry.refresh()
                    doomed += peer.unlisted()
                    continue
            except Exception:  # one peer's trouble must not stop the others', or new sessions
                log.exception("shmslots: pruning %r failed", peer.registry.name)
                continue
            del self._peers[session]
            doomed.append(peer)
        return doomed

    def _release(self, peer: Peer) -> None:
        with self._lock:
            peer.users -= 1
            idle = peer.users == 0
            if idle:
                self._busy.discard(peer)
                self._idle.notify_all()
            last = peer.dropped and idle
            done = idle and self._closed and not self._busy
        if last:
            peer.close()
        if done:  # the transfers that outlived retiring have ended: peers may see it gone
            self.registry.close()

    def _drop(self, session: str, peer: Peer) -> None:
        """Take a dead or failed peer out of the table; its last user closes it (a mapping is
        never unmapped under another thread's copy)."""
        with self._lock:
            if self._peers.get(session) is peer:
                del self._peers[session]
            peer.dropped = True

    def close(self, wait_s: float = 10.0) -> None:
        """Retire (`_retire`), then give back what the engine holds: its pruner, and the
        registered ranges, moved back onto private pages."""
        if not self._retire(wait_s):
            return
        pruner = self._pruner
        if pruner is not None and pruner is not threading.current_thread():
            pruner.join(PRUNE_EVERY_S + 5)  # it may be unmapping: not left running at exit
        parts, self._parts = self._parts, {}
        unshare(parts.values())

    def _retire(self, wait_s: float) -> bool:
        """Refuse new transfers, wait (up to `wait_s`) for those running, let go of every
        peer, then remove the registry, so peers see this engine gone only once none of its
        writes can still land.  False if it was retired before."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._stop.set()
            self.registry.publish([])  # peers start no more writes here
            peers, self._peers = list(self._peers.values()), {}
            for peer in peers:
                peer.dropped = True
            self._idle.wait_for(lambda: not self._busy, timeout=wait_s)
            idle = [p for p in peers if p.users == 0]
            lingering = bool(self._busy)
        for peer in idle:  # a transfer still running past wait_s closes its own peer
            peer.close()
        if not lingering:
            self.registry.close()
        else:  # peers must not see this engine gone while a write of it may land
            log.warning("shmslots: a transfer outlived retiring; its end removes the registry")
        if self._threads is not None:  # a copy still running ends on its own, joined by its call
            self._threads.shutdown(wait=False)
        return True

    def __enter__(self) -> SameHostEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_engines: weakref.WeakSet[SameHostEngine] = weakref.WeakSet()


def _close_engines_in_child() -> None:
    """A child made by fork() gets its parent's engines closed: they are its parent's, and
    so are their memfds, whose ranges are not mapped here (MADV_DONTFORK).  Its copies of
    their peers' pidfds and registries go too; their peers' files were neither mapped nor
    open here (`FileMapping`: a peer's memory stays while any process maps or opens it, and
    a mapping held by another thread at the fork was out of reach here), nor their GPU
    memory opened."""
    for engine in list(_engines):
        # a lock the pruner held at the fork stays held here: new ones
        engine._lock = threading.Lock()
        engine._idle = threading.Condition(engine._lock)
        peers = set(engine._peers.values()) | engine._busy
        engine._closed, engine._peers, engine._busy = True, {}, set()
        for peer in peers:
            with contextlib.suppress(Exception):  # never raised into the child's fork()
                peer.close_in_child()
        parts, engine._parts = engine._parts, {}
        engine._own = EMPTY
        for region in itertools.chain(*parts.values()):
            if region.memfd >= 0:
                with contextlib.suppress(OSError):
                    os.close(region.memfd)


os.register_at_fork(after_in_child=_close_engines_in_child)


def _retire_at_exit() -> None:
    """A process that exits in userspace retires its engines, so peers see them gone now,
    not only when a sweep comes: SGLang's scheduler exits so on a graceful shutdown without
    tearing its manager down, and its transfer threads, daemons, may still be writing.  The
    ranges stay where they are (the process is ending); a forked child's engines are closed
    already (`_close_engines_in_child`)."""
    for engine in list(_engines):
        with contextlib.suppress(Exception):
            engine._retire(EXIT_WAIT_S)


EXIT_WAIT_S = 5.0  # how long an exiting process waits for its running transfers
atexit.register(_retire_at_exit)


PRUNE_EVERY_S = 1.0  # how often the pruner looks for dead peers and unlisted mappings


def _prune_every(engine: weakref.ref[SameHostEngine], stop: threading.Event) -> None:
    """The pruner: an idle prefill lets go of a dead decode's memory too (within a second),
    not only at its next transfer."""
    while not stop.wait(PRUNE_EVERY_S):
        alive = engine()
        if alive is None:
            return
        try:
            alive.prune()
        except Exception:  # logged, and pruning goes on
            log.exception("shmslots: pruning failed")
        del alive


COPY_THREADS = min(4, len(os.sched_getaffinity(0)))  # one copy thread saturates no host
PARALLEL_BYTES = 4 << 20  # a call moving less goes on its caller's thread alone


_copy = copy_blocks  # a job's (source, target, length) blocks here: one call (csrc/blockcopy.c)


def _triples(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> list[tuple[int, int, int]]:
    """(source, target, length) blocks of the plan's columns, as `_copy` and `Peer.write` take."""
    return list(zip(src.tolist(), dst.tolist(), n.tolist(), strict=True))


def _split(blocks: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """`blocks` cut into up to `parts` runs of about equal bytes (cut at 4 KiB multiples),
    in order; [] for none."""
    if not blocks or parts < 2:
        return [blocks] if blocks else []
    total = sum(n for _, _, n in blocks)
    share = -(-total // parts // 4096) * 4096  # ceil(total / parts), up to 4 KiB
    runs: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for src, dst, n in blocks:
        while n:
            k = min(n, room)
            runs[-1].append((src, dst, k))
            src, dst, n, room = src + k, dst + k, n - k, room - k
            if not room:
                runs.append([])
                room = share
    return [run for run in runs if run]


def _check_still_listed(peer: Peer, planned: Plan, seq: int) -> None:
    """Fail a call if a file region it wrote was deregistered meanwhile: the peer moved
    that range back onto private pages and let go of the file, so bytes copied into the file
    after that never reach it.  The peer lists the range no more before it moves the pages
    (with a full fence between, as here between the copies and the look), so a list read
    after the copies that still names every file region written means each copy landed
    while the file still held the range (and moved back with it).  `seq` is the list's the
    plan was made from: any other thread may have read a newer one since."""
    reg = peer.registry
    fence()
    with peer.lock:
        reg.refresh()
        if reg.seq == seq:
            return
    listed = {(r.memfd, r.inode) for r in reg.table.regions if r.memfd >= 0}
    written = (planned.regions[i] for i in set(planned.region.tolist()))
    # a /dev/shm file's range is never moved: bytes written there reached the peer anyway
    gone = [r for r in written if r.memfd >= 0 and (r.memfd, r.inode) not in listed]
    if gone:
        raise TransferError(
            f"{reg.name!r} deregistered the region at {gone[0].base:#x} during the transfer: "
            "its bytes may not have reached it"
        )
