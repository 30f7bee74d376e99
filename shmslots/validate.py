"""Refuse anything that is not a valid table of ours, with a clear error.

The segment is untrusted input: every size and offset is checked by the
layout validator before anything else reads it.
"""

from __future__ import annotations

import os
import time

from . import layout as L
from .errors import CorruptTable, SchemaError, TableNotReady, TablePermissionError
from .schema import RowSchema
from .segment import Segment

# A creator writes the magic last; an attacher that sees none waits this long.
INIT_WAIT_S = 2.0
# An inspector waits less: a segment still all zeros after this is reported.
INSPECT_WAIT_S = 0.2


def check_owner(segment: Segment, mode: int = 0o600) -> None:
    """Trust a segment for who owns the file, never for what its maker wrote in it: it must
    be this user's, with no permission bit beyond `mode` (0600: tables are made so)."""
    st = os.fstat(segment.fd)
    if st.st_uid != os.geteuid():
        raise TablePermissionError(
            f"table {segment.name!r} is owned by uid {st.st_uid}, this process is uid "
            f"{os.geteuid()}: only this user's tables are trusted"
        )
    if st.st_mode & 0o777 & ~mode:
        raise TablePermissionError(
            f"table {segment.name!r} has mode {st.st_mode & 0o777:o}, wider than {mode:o}: "
            "another user may have written it (pass mode= to attach to accept a wider one)"
        )


def read_valid_header(segment: Segment, wait_s: float | None = None, mode: int = 0o600) -> L.Header:
    """Check the file's owner and mode, then read the header, waiting briefly (INIT_WAIT_S
    unless `wait_s`) for a creator that is still initialising.  The header's creator uid is
    for display only."""
    check_owner(segment, mode)
    deadline = time.monotonic() + (INIT_WAIT_S if wait_s is None else wait_s)
    # The header is copied only once the magic is seen, by an acquire load: on every CPU
    # the copy then holds what the creator wrote before its magic.
    while not L.magic_published(segment.mm) and time.monotonic() < deadline:
        time.sleep(0.01)
    if segment.size >= L.HEADER_SIZE and not L.magic_published(segment.mm):
        raise TableNotReady(  # sized, never finished: a creator at work, or one that died
            f"{segment.name!r} is not a shmslots table (yet): no header; its creator has not "
            "finished making it, or died doing so (`shmslots unlink --force` removes it)"
        )
    return L.read_header(bytes(segment.mm[: min(L.HEADER_SIZE, segment.size)]), segment.size)


def read_schema(segment: Segment, header: L.Header) -> RowSchema:
    """Decode the stored schema; any failure, whatever it is, becomes CorruptTable.

    The blob is untrusted: `read_header` already bounded its length, and a
    decoder bug (TypeError on an unhashable dtype, RecursionError while
    describing a deeply nested entry, ...) must not escape as anything but a
    refusal.
    """
    lay = header.layout
    blob = bytes(segment.mm[lay.schema : lay.schema + lay.schema_len])
    try:
        schema = RowSchema.decode(blob)
    except SchemaError as exc:
        raise CorruptTable(f"table {segment.name!r}: {_clip(str(exc))}") from None
    except Exception as exc:  # untrusted input: refuse, never crash
        raise CorruptTable(
            f"table {segment.name!r}: schema blob cannot be decoded "
            f"({type(exc).__name__}: {_clip(str(exc))})"
        ) from None
    if schema.row_size != lay.row_size:
        raise CorruptTable(f"schema gives {schema.row_size}-byte rows, header says {lay.row_size}")
    return schema


def _clip(text: str, limit: int = 300) -> str:
    """Messages about hostile input quote it; keep them readable."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
