"""SGLang 0.5.23's STANDALONE speculative decoding (topk 1, the tiny model as its own draft) on
this CPU, served as users run it, alone and as a prefill/decode pair on the shmslots
backend (#38).

What it takes (`sglang_cpu/spec_kernels.py`, `sglang_cpu/spec_standins.py`) is checked
first: the eight `sgl_kernel` CPU ops' ports against SGLang's own Triton kernels in Triton's
interpreter.  Then the servers: speculation is exact at temperature 0, so the speculative
servers must give the plain server's tokens; and the pair's decode must start each request
from the draft state its prefill sent, so each request takes as many verify passes as on a
single speculative server (requests go one at a time, so every batch is the same).  The
accept lengths of the three decode policies under load are `tools/sglang_spec.py`'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sglang_env import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang_cpu import draft_reference
from sglang_cpu.harness import DECODE_FLAGS, PD_FLAGS, Deployment, free_port, generate
from sglang_cpu.model import make_model

pytestmark = pytest.mark.timeout(600)
HERE = Path(__file__).resolve().parent
PROMPTS = ["hello", "def scheduler", "hello world 1", "class Req:", "import torch", "x = 1"]
NEW_TOKENS = 8


def spec_flags(model: Path) -> list[str]:
    return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(model),
            "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "3", "--disable-radix-cache", *PD_FLAGS]  # fmt: skip


def test_the_ported_kernels_match_sglangs_triton_kernels() -> None:
    script = HERE / "sglang_cpu" / "check_spec_kernels.py"
    path = os.pathsep.join([str(HERE / "sglang_cpu" / "site"), str(HERE)])
    env = {**os.environ, "TRITON_INTERPRET": "1", "SGLANG_USE_CPU_ENGINE": "1",
           "SHMSLOTS_SGLANG_CPU": "1", "PYTHONPATH": path}  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count(": same") == 34 and "DIFFERENT" not in out.stdout


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("sglang-model"))


def _replies(url: str) -> list[dict[str, Any]]:
    return [generate(url, p, NEW_TOKENS) for p in PROMPTS]  # one at a time
    # (`meta_info` has no `spec_verify_ct` for a request that ended before any verify pass)


@pytest.fixture(scope="module")
def alone(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The replies of a plain server and of a speculative one, each started alone (an idle
    server beside another slows its start on two cores) and stopped once it has answered."""
    replies = {}
    plain = ["--disable-radix-cache", *PD_FLAGS]  # the speculative servers' arithmetic
    for name, flags in (("plain", plain), ("spec", spec_flags(model))):
        with Deployment(model, tmp_path_factory.mktemp(f"{name}-logs")) as deployment:
            replies[name] = _replies(deployment.server(name, *flags).url)
    return replies


def test_a_speculative_server_gives_the_plain_servers_tokens(
    alone: dict[str, list[dict[str, Any]]],
) -> None:
    spec = alone["spec"]
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in alone["plain"]]
    verifies = sum(r["meta_info"].get("spec_verify_ct", 0) for r in spec)
    tokens = sum(len(r["output_ids"]) for r in spec)
    assert tokens > verifies + len(PROMPTS), "no draft was ever accepted"


def test_the_speculative_server_drafts_as_a_reference_without_the_stand_ins(
    model: Path, alone: dict[str, list[dict[str, Any]]]
) -> None:
    """The stand-ins' draft and verify passes against STANDALONE written plainly in
    transformers (`sglang_cpu/draft_reference.py`): the same tokens in the same passes."""
    want = draft_reference.verify_passes(model, PROMPTS, steps=2, max_new_tokens=NEW_TOKENS)
    seen = [(r["output_ids"], r["meta_info"].get("spec_verify_ct", 0)) for r in alone["spec"]]
    assert seen == want


def test_a_pair_on_the_shmslots_backend_hands_the_draft_state_to_decode(
    model: Path, alone: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    bootstrap = free_port()
    flags = ["--disaggregation-transfer-backend", "shmslots",
             "--disaggregation-bootstrap-port", str(bootstrap), *spec_flags(model)]  # fmt: skip
    plugin = {"SHMSLOTS_SGLANG": "1"}
    with Deployment(model, tmp_path) as deployment:
        prefill = deployment.server(
            "prefill", "--disaggregation-mode", "prefill", *flags, env=plugin
        )
        decode = deployment.server(
            "decode", "--disaggregation-mode", "decode", *flags, *DECODE_FLAGS, env=plugin
        )
        router = deployment.router(prefill, bootstrap, decode)
        pair = _replies(router.url)
    seen = [(r["output_ids"], r["meta_info"].get("spec_verify_ct", 0)) for r in pair]
    want = [(r["output_ids"], r["meta_info"].get("spec_verify_ct", 0)) for r in alone["spec"]]
    assert seen == want
    left = deployment.tables_left()
    assert not left, left
