"""What the docs show that is not an example file is held to the code that it shows.

tests/test_examples.py runs the examples and checks that the docs show them as they are.
Here: the README's two commands against what CI runs, the bit diagrams of docs/protocol.md
against real slot words and ring cells, the CLI reference against the CLI, the figures'
commands against the tools that print them, and the inspect capture against the format
it was made with (a capture of an older format must be made again).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

from conftest import SMALL, small_row

from shmslots import SlotTable, layout
from shmslots.remote import RemoteServer, RemoteWriter
from shmslots.states import State, pack

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(page: str, lang: str = "") -> list[str]:
    return [text for kind, text in _BLOCK.findall((ROOT / page).read_text()) if kind == lang]


def _block_starting(page: str, start: str) -> str:
    [found] = [b for b in _blocks(page) if b.startswith(start)]
    return found


def _bits(diagram: str) -> dict[str, tuple[int, int]]:
    """`bits 63..32  generation` / `bit  20  full` lines as {name: (high, low)}."""
    found = {}
    for high, low, name in re.findall(r"^bits? +(\d+)(?:\.\.(\d+))? +(\w+)", diagram, re.M):
        found[name] = (int(high), int(low or high))
    return found


def _steps(commands: str) -> list[list[str]]:
    """Each `&&`-joined step of each command line, as words: no --quiet, no PATH set in
    front (other settings kept: they change what the step does), programs of the virtualenv
    by their name."""
    steps = []
    for line in commands.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#"):
            continue
        for step in line.split(" && "):
            words = [w for w in shlex.split(step) if w != "--quiet"]
            settings = [w for w in words if re.match(r"^[A-Z_]+=", w)]
            words = words[len(settings) :]
            if words:
                program = words[0].removeprefix(".venv/bin/")
                kept = [w for w in settings if not w.startswith("PATH=")]
                steps.append([*kept, program, *words[1:]])
    return steps


def test_the_readme_test_command_is_what_ci_runs() -> None:
    commands = _blocks("README.md", "bash")[0]
    demo, tests = [line for line in commands.splitlines() if line and not line.startswith("#")]
    assert _steps(demo)[-1] == ["shmslots", "demo"]
    ci = _steps((ROOT / ".ci/run").read_text())
    for step in _steps(tests):
        assert step in ci, f"CI does not run the README's {' '.join(step)!r}"


def test_the_slot_word_diagram_is_the_word(name: str) -> None:
    bits = _bits(_block_starting("docs/protocol.md", "bits 63..32"))
    assert bits == {"generation": (63, 32), "owner": (31, 16), "state": (15, 0)}

    def placed(value: int, field: str) -> int:
        high, low = bits[field]
        assert value < 1 << (high - low + 1)
        return value << low

    with SlotTable.create(name, SMALL, slots=1) as t:
        t.claim(tag=1).abort()  # generation 1
        ws = t.claim(tag=2)
        word = t._own.word(ws.slot)
        owner = t.participant + 1
        assert word == placed(1, "generation") | placed(owner, "owner") | placed(2, "state")
        assert word == pack(1, owner, State.WRITING)
        ws.abort()


def test_the_ring_cell_diagram_is_the_cell(name: str) -> None:
    bits = _bits(_block_starting("docs/protocol.md", "bits 63..21"))
    assert bits == {"position": (63, 21), "full": (20, 20), "slot": (19, 0)}
    with SlotTable.create(name, SMALL, slots=4) as t:
        for tag in (10, 11, 12):  # positions 0, 1, 2
            t.claim(tag=tag).write(**small_row(tag)).publish()
        lay = t.layout
        cells = struct.unpack_from(f"<{3}Q", t._segment.mm, lay.ring)
        slot_of = {t.slot_info(s)[3]: s for s in range(4)}  # tag -> slot
        for pos, cell in enumerate(cells):
            slot = slot_of[10 + pos]
            assert cell == pos << bits["position"][1] | 1 << bits["full"][1] | slot
        assert 1 << (bits["slot"][0] + 1) == layout.MAX_SLOTS  # what a cell can name
        t.abort_all(t.poll(3))


def test_the_cli_reference_lists_every_command_and_option() -> None:
    reference = _block_starting("docs/operations.md", "shmslots ls")
    listed = dict(re.findall(r"^shmslots (\w+)(.*)$", reference, re.M))
    shown = subprocess.run(
        [sys.executable, "-m", "shmslots", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    commands = set(re.findall(r"^    (\w+) ", shown, re.M))
    assert set(listed) | {"demo"} == commands  # the demo is the README's first command
    for command, usage in listed.items():
        helped = subprocess.run(
            [sys.executable, "-m", "shmslots", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        options = set(re.findall(r"^ +(--[\w-]+)", helped, re.M)) - {"--help"}
        assert set(re.findall(r"--[\w-]+", usage)) == options, command


def test_every_captured_command_exists() -> None:
    """A capture starts with `$ COMMAND`: the program it runs is in this checkout."""
    bench = (ROOT / "tools/bench.py").read_text()
    found = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        for text in _blocks(f"docs/{page.name}"):
            if not text.startswith("$ "):
                continue
            words = shlex.split(text.splitlines()[0][2:])
            assert words[0] == "python", words
            found += 1
            if words[1] == "-m":
                assert importlib.util.find_spec(words[2]) is not None, words
                continue
            assert (ROOT / words[1]).is_file(), words
            if words[1] == "tools/bench.py" and not words[2].startswith("-"):
                assert f'"{words[2]}"' in bench, f"tools/bench.py has no command {words[2]}"
    assert found >= 4


def test_the_step_timings_are_what_bench_steps_prints() -> None:
    block = _block_starting("docs/performance.md", "busy small-row round trip")
    code = (ROOT / "tools/benchkit/steps.py").read_text()
    for line in block.splitlines():
        label = re.split(r" {2,}", line.strip())[0]
        if not label or re.fullmatch(r"[\d.]+ ?us|total", label):
            continue
        batch = re.fullmatch(r"a batch of \d+ \w+ rows, (.+)", label)  # an f-string there
        label = batch.group(1) if batch else label
        # a number may be an f-string's field there: claim_n(64) is f"claim_n({BATCH})"
        pattern = re.sub(r"\d+", r"(?:\\d+|\\{[^}]+\\})", re.escape(label))
        assert re.search(pattern, code), f"steps.py prints no {label!r}"


def test_the_inspect_capture_is_of_this_format() -> None:
    capture = _block_starting("docs/operations.md", "table ")
    [version] = re.findall(r"^format +version (\d+)$", capture, re.M)
    assert int(version) == layout.VERSION, "capture inspect again: bash tools/inspect_demo.sh"


def test_the_remote_diagram_names_real_calls() -> None:
    [diagram] = [b for b in _blocks("docs/remote.md") if b.lstrip().startswith("owner")]
    for obj, cls in (("server", RemoteServer), ("writer", RemoteWriter)):
        calls = set(re.findall(rf"\b{obj}\.(\w+)\(", diagram))
        assert calls and all(hasattr(cls, c) for c in calls), (obj, calls)
