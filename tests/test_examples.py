"""The examples under examples/ run as written, and README and docs/ show them as they are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shmslots.remote import ENGINES, RemoteUnavailable, mooncake, nixl

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# A docs code block that is an example starts with the line that runs it.
_BLOCK = re.compile(r"```python\n(# python (examples/\w+\.py) \[TABLE\]\n.*?)```", re.DOTALL)


def run_example(path: Path, table: str) -> str:
    r = subprocess.run(
        [sys.executable, str(path), table], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == "", r.stderr  # no warning, no resource_tracker complaint
    return r.stdout


def test_producer_and_consumer_in_two_processes(name: str) -> None:
    out = run_example(ROOT / "examples/producer_consumer.py", name).splitlines()
    assert out == [f"request {i}: token {100 + i}, hidden[0] {i / 8}" for i in range(1, 9)]


def test_reservation(name: str) -> None:
    out = run_example(ROOT / "examples/reservation.py", name)
    assert "tag 42: output_id 7" in out
    assert "stale reservation refused: slot 0 generation 0 is not reserved" in out


def test_ref_fields(name: str) -> None:
    out = run_example(ROOT / "examples/ref_fields.py", name)
    assert out == "id 1: hidden (100, 4096), sum 409600\n"


def test_strict_leak_check(name: str) -> None:
    out = run_example(ROOT / "examples/strict_leak.py", name).splitlines()
    assert out[0].startswith("refused: release of slot 0 while views of topk_p")
    assert out[1] == "with block: leaked_views = 1"


@pytest.mark.timeout(120)
def test_service(name: str) -> None:
    out = run_example(ROOT / "examples/service.py", name).splitlines()
    assert out == [
        "producer run 0: rows reached the consumer, then SIGKILL",
        "producer run 1: rows reached the consumer, then SIGTERM",
    ]


def test_sglang_decode(name: str) -> None:
    out = run_example(ROOT / "examples/sglang_decode.py", name).splitlines()
    assert out == [
        "after free: 3 of 4 free, row still held",
        "token 1234 draft ([0.5, 0.25], [17, 42], 0.25); after release: 4 of 4 free",
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_remote(name: str, engine: str) -> None:
    missing = {"mooncake": mooncake.load, "nixl": nixl.load}[engine]
    try:
        missing()
    except RemoteUnavailable as exc:
        pytest.skip(str(exc))
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples/remote.py"), name, engine],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "tag 42: output_id 7, verified True",
        "published [42], slots owned 0",
    ]


def test_every_example_is_tested_and_shown_in_the_readme_as_it_is() -> None:
    tested = set(re.findall(r'ROOT / "(examples/\w+\.py)"', Path(__file__).read_text()))
    assert tested == {f"examples/{p.name}" for p in EXAMPLES}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    shown = {path: text for page in pages for text, path in _BLOCK.findall(page.read_text())}
    assert set(shown) == {f"examples/{p.name}" for p in EXAMPLES}
    for path, text in shown.items():
        assert text == (ROOT / path).read_text(), f"the docs' {path} differs from the file"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_say_how_to_run_them(path: Path) -> None:
    assert path.read_text().startswith(f"# python examples/{path.name} [TABLE]\n")
