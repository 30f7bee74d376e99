"""Chaos driver: SIGKILL random producers and consumers for a while, then audit.

Runs the same scenario as tests/test_recovery.py::test_chaos_sigkill_random_participants
(tests/chaos.py, a test scenario, not part of the package) with your numbers and prints the summary.

    python tools/chaos_soak.py --rows 50000 --kills 100
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from chaos import run_chaos


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="rows to handle at least")
    parser.add_argument("--kills", type=int, default=30, help="SIGKILLs to send at least")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logdir:
        report = run_chaos(
            f"shmslots-chaos-{os.getpid()}",
            Path(logdir),
            args.rows,
            args.kills,
            args.seed,
            args.max_seconds,
        )
    table = Table("measure", "value", title="chaos summary", title_justify="left")
    table.add_row("rows handled (distinct tags)", f"{report.rows_handled:,}")
    table.add_row("rows published (logged)", f"{report.published:,}")
    table.add_row("SIGKILLs", str(report.kills))
    table.add_row(
        "aborts: producers / consumers", f"{report.producer_aborts} / {report.consumer_aborts}"
    )
    for reason, count in report.reclaims.items():
        table.add_row(f"reclaim: {reason}", str(count))
    table.add_row("rows redelivered after a consumer died", str(report.redelivered_rows))
    table.add_row("lost", str(len(report.lost)))
    table.add_row("delivered twice", str(len(report.double_delivered)))
    table.add_row("corrupted", str(len(report.corrupted)))
    table.add_row("slots owned at end", str(report.owned_at_end))
    table.add_row("bitmap/state disagreements", str(len(report.inconsistencies)))
    table.add_row("seconds", f"{report.seconds:.1f}")
    Console().print(table)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
