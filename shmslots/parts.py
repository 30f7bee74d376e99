"""What a table's handles use of it, in one small object.

A SlotTable makes one TableParts when it joins and gives it to its HandleCore, which gives it
to every handle it makes (the handle's `_parts`).  leases.py reads only this, so it imports
nothing from table.py, and a handle reaches its rows, its participant's steps and its call
sites, not the table's other state.  (A handle also holds the table itself, unseen, so that
a table whose caller dropped it lives on while a handle of it does.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._core import HandleCore
    from .ownership import Ownership
    from .refs import RefStore
    from .rows import Rows
    from .tracing import SiteWriter


class TableParts:
    """One table's rows, steps, ref-field store and call-site record, for its handles."""

    __slots__ = ("_idle", "core", "name", "own", "refs", "rows", "sites", "strict")

    def __init__(
        self,
        name: str,
        strict: bool,
        rows: Rows,
        own: Ownership,
        refs: RefStore,
        sites: SiteWriter | None,
        core: HandleCore,
        idle: Callable[[], None],
    ) -> None:
        self.name = name
        self.strict = strict
        self.rows = rows
        self.own = own
        self.refs = refs
        self.sites = sites
        self.core = core
        # weak: the table holds its parts, and a table nobody holds must still be collected
        self._idle = weakref.WeakMethod(idle)

    @property
    def closed(self) -> bool:
        """Set when the table closes (or is inherited by a fork): its handles go stale."""
        return self.core.closed

    def idle(self) -> None:
        """A take found nothing: the table looks after what other processes left undone
        (called by the compiled take, at most every STRANDED_CHECK_S)."""
        idle = self._idle()
        if idle is not None:
            idle()

    def row_intact(self, slot: int, generation: int) -> bool:
        """Whether the row is the one sealed at `generation`, byte for byte."""
        sealed_gen, sealed_crc = self.rows.sealed(slot)
        return sealed_gen == generation and sealed_crc == self.rows.checksum(slot)
