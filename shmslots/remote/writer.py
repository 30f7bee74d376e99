"""The remote side: pack rows with the table's own row code, write each field into the
owner's row, commit with the row's checksum."""

from __future__ import annotations

import mmap
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .._core import AtomicView
from ..errors import InvalidArgument, SchemaError
from ..layout import VERSION
from ..rows import ColumnBlock, Rows
from ..schema import RowSchema
from .engine import Engine, address_of
from .grant import COMMIT, Grant, GrantError, require_inline, row_format

GrantedRow = tuple[Grant, Mapping[str, Any]]
# keeps a batch's commit message (48 bytes a row at most) below the engine's notify limit
MAX_BATCH = 1024


class RemoteWriter:
    """Writes granted rows through the engine, `batch` rows per transfer.

    Rows are packed by the table's own row code into a registered staging buffer laid out
    as the table is (one column per field), then written field by field straight into the
    granted slot's items, one engine entry per field for rows of adjacent slots (each entry
    costs a round of its own over TCP); the commit carries each row's checksum (`row_hash`
    of the fields' bytes), which the owner checks in place before it publishes.
    """

    def __init__(self, engine: Engine, schema: RowSchema, *, batch: int = 64) -> None:
        require_inline(schema)
        if not 1 <= batch <= MAX_BATCH:
            raise InvalidArgument(f"batch must be in 1..{MAX_BATCH}, got {batch}")
        self.engine = engine
        self.schema = schema
        self.batch = batch
        self._item_lens = tuple(fs.item_len for fs in schema.slots.values())
        self._lengths = tuple(fs.field.nbytes for fs in schema.slots.values())
        block = ColumnBlock(batch, schema.row_size)
        self._staging = mmap.mmap(-1, block.size)
        self._atomics = AtomicView(self._staging)
        self._rows = Rows(self._staging, block, schema, self._atomics)
        self._base = address_of(self._staging)
        # where each staging column starts, in field order (strides: the table's item_lens)
        self._columns = [self._base + self._rows.item(0, name) for name in schema.slots]
        try:
            engine.register(self._base, len(self._staging))
        except BaseException:
            self._release()
            raise

    def connect(self, contact: bytes) -> str:
        """Load an owner's `RemoteServer.contact()` (once per server, before its grants)."""
        return self.engine.connect(contact)

    def write(self, rows: Sequence[GrantedRow], *, commit: bool = True) -> None:
        """Write each granted row; with `commit`, the owner publishes those that verify.

        Every row is checked (grant, fields, dtypes, shapes) before anything
        is sent.  Rows for one owner go `batch` per engine call, the commit
        message riding behind them.  A commit is not acknowledged: the
        owner's `poll()` says what was published.
        """
        by_session: dict[str, list[tuple[Grant, list[tuple[str, Any]]]]] = defaultdict(list)
        for grant, values in rows:
            self._check(grant, values)
            by_session[grant.session].append((grant, self._rows.prepare(dict(values))))
        for session, planned in by_session.items():
            for start in range(0, len(planned), self.batch):
                self._send(session, planned[start : start + self.batch], commit)

    def _check(self, grant: Grant, values: Mapping[str, Any]) -> None:
        if (
            grant.fingerprint != row_format(self.schema)
            or grant.item_lens != self._item_lens
            or grant.lengths != self._lengths
        ):
            raise GrantError(
                f"grant for slot {grant.slot} is for another row layout or table format "
                f"(fingerprint {grant.fingerprint:#x}, items {list(grant.item_lens)}, field "
                f"bytes {list(grant.lengths)}; this writer's table format is version {VERSION})"
            )
        missing = self.schema.slots.keys() - values.keys()
        if missing:
            raise SchemaError(f"row for tag {grant.tag} lacks fields {sorted(missing)}")

    def _send(
        self, session: str, planned: list[tuple[Grant, list[tuple[str, Any]]]], commit: bool
    ) -> None:
        """One engine call for these rows: each field of each run of rows whose slots lie
        side by side goes as one entry (their staging rows lie side by side too, and so do
        the items' paddings between them)."""
        planned.sort(key=lambda row: row[0].slot)  # slots granted in a row, rows in a run
        rows = self._rows
        entries = []
        runs: list[tuple[int, Grant, int]] = []  # (first staging row, its grant, rows)
        for cell, (grant, plan) in enumerate(planned):
            rows.write(cell, plan)
            entries.append(grant.commit(rows.checksum(cell)))
            if runs and _follows(runs[-1][1], runs[-1][2], grant):
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((cell, grant, 1))
        sources: list[int] = []
        targets: list[int] = []
        lengths: list[int] = []
        for i, (column, item_len, nbytes) in enumerate(
            zip(self._columns, self._item_lens, self._lengths, strict=True)
        ):
            for cell, first, n in runs:
                sources.append(column + item_len * cell)
                targets.append(first.ptrs[i] + item_len * first.slot)
                lengths.append(item_len * (n - 1) + nbytes)
        self.engine.write(
            session, sources, targets, lengths, (COMMIT, ";".join(entries)) if commit else None
        )

    def _release(self) -> None:
        self._rows.close()
        self._atomics.release()
        self._staging.close()

    def close(self) -> None:
        try:
            self.engine.unregister(self._base)
        finally:
            self._release()

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _follows(first: Grant, n: int, grant: Grant) -> bool:
    """Whether `grant`'s row lies right after the `n` rows from `first`'s, in the same table."""
    return grant.slot == first.slot + n and grant.ptrs == first.ptrs
