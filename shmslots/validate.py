"""Refuse anything that is not a valid table of ours, with a clear error.

The segment is untrusted input: every size and offset is checked by the
layout validator before anything else reads it.
"""

from __future__ import annotations

import os
import time

from . import layout as L
from .errors import CorruptTable, SchemaError, TablePermissionError
from .schema import RowSchema
from .segment import Segment

# A creator writes the magic last; an attacher that sees none waits this long.
INIT_WAIT_S = 2.0


def read_valid_header(segment: Segment) -> L.Header:
    """Read the header, waiting briefly for a creator that is still initialising."""
    deadline = time.monotonic() + INIT_WAIT_S
    while True:
        raw = bytes(segment.mm[: min(L.HEADER_SIZE, segment.size)])
        if raw[:8] != b"\0" * 8 or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    header = L.read_header(raw, segment.size)
    if header.creator_uid != os.getuid():
        raise TablePermissionError(
            f"table {segment.name!r} belongs to uid {header.creator_uid}, this process is "
            f"uid {os.getuid()}"
        )
    return header


def read_schema(segment: Segment, header: L.Header) -> RowSchema:
    lay = header.layout
    try:
        schema = RowSchema.decode(bytes(segment.mm[lay.schema : lay.schema + lay.schema_len]))
    except SchemaError as exc:
        raise CorruptTable(f"table {segment.name!r}: {exc}") from None
    if schema.row_size != lay.row_size:
        raise CorruptTable(f"schema gives {schema.row_size}-byte rows, header says {lay.row_size}")
    return schema
