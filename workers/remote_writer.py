"""The remote (prefill-side) writer: fills granted rows from another host.

Run as `python -m shmslots.workers.remote_writer --connect HOST:PORT --host MY_IP`
with the link token in SHMSLOTS_LINK_TOKEN; the owner's `remote_flow`
starts it (inside a network namespace when asked).  It learns the row
schema, the owner's engine and how to reach it from the link, then writes every grant it
receives — the row's values
derived from its tag — and commits it.  `--never-commit-every N` plays a
writer that dies between writing a row and committing it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from shmslots.remote import Grant, GrantLink, LinkError, RemoteWriter, connect, open_engine
from shmslots.remote.writer import GrantedRow
from shmslots.schema import RowSchema

from . import eagle

TOKEN_ENV = "SHMSLOTS_LINK_TOKEN"
IDLE_LIMIT_S = 120.0  # an owner silent this long is gone


def serve(link: GrantLink, host: str, batch: int, never_commit_every: int) -> None:
    """Write every grant the owner sends until it says stop; then report what was done."""
    hello = link.recv(IDLE_LIMIT_S)
    schema = RowSchema.decode(hello["schema"])
    shape = eagle.RowShape.of(schema)
    written, uncommitted = 0, []
    with RemoteWriter(open_engine(hello["engine"], host), schema, batch=batch) as writer:
        writer.connect(hello["contact"])
        link.send({"ready": True})
        while "stop" not in (message := link.recv(IDLE_LIMIT_S)):
            commit: list[GrantedRow] = []
            hold: list[GrantedRow] = []
            for blob in message["grants"]:
                grant = Grant.decode(blob)
                written += 1
                dies = never_commit_every and written % never_commit_every == 0
                row = (grant, eagle.row_values(grant.tag, shape, time.monotonic_ns()))
                (hold if dies else commit).append(row)
            writer.write(commit)
            writer.write(hold, commit=False)
            uncommitted += [grant.tag for grant, _ in hold]
    link.send({"written": written, "uncommitted": uncommitted})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmslots.workers.remote_writer")
    parser.add_argument("--connect", required=True, help="the owner's grant link, HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="this host's address for the engine")
    parser.add_argument("--batch", type=int, default=16, help="rows per engine call")
    parser.add_argument("--never-commit-every", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)

    link = connect(args.connect, os.environ[TOKEN_ENV])
    try:
        serve(link, args.host, args.batch, args.never_commit_every)
    except LinkError as exc:
        print(f"remote writer: {exc}; stopping", file=sys.stderr)
        return 1
    finally:
        link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
