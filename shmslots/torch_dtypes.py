"""The torch dtype of each dtype name a field may have, for the modules that build tensors.

Kept apart from schema.py so that reading a schema (the CLI does) never imports torch.
"""

from __future__ import annotations

import torch

from .schema import DTYPE_SIZES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
