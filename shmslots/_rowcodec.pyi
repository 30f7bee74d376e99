from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import Buffer

def row_hash(buffer: Buffer, /) -> int: ...

class RowCodec:
    """Plain-case row writes and row checksums over one writable buffer of rows."""

    def __init__(
        self,
        buffer: Buffer,
        rows: int,
        row_size: int,
        slots: int,
        header: int,
        specs: tuple[tuple[str, int, int, int, int, torch.dtype, tuple[int, ...]], ...],
        tensor_type: type[torch.Tensor],
        modes_enabled: Callable[[], bool],
        storage_type: type[torch.UntypedStorage],
        /,
    ) -> None: ...
    def write(self, slot: int, fields: dict[str, Any], /) -> bool: ...
    def gather(self, slots: tuple[int, ...] | int, name: str, out: torch.Tensor, /) -> bool: ...
    def read(self, slot: int, name: str, /) -> int | float | None: ...
    def checksum(self, slot: int, /) -> int: ...
    def seal(self, slot: int, generation: int, /) -> None: ...
    def release(self) -> None: ...
