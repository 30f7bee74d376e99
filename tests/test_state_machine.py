"""Property-based: random sequences of operations against a plain model of the lifecycle."""

from __future__ import annotations

import itertools
import os
from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from shmslots import Field, Lease, Reservation, SlotsExhausted, SlotTable, State, WriteSlot

SLOTS = 4
SCHEMA = (Field("v", "int64"),)
_names = itertools.count()


class Lifecycle(RuleBasedStateMachine):
    """Two participants (producer, consumer) on one table, checked after every step."""

    writes = Bundle("writes")
    leases = Bundle("leases")
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.name = f"shmslots-test-{os.getpid()}-sm{next(_names)}"
        self.producer = SlotTable.create(self.name, SCHEMA, slots=SLOTS)
        self.consumer = SlotTable.attach(self.name, "consumer")
        # model: slot -> (state, generation, owner participant or -1)
        self.model = {s: (State.FREE, 0, -1) for s in range(SLOTS)}
        self.queue: deque[int] = deque()  # READY slots, in publish order
        # Entries still in the ready ring, in order: a cancelled slot's entry stays
        # until a take passes it (or a claimer that finds no other FREE slot drops the
        # stale entries at the head), and until then the slot cannot be claimed.
        self.ring: deque[tuple[int, bool]] = deque()  # (slot, still READY there)
        self.tags = itertools.count(1)

    def _set(self, slot: int, state: State, owner: int = -1, bump: bool = False) -> None:
        _, generation, _ = self.model[slot]
        self.model[slot] = (state, generation + bump, owner)

    def _free_slots(self) -> int:
        queued = {slot for slot, _ in self.ring}
        return sum(
            1 for slot, (s, _, _) in self.model.items() if s is State.FREE and slot not in queued
        )

    def _claimable(self) -> bool:
        """Whether a claim finds a slot, dropping stale head entries as the claimer does."""
        if self._free_slots():
            return True
        queued = {slot for slot, _ in self.ring}
        if not any(s is State.FREE and slot in queued for slot, (s, _, _) in self.model.items()):
            return False
        while self.ring and not self.ring[0][1]:
            self.ring.popleft()
        return bool(self._free_slots())

    @rule(target=writes)
    def claim(self) -> WriteSlot | None:
        if not self._claimable():
            try:
                self.producer.claim(timeout=0.0)
            except SlotsExhausted:
                return None
            raise AssertionError("claimed from a full table")
        ws = self.producer.claim(tag=next(self.tags), timeout=0.0)
        assert self.model[ws.slot][0] is State.FREE
        assert ws.slot not in {slot for slot, _ in self.ring}
        self._set(ws.slot, State.WRITING, self.producer.participant)
        return ws

    @rule(target=reservations)
    def reserve(self) -> Reservation | None:
        if not self._claimable():
            return None
        res = self.consumer.reserve(tag=next(self.tags), timeout=0.0)
        self._set(res.slot, State.RESERVED, self.consumer.participant)
        return res

    @rule(target=writes, res=consumes(reservations))
    def open_reserved(self, res: Reservation | None) -> WriteSlot | None:
        if res is None:
            return None
        ws = self.producer.open_reserved(res.slot, res.generation)
        self._set(ws.slot, State.WRITING, self.producer.participant)
        return ws

    @rule(res=consumes(reservations))
    def abort_reservation(self, res: Reservation | None) -> None:
        if res is not None:
            res.abort()
            self._set(res.slot, State.FREE, bump=True)

    @rule(ws=consumes(writes), value=st.integers(-(2**63), 2**63 - 1))
    def publish(self, ws: WriteSlot | None, value: int) -> None:
        if ws is not None:
            ws.write(v=value).publish()
            self._set(ws.slot, State.READY)
            self.queue.append(ws.slot)
            self.ring.append((ws.slot, True))

    @rule(target=leases, ws=consumes(writes), value=st.integers(-(2**63), 2**63 - 1))
    def keep(self, ws: WriteSlot | None, value: int) -> Lease | None:
        """The writer holds its own row: HELD by the producer, never queued."""
        if ws is None:
            return None
        lease = ws.write(v=value).keep()
        self._set(ws.slot, State.HELD, self.producer.participant)
        assert lease.item("v") == value and lease.verify()
        return lease

    @rule(ws=consumes(writes))
    def abort_write(self, ws: WriteSlot | None) -> None:
        if ws is not None:
            ws.abort()
            self._set(ws.slot, State.FREE, bump=True)

    @rule(target=leases)
    def take(self) -> Lease | None:
        lease = self.consumer.take()
        while self.ring and not self.ring[0][1]:
            self.ring.popleft()  # take drops cancelled entries it passes
        if not self.queue:
            assert lease is None
            return None
        assert lease is not None and lease.slot == self.queue.popleft()
        assert self.ring.popleft() == (lease.slot, True)
        self._set(lease.slot, State.HELD, self.consumer.participant)
        return lease

    @rule(lease=consumes(leases), release=st.booleans())
    def finish(self, lease: Lease | None, release: bool) -> None:
        if lease is not None:
            lease.release() if release else lease.abort()
            self._set(lease.slot, State.FREE, bump=True)

    @precondition(lambda self: bool(self.queue))
    @rule(pick=st.integers(0, SLOTS - 1))
    def cancel(self, pick: int) -> None:
        slot = self.queue[pick % len(self.queue)]
        tag = self.producer.slot_info(slot)[3]
        assert self.producer.cancel(tag) == 1
        self.queue.remove(slot)
        self.ring = deque((s, live and s != slot) for s, live in self.ring)
        self._set(slot, State.FREE, bump=True)

    @invariant()
    def table_matches_model(self) -> None:
        for slot, (state, generation, owner) in self.model.items():
            assert self.producer.slot_info(slot)[:3] == (state, generation, owner), slot
        assert self.producer.check_consistency() == []
        assert self.producer.stats().queued >= len(self.queue)

    def teardown(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.producer.unlink()


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
