"""The wheel installs `shmslots` and nothing else, and its demo and examples run from it.

The wheel used to install a top-level `workers` package beside `shmslots`, where another
project's `workers` clashed with it: from a folder with a `workers/` of its own, `shmslots
demo` failed with ImportError.  Here the wheel is built from a copy of the checkout, against
this environment's torch (--no-build-isolation, as the README installs), installed into a fresh
virtualenv outside it, and run from a folder that holds a `workers/` of its own.  Its
runtime dependencies (torch and the rest) come from this environment's site-packages, added
by a path file, not downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with only the wheel installed; returns its bin folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy: the build writes build/ and egg-info where it runs
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so", "bench-out"
    )
    shutil.copytree(ROOT, source, ignore=skip)
    production = {k: v for k, v in os.environ.items() if k != "SHMSLOTS_KILL_POINTS"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "dist"), str(source)],
        check=True, capture_output=True, timeout=300, env=production,
    )  # fmt: skip
    [wheel] = (tmp / "dist").glob("shmslots-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {"shmslots"}
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    pure = Path(sysconfig.get_paths(vars={"base": str(env_dir)})["purelib"])
    (pure / "deps-from-the-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(bin_dir / "pip"), "install", "-q", "--no-deps", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return bin_dir


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COLUMNS")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=200)


@pytest.mark.timeout(600)
def test_the_wheel_installs_only_shmslots_and_runs_the_demo_beside_another_workers(
    installed: Path, tmp_path: Path
) -> None:
    (tmp_path / "workers").mkdir()  # another project's package of that name
    (tmp_path / "workers" / "__init__.py").write_text("MINE = True\n")
    probe = _run([str(installed / "python"), "-c", "import workers; print(workers.MINE)"], tmp_path)
    assert probe.stdout.strip() == "True", probe.stderr  # theirs, not ours
    demo = _run(
        [str(installed / "shmslots"), "demo", "--requests", "400", "--slots", "8",
         "--hidden", "64", "--transfer", "1", "--decode", "1"],
        tmp_path,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "demo summary" in demo.stdout
    where = _run(
        [str(installed / "python"), "-c", "import shmslots; print(shmslots.__file__)"], tmp_path
    )
    assert str(installed.parent) in where.stdout  # the wheel's, not the checkout's


@pytest.mark.timeout(120)
def test_the_wheel_has_no_kill_switch(installed: Path, tmp_path: Path) -> None:
    """The points where tests SIGKILL a process inside a compiled step are the test build's
    only (#36, item 8): a wheel built without SHMSLOTS_KILL_POINTS has neither name."""
    probe = _run(
        [str(installed / "python"), "-c",
         "from shmslots import _core; print(sorted(n for n in dir(_core) if 'KILL' in n.upper()))"],
        tmp_path,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


@pytest.mark.timeout(300)
def test_an_example_runs_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    example = tmp_path / "producer_consumer.py"
    example.write_text((ROOT / "examples" / "producer_consumer.py").read_text())
    name = f"shmslots-test-{os.getpid()}-wheel"
    r = _run([str(installed / "python"), str(example), name], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0] == "request 1: token 101, hidden[0] 0.125"
