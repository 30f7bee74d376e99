"""On PYTHONPATH for SGLang servers started by the harness: every process they spawn (the
scheduler, the detokenizer) gets the stand-ins before it imports SGLang."""

import faulthandler
import importlib
import os
import signal
import sys

if os.environ.get("SHMSLOTS_SGLANG_CPU") == "1":
    # the harness asks a server stuck in a failed test for its threads' stacks (to its log)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    standins = importlib.import_module("sglang_cpu.standins")
    standins.install()
    standins.install_cpu_workarounds()
    standins.install_spec()
    if os.environ.get("SHMSLOTS_SGLANG_CPU_POLICY") == "early-release":
        early_release = importlib.import_module("sglang_cpu.early_release")
        standins.after_import({early_release.UTILS: early_release.patch})
