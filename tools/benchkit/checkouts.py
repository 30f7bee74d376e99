"""Run a probe in a fresh interpreter that imports another checkout of shmslots first.

The A/B benches (ab.py, remote.py --base) compare two checkouts in one run,
each measured in a process of its own so that neither's extensions or imports leak into
the other's figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent.parent  # benchkit's folder: measures both alike


def run_probe(root: Path, code: str, timeout_s: float) -> Any:
    """Run `code` with `root` (and this checkout's tools/) first on the path, in `root`; returns
    the JSON
    its last line of output printed.  An interrupt or a timeout lets the probe clean up
    (SIGTERM unwinds it, unlinking its tables) before it propagates."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = f"{root}:{TOOLS}"
    with subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=root,  # workers started as `-m workers....` come from this checkout too
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as probe:
        try:
            out, err = probe.communicate(timeout=timeout_s)
        except BaseException:
            probe.terminate()
            probe.communicate(timeout=30)
            raise
    if probe.returncode:
        raise SystemExit(f"probe in {root} failed:\n{err}")
    return json.loads(out.strip().splitlines()[-1])
