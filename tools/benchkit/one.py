"""Some sessions of tools/bench.py on their own, to look at one transport closely.

    python tools/bench.py one "shmslots copying" small [more transport/kind pairs...]

Each pair runs the full bench's plan for its record kind (3 repeats) and prints the
median round trip and one-way rate; for quick A/B checks of a change, not for the README.
"""

from __future__ import annotations

import torch

from . import command_parser
from .common import KINDS, pin_plan, spread
from .run import FULL
from .session import BY_NAME, run_session

BY_KIND = {kind.name: kind for kind in KINDS}


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("one", __doc__)
    parser.add_argument("pairs", nargs="+", help="transport, then record kind, repeated")
    args = parser.parse_args(argv)
    if len(args.pairs) % 2:
        parser.error("give a record kind after every transport")
    pairs = list(zip(args.pairs[::2], args.pairs[1::2], strict=True))
    for transport, kind in pairs:
        if transport not in BY_NAME or kind not in BY_KIND:
            parser.error(f"no session {transport!r}/{kind!r}: transports {list(BY_NAME)}, "
                         f"kinds {list(BY_KIND)}")  # fmt: skip
    torch.set_num_threads(1)
    pins = pin_plan()
    for transport, kind in pairs:
        s = run_session(BY_NAME[transport], BY_KIND[kind], FULL.plans[kind], pins)
        rtt = spread([sorted(r)[len(r) // 2] / 1e3 for r in s.rtt_ns])
        rate = spread(s.rows_s)
        print(f"{transport} / {kind}: round trip {rtt.median:.2f} us ({rtt.low:.2f}-"
              f"{rtt.high:.2f}), {rate.median:,.0f} rows/s")  # fmt: skip
    return 0
