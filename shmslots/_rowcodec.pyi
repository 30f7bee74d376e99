from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import Buffer

REASONS: dict[str, int]
SCALARS: dict[str, int]
NUMBER_WRITES: tuple[str, ...]

def row_hash(items: Sequence[Buffer], /) -> int: ...

class Rules:
    """The checks on a tensor before its bytes are copied into shared memory."""

    def __init__(
        self,
        tensor_type: type[torch.Tensor],
        storage_type: type[torch.UntypedStorage],
        modes_enabled: Callable[[], bool],
        no_torch_function: Callable[[], Any],
        empty: Callable[..., torch.Tensor],
        cpu: torch.device,
        /,
    ) -> None: ...
    def check(self, value: object, dtype: torch.dtype, shape: tuple[int | None, ...], /) -> int: ...
    def copy_into(
        self,
        buffer: Buffer,
        offset: int,
        nbytes: int,
        value: object,
        dtype: torch.dtype,
        shape: tuple[int | None, ...],
        /,
    ) -> int: ...

class RowCodec:
    """Plain-case row writes and row checksums over the columns of one writable buffer."""

    def __init__(
        self,
        buffer: Buffer,
        seals: int,
        slots: int,
        specs: tuple[tuple[str, int, int, int, int, int, torch.dtype, tuple[int, ...]], ...],
        rules: Rules,
        /,
    ) -> None: ...
    def write(self, slot: int, fields: dict[str, Any], /) -> bool: ...
    def gather(self, slots: tuple[int, ...] | int, name: str, out: torch.Tensor, /) -> bool: ...
    def scatter(self, slots: tuple[int, ...] | int, name: str, values: object, /) -> bool: ...
    def copied(self, slot: int, name: str, /) -> torch.Tensor | None: ...
    def read(self, slot: int, name: str, /) -> int | float | None: ...
    def checksum(self, slot: int, /) -> int: ...
    def seal(self, slot: int, generation: int, /) -> None: ...
    def release(self) -> None: ...
