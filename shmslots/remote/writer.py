"""The remote side: pack rows exactly as the owner's table lays them out, write, commit."""

from __future__ import annotations

import mmap
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .._atomic import AtomicView
from ..errors import InvalidArgument, SchemaError
from ..rows import RowBlock, Rows
from ..schema import RowSchema
from .engine import Engine, address_of
from .grant import COMMIT, Grant, GrantError

GrantedRow = tuple[Grant, Mapping[str, Any]]
MAX_BATCH = 1024  # keeps a batch's commit message far below the engine's notify limit


class RemoteWriter:
    """Writes granted rows through the engine, `batch` rows per transfer.

    Rows are packed by the table's own row code into registered staging
    cells (fields, generation and checksum in the header), so the owner can
    check a copied row exactly as it checks its own.
    """

    def __init__(self, engine: Engine, schema: RowSchema, *, batch: int = 64) -> None:
        if schema.has_handles:
            raise SchemaError("remote writers can fill inline fields only; this schema has handles")
        if not 1 <= batch <= MAX_BATCH:
            raise InvalidArgument(f"batch must be in 1..{MAX_BATCH}, got {batch}")
        self.engine = engine
        self.schema = schema
        self.batch = batch
        self._staging = mmap.mmap(-1, batch * schema.row_size)
        self._atomics = AtomicView(self._staging)
        self._rows = Rows(self._staging, RowBlock(0, schema.row_size, batch), schema, self._atomics)
        self._base = address_of(self._staging)
        try:
            engine.register(self._base, len(self._staging))
        except BaseException:
            self._release()
            raise

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
        if grant.fingerprint != self.schema.fingerprint or grant.length != self.schema.row_size:
            raise GrantError(
                f"grant for slot {grant.slot} is for another row layout "
                f"(fingerprint {grant.fingerprint:#x}, {grant.length} bytes)"
            )
        missing = self.schema.slots.keys() - values.keys()
        if missing:
            raise SchemaError(f"row for tag {grant.tag} lacks fields {sorted(missing)}")

    def _send(
        self, session: str, planned: list[tuple[Grant, list[tuple[str, Any]]]], commit: bool
    ) -> None:
        rows, size = self._rows, self.schema.row_size
        for cell, (grant, plan) in enumerate(planned):
            rows.write(cell, plan)
            rows.seal(cell, grant.generation)
        self.engine.write(
            session,
            [self._base + cell * size for cell in range(len(planned))],
            [grant.address for grant, _ in planned],
            [size] * len(planned),
            (COMMIT, ";".join(grant.commit_key for grant, _ in planned)) if commit else None,
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
