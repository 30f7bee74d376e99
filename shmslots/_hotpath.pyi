from typing_extensions import Buffer

class HotPath:
    """The per-request slot transitions of one participant, compiled (see _hotpath.c)."""

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
        ring: int,
        ring_cap: int,
        head: int,
        tail: int,
        publish_seq: int,
        readers_waiting: int,
        release_seq: int,
        claimers_waiting: int,
        publishes_counter: int,
        takes_counter: int,
        me: int,
        transitions: bytes,
        owner_checked: int,
        events: tuple[int, int, int],
        states: tuple[int, int, int, int],
        pending_states: int,
        corrupt: type[Exception],
    ) -> None: ...
    def acquire(self, event: int, tag: int, counter_off: int, /) -> tuple[int, int] | None: ...
    def publish(self, slot: int, generation: int, /) -> int: ...
    def take(self) -> tuple[int, int, int, int] | int | None: ...
    def free(
        self, slot: int, generation: int, state: int, event: int, counter_off: int, /
    ) -> int: ...
    def push(self, slot: int, /) -> int: ...
    def drop_stale_head(self) -> bool: ...
    def transition(self, word: int, event: int, actor: int, /) -> int | None: ...
    def init_ring(self) -> None: ...
    def forget_position(self, slot: int, /) -> None: ...
    def queued(self) -> int: ...
    def release(self) -> None: ...
