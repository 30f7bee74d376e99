from typing_extensions import Buffer

STATES: dict[str, int]
EVENTS: dict[str, int]
COUNTERS: tuple[str, ...]

class HotPath:
    """Every slot transition of one participant, compiled (see _hotpath.c)."""

    def __init__(
        self,
        buffer: Buffer,
        *,
        bitmap: int,
        nwords: int,
        tail_mask: int,
        entries: int,
        entry_size: int,
        nslots: int,
        tag_off: int,
        stamp_off: int,
        qpos_off: int,
        deliveries_off: int,
        deadline_off: int,
        ring: int,
        ring_cap: int,
        head: int,
        tail: int,
        publish_seq: int,
        readers_waiting: int,
        readers_until: int,
        release_seq: int,
        claimers_waiting: int,
        claimers_until: int,
        registry: int,
        reg_entry: int,
        reg_capacity: int,
        reg_state: int,
        counters: tuple[int, ...],
        hist_held: int,
        hist_ready: int,
        hist_sum: int,
        hist_bounds: tuple[int, ...],
        me: int,
        transitions: bytes,
        owner_checked: int,
        corrupt: type[Exception],
    ) -> None: ...
    def acquire(self, event: int, tag: int, /) -> tuple[int, int] | None: ...
    def open_reserved(self, slot: int, generation: int, /) -> int | None: ...
    def publish(self, slot: int, generation: int, /) -> int: ...
    def keep(self, slot: int, generation: int, /) -> int: ...
    def quarantine(self, slot: int, generation: int, state: int, deadline_ns: int, /) -> int: ...
    def expire(self) -> int: ...
    def writing(self, slot: int, generation: int, /) -> bool: ...
    def take(self) -> tuple[int, int, int, int] | None: ...
    def free(self, slot: int, generation: int, state: int, event: int, /) -> int: ...
    def redeliver(self, slot: int, generation: int, unread: bool, /) -> int: ...
    def cancel(self, tag: int, /) -> int: ...
    def reclaim_owner(self, owner: int, drop_held: bool, /) -> tuple[int, int, int, int, int]: ...
    def reap_entry(
        self, fd: int, index: int, drop_held: bool, /
    ) -> tuple[int, int, int, int, int] | None: ...
    def requeue_stranded(self, min_age_ns: int, /) -> int: ...
    def leave(self, fd: int, drop_held: bool, /) -> tuple[int, int, int, int, int] | None: ...
    def transition(self, word: int, event: int, actor: int, /) -> int | None: ...
    def init_ring(self) -> None: ...
    def queued(self) -> int: ...
    def release(self) -> None: ...

def _kill_at(point: int, /) -> None: ...
