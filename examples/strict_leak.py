# python examples/strict_leak.py [TABLE]
"""Strict mode: a release while a view of the row is still referenced raises."""

import sys

import torch

from shmslots import Field, LeakedViewError, SlotTable

FIELDS = [Field("id", "int64"), Field("topk_p", "float32", (16,))]


def publish(table: SlotTable, tag: int) -> None:
    table.claim(tag=tag).write(id=tag, topk_p=torch.rand(16)).publish()


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "strict-demo"
    with SlotTable.create(name, FIELDS, slots=2, strict=True) as table:
        publish(table, 1)
        lease = table.take()
        assert lease is not None
        kept = lease.view("topk_p")  # a zero-copy view of the row
        try:
            lease.release()
        except LeakedViewError as exc:  # the lease stays held: nothing was handed back
            print(f"refused: {exc}")
        kept = kept.clone()  # keep the data, not the view; copy() does this too
        lease.release()

        publish(table, 2)
        lease = table.take()
        assert lease is not None
        try:
            with lease:  # a with block hands the slot back even so, and counts the leak
                kept = lease.view("topk_p")
        except LeakedViewError:
            print(f"with block: leaked_views = {table.stats().counters['leaked_views']}")
        del kept  # it still points at the row: drop it before the table closes
    return 0


if __name__ == "__main__":
    sys.exit(main())
