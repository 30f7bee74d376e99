"""The three decode consumption policies on the same traffic, side by side.

    python tools/compare_policies.py [--requests 20000] [--slots 64] [--hidden 4096]
    python tools/compare_policies.py --flow sglang [--requests 5000] [--slots 32]

hold: the request owns its slot until process_prebuilt; clone: copy at
commit, release at once; early-release: keep views, release at commit (the
bug). Prints throughput, p99 commit->consume latency, peak slots owned,
copies per row and corrupted rows.  `--flow sglang` runs SGLang's own calls
on `shmslots.sglang` (workers/sglang_flow.py): a prefill process writing by
address, the decode side's alloc / get_buf / free / process_prebuilt.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.table import Table
from shmslots.workers import eagle, sglang_flow
from shmslots.workers.decode import POLICIES
from shmslots.workers.launcher import FlowConfig, run_flow


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flow", choices=("workers", "sglang"), default="workers")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--slots", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=eagle.DEFAULT_HIDDEN)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.flow == "sglang":
        return sglang_policies(args.requests or 5_000, args.slots or 32, args.hidden, args.seed)
    args.requests = args.requests or 20_000
    args.slots = args.slots or 64
    table = _policy_table("decode consumption policies, same traffic")
    for policy in POLICIES:
        result = run_flow(
            FlowConfig(
                requests=args.requests,
                slots=args.slots,
                policy=policy,
                burst=args.burst,
                shape=eagle.RowShape(hidden=args.hidden),
                seed=args.seed,
            )
        )
        p = result.progress
        consumed = p.verified + p.corrupted
        table.add_row(
            policy,
            f"{p.rate:,.0f}",
            f"{p.latency_us(0.99) / 1e3:.2f}",
            str(p.peak_owned),
            f"{p.copies / max(consumed + p.decode_aborted, 1):.2f}",
            f"{p.corrupted:,}",
            f"{result.final.counters['leaked_views']:,}",
        )
    Console(width=max(Console().width, 120)).print(table)
    print(
        f"{args.requests:,} requests, 2 transfer + 2 decode workers, {args.slots} slots, "
        f"hidden bf16[{args.hidden}], bursts of {args.burst}"
    )
    return 0


def _policy_table(title: str, *extra: str) -> Table:
    """The columns both flows report, `extra` before the leaked views."""
    columns = ("rows/s", "p99 commit→consume ms", "peak slots owned", "copies/row")
    return Table("policy", *columns, "corrupted rows", *extra, "leaked views", title=title)


def sglang_policies(requests: int, slots: int, hidden: int, seed: int) -> int:
    table = _policy_table("SGLang's calls on shmslots.sglang, same traffic", "deferred frees")
    for policy in sglang_flow.POLICIES:
        cfg = sglang_flow.FlowConfig(
            requests=requests, slots=slots, hidden=hidden, policy=policy, seed=seed
        )
        r = sglang_flow.run(cfg, f"shmslots-policies-{os.getpid()}-{policy}")
        table.add_row(
            policy,
            f"{r.rate:,.0f}",
            f"{r.latency_us(0.99) / 1e3:.2f}",
            str(r.peak_owned),
            f"{r.copies / max(r.consumed, 1):.1f}",
            f"{r.corrupted:,}",
            f"{r.deferred_frees:,}",
            f"{r.leaked_views:,}",
        )
    Console(width=max(Console().width, 120)).print(table)
    print(
        f"{requests:,} requests, 1 prefill process writing by address + the decode side, "
        f"{slots} slots, hidden bf16[{hidden}], {sglang_flow.FlowConfig.abort_in_flight:.0%} "
        "aborted in flight (their writes land late)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
