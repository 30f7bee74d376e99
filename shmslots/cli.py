"""The `shmslots` command line."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.table import Table


def _demo(args: argparse.Namespace) -> int:
    from workers.launcher import run_demo  # the library itself never imports workers

    console = Console()
    result = run_demo(
        f"shmslots-demo-{os.getpid()}",
        args.rows,
        args.producers,
        args.consumers,
        args.slots,
        console,
    )
    summary = Table("measure", "value", title="demo summary", title_justify="left")
    summary.add_row("rows published", f"{result.published:,}")
    summary.add_row("rows consumed and verified", f"{result.handled:,}")
    summary.add_row("aborted before publish", f"{result.aborted:,}")
    summary.add_row("corrupted", str(result.corrupted))
    summary.add_row("slots still owned", str(result.final.owned))
    summary.add_row("seconds", f"{result.seconds:.1f}")
    summary.add_row("rows/s", f"{result.handled / result.seconds:,.0f}")
    console.print(summary)
    ok = result.corrupted == 0 and result.final.owned == 0 and result.handled == result.published
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmslots", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="move rows from producer to consumer processes, live")
    demo.add_argument("--rows", type=int, default=100_000)
    demo.add_argument("--producers", type=int, default=1)
    demo.add_argument("--consumers", type=int, default=1)
    demo.add_argument("--slots", type=int, default=64)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
