"""The EAGLE metadata row of a transferred request, derived from its tag.

Every value is a function of the tag (a bootstrap-room-like id), so a
reader verifies a row with no side channel: if a later transfer overwrote
the row, the values belong to another tag and verification fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from shmslots import Field
from shmslots.schema import RowSchema

DEFAULT_TOPK = 16
DEFAULT_HIDDEN = 4096


@dataclass(frozen=True)
class RowShape:
    topk: int = DEFAULT_TOPK
    hidden: int = DEFAULT_HIDDEN

    @classmethod
    def of(cls, schema: RowSchema) -> RowShape:
        """The shape of a schema made by `fields()` (a remote writer learns it this way)."""
        slots = schema.slots
        return cls(slots["topk_p"].field.fixed_shape[0], slots["hidden"].field.fixed_shape[0])

    def fields(self) -> tuple[Field, ...]:
        return (
            Field("output_id", "int64"),
            Field("cached_tokens", "int64"),
            Field("commit_ns", "int64"),
            Field("topk_p", "float32", (self.topk,)),
            Field("topk_index", "int64", (self.topk,)),
            Field("hidden", "bfloat16", (self.hidden,)),
        )


@lru_cache(maxsize=8)
def _bases(topk: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.linspace(1.0, 0.01, topk, dtype=torch.float32)
    index = torch.arange(topk, dtype=torch.int64)
    h = torch.linspace(-1.0, 1.0, hidden, dtype=torch.float32)
    return p, index, h


def scale(tag: int) -> int:
    """Small per-tag factor, exact in bf16 products with the base vectors."""
    return tag % 61 + 1


def output_id(tag: int) -> int:
    return tag * 7 % 151_936


def cached_tokens(tag: int) -> int:
    return tag % 4096


def topk_p(tag: int, shape: RowShape) -> torch.Tensor:
    return _bases(shape.topk, shape.hidden)[0] / scale(tag)


def topk_index(tag: int, shape: RowShape) -> torch.Tensor:
    return _bases(shape.topk, shape.hidden)[1] * 1000 + tag % 997


def hidden(tag: int, shape: RowShape) -> torch.Tensor:
    return (_bases(shape.topk, shape.hidden)[2] * scale(tag)).to(torch.bfloat16)


def row_values(tag: int, shape: RowShape, commit_ns: int) -> dict[str, object]:
    return {
        "output_id": output_id(tag),
        "cached_tokens": cached_tokens(tag),
        "commit_ns": commit_ns,
        "topk_p": topk_p(tag, shape),
        "topk_index": topk_index(tag, shape),
        "hidden": hidden(tag, shape),
    }


def matches(
    tag: int, shape: RowShape, out_id: int, p: torch.Tensor, idx: torch.Tensor, h: torch.Tensor
) -> bool:
    """Whether consumed values are exactly the ones transferred for `tag`."""
    return (
        out_id == output_id(tag)
        and torch.equal(p, topk_p(tag, shape))
        and torch.equal(idx, topk_index(tag, shape))
        and torch.equal(h, hidden(tag, shape))
    )
