# python examples/remote.py [TABLE]
"""A remote writer: the owner grants a row, another process writes it in place through a
transfer engine ("nixl" here; "mooncake" as a second argument), the owner publishes it."""

import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection

import torch

from shmslots import Field, SlotTable
from shmslots.remote import Grant, RemoteServer, RemoteWriter, open_engine
from shmslots.schema import RowSchema

FIELDS = [Field("output_id", "int64"), Field("hidden", "bfloat16", (8,))]


def writer(kind: str, link: Connection) -> None:
    """Prefill: it learns the owner's contact and a grant by any channel (a pipe here)."""
    with RemoteWriter(open_engine(kind), RowSchema(FIELDS)) as remote:
        remote.connect(link.recv())
        grant = Grant.decode(link.recv())
        hidden = torch.full((8,), 0.5, dtype=torch.bfloat16)
        remote.write([(grant, {"output_id": 7, "hidden": hidden})])  # checked, written, committed
        link.send("written")


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "remote-example"
    kind = sys.argv[2] if len(sys.argv) > 2 else "nixl"
    ours, theirs = mp.Pipe()
    with (
        SlotTable.create(name, FIELDS, slots=4) as table,
        open_engine(kind) as engine,
        RemoteServer(table, engine) as server,
    ):
        prefill = mp.get_context("spawn").Process(target=writer, args=(kind, theirs))
        prefill.start()
        ours.send(server.contact())
        ours.send(server.grant(tag=42).encode())  # slot reserved for request 42
        assert ours.poll(30) and ours.recv() == "written", "the writer failed"
        deadline = time.monotonic() + 30
        while not (settled := server.poll()).published:  # checked in place, then published
            assert time.monotonic() < deadline, server.stats
            time.sleep(0.01)
        lease = table.take()
        assert lease is not None
        with lease:  # the bytes the engine wrote, where it wrote them
            output_id = lease.item("output_id")
            print(f"tag {lease.tag}: output_id {output_id}, verified {lease.verify()}")
        prefill.join(30)
        print(f"published {settled.published}, slots owned {table.stats().owned}")
    return prefill.exitcode or 0


if __name__ == "__main__":
    sys.exit(main())
