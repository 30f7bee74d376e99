"""The remote side: pack rows exactly as the owner's table lays them out, write, commit."""

from __future__ import annotations

import mmap
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .._atomic import AtomicView
from ..errors import SchemaError
from ..rows import RowBlock, Rows
from ..schema import RowSchema
from .engine import Engine, address_of
from .grant import Grant, GrantError

GrantedRow = tuple[Grant, Mapping[str, Any]]


class RemoteWriter:
    """Writes granted rows through the engine, `batch` rows per transfer.

    Rows are packed by the table's own row code into registered staging
    cells (fields, generation and checksum in the header), so the owner can
    check a copied row exactly as it checks its own.
    """

    def __init__(self, engine: Engine, schema: RowSchema, *, batch: int = 64) -> None:
        if schema.has_handles:
            raise SchemaError("remote writers can fill inline fields only; this schema has handles")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.engine = engine
        self.schema = schema
        self.batch = batch
        self._staging = mmap.mmap(-1, batch * schema.row_size)
        self._atomics = AtomicView(self._staging)
        self._rows = Rows(self._staging, RowBlock(0, schema.row_size, batch), schema, self._atomics)
        self._base = address_of(self._staging)
        engine.register(self._base, len(self._staging))

    def write(self, rows: Sequence[GrantedRow], *, commit: bool = True) -> None:
        """Write each granted row; with `commit`, the owner publishes them once they verify.

        Every row is checked before anything is sent.  Rows for one owner go
        in one engine call per `batch`, its commit message riding behind them.
        """
        by_session: dict[str, list[GrantedRow]] = defaultdict(list)
        for grant, values in rows:
            self._check(grant, values)
            by_session[grant.session].append((grant, values))
        for session, granted in by_session.items():
            for start in range(0, len(granted), self.batch):
                self._send(session, granted[start : start + self.batch], commit)

    def _check(self, grant: Grant, values: Mapping[str, Any]) -> None:
        if grant.fingerprint != self.schema.fingerprint or grant.length != self.schema.row_size:
            raise GrantError(
                f"grant for slot {grant.slot} is for another row layout "
                f"(fingerprint {grant.fingerprint:#x}, {grant.length} bytes)"
            )
        missing = self.schema.slots.keys() - values.keys()
        if missing:
            raise SchemaError(f"row for tag {grant.tag} lacks fields {sorted(missing)}")

    def _send(self, session: str, granted: list[GrantedRow], commit: bool) -> None:
        rows = self._rows
        plans = [rows.prepare(dict(values)) for _, values in granted]  # all checked first
        for cell, ((grant, _), plan) in enumerate(zip(granted, plans, strict=True)):
            rows.write(cell, plan)
            rows.seal(cell, grant.generation)
        size = self.schema.row_size
        self.engine.write(
            session,
            [self._base + cell * size for cell in range(len(granted))],
            [grant.address for grant, _ in granted],
            [size] * len(granted),
            ";".join(grant.commit_key for grant, _ in granted) if commit else None,
        )

    def close(self) -> None:
        self.engine.unregister(self._base)
        self._rows.close()
        self._atomics.release()
        self._staging.close()

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
