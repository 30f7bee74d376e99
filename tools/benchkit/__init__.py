"""The benchmarks of tools/bench.py, one module each (that file says which command runs which)."""

from __future__ import annotations

import argparse


def command_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of `tools/bench.py NAME`, described by the first paragraph of `doc`."""
    return argparse.ArgumentParser(
        prog=f"tools/bench.py {name}", description=(doc or "").split("\n\n")[0]
    )
