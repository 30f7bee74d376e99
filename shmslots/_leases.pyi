from collections.abc import Callable, Iterable, Mapping
from typing import Any, Self

import torch

from ._hotpath import HotPath
from ._rowcodec import RowCodec
from .handles import Pin
from .leases import Lease, WriteSlot
from .table import SlotTable

class WatchedTensors:
    """Tensors handed out to callers, with the reference counts they have at rest.

    Rest counts are taken as the object is made: pass a dict built for the call, whose
    tensors nothing else refers to but what holds them for good.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], /) -> None: ...
    @property
    def tensors(self) -> Mapping[str, torch.Tensor]: ...
    def leaked(self, names: Iterable[str], /) -> list[str]: ...
    def moved(self, names: Iterable[str], /) -> list[str]: ...

class HandleCore:
    """What one table's handles share: its compiled steps, rows and closed flag."""

    closed: bool
    def __init__(
        self,
        hot: HotPath,
        codec: RowCodec,
        views: list[WatchedTensors | None],
        make_views: Callable[[int], WatchedTensors],
        write_slot: type[WriteSlotCore],
        lease: type[LeaseCore],
        *,
        claim: tuple[int, int],
        abort_writing: tuple[int, int, int],
        release_held: tuple[int, int, int],
        abort_held: tuple[int, int, int],
        nfields: int,
        plain_claim: bool,
        strict: bool,
    ) -> None: ...
    def claim(self, table: SlotTable, tag: int, /) -> WriteSlot | None: ...
    def take(self, table: SlotTable, /) -> Lease | int | None: ...

class HandleBase:
    @property
    def _table(self) -> SlotTable: ...
    @property
    def slot(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def tag(self) -> int: ...
    _open: bool
    @property
    def _viewed(self) -> set[str]: ...
    def __init__(self, table: SlotTable, slot: int, generation: int, tag: int, /) -> None: ...

class WriteSlotCore(HandleBase):
    _pins: dict[str, Pin] | None
    _watched: WatchedTensors | None
    @property
    def _written(self) -> set[str]: ...
    def write(self, **fields: Any) -> Self: ...
    def publish(self, timeout: float = 1.0) -> None: ...
    def abort(self) -> None: ...

class LeaseCore(HandleBase):
    @property
    def deliveries(self) -> int: ...
    _opened: dict[str, WatchedTensors] | None
    @property
    def _watched(self) -> WatchedTensors: ...
    def view(self, name: str, /) -> torch.Tensor: ...
    def item(self, name: str, /) -> int | float: ...
    def release(self) -> None: ...
    def abort(self) -> None: ...
