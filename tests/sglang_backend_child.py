"""Run by tests/test_sglang_backend.py in a fresh process: SGLang's own argument parser and
`get_kv_class`, after SGLang's `load_plugins()`, with or without SHMSLOTS_SGLANG=1, and
SGLang's launch-time check of the PD flags under its deferred decode allocation.  Prints
what they gave as JSON (or the parser's refusal)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import sglang_env as env


def main() -> None:
    env.install_torchvision_stand_in()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
    from sglang.srt.arg_groups.resolution_hooks import run_hook
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.managers import scheduler
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "m", "--disaggregation-mode", "decode"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args([*argv, "--disaggregation-transfer-backend", "shmslots"])
    except SystemExit:
        print(json.dumps({"refused": err.getvalue().strip().splitlines()[-1]}))
        return
    backend = scheduler.TransferBackend(args.disaggregation_transfer_backend)
    classes = {k.name: get_kv_class(backend, k).__name__ for k in KVClassType}
    mooncake = get_kv_class(TransferBackend("mooncake"), KVClassType.MANAGER).__name__
    deferred = [*argv, "--disaggregation-transfer-backend", "shmslots"]
    deferred += ["--disaggregation-decode-allocation-policy", "prefill_complete"]
    try:  # the step SGLang's launch runs on the flags, as it runs it (arg_groups/pipeline.py)
        run_hook(handle_pd_disaggregation, ServerArgs.from_cli_args(parser.parse_args(deferred)))
        prefill_complete = "accepted"
    except ValueError as exc:
        prefill_complete = str(exc)
    print(
        json.dumps(
            {
                "backend": backend.value,
                "classes": classes,
                "mooncake": mooncake,
                "prefill_complete": prefill_complete,
            }
        )
    )


if __name__ == "__main__":
    main()
