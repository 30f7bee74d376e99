"""On PYTHONPATH for SGLang servers started by the harness: every process they spawn (the
scheduler, the detokenizer) gets the stand-ins before it imports SGLang."""

import importlib
import os
import sys

if os.environ.get("SHMSLOTS_SGLANG_CPU") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    standins = importlib.import_module("standins")
    standins.install()
    standins.install_cpu_workarounds()
