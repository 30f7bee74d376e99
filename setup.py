"""The compiled modules, and the dependencies (torch pinned to the one they are built
against); all other metadata is in pyproject.toml.

`shmslots._tensors` is C++ against the torch installed beside it, and torch's C++ API has
no stable ABI: torch must be importable while this builds (install torch first, then
shmslots with `pip install --no-build-isolation`), the install asks for that same torch,
and `shmslots._core` (C) loads `_tensors` beside it only.
"""

import os

from setuptools import Extension, setup

try:
    import torch
except ImportError as e:
    raise SystemExit(
        "shmslots compiles against the installed torch: install torch first "
        "(pip install torch==2.13.0), then shmslots with pip install --no-build-isolation"
    ) from e

TORCH = os.path.dirname(torch.__file__)
BUILT_FOR = ("SHMSLOTS_TORCH_VERSION", f'"{torch.__version__}"')
# The test build: SHMSLOTS_KILL_POINTS=1 at install compiles in the points where a test may
# SIGKILL the process inside a compiled step (_core._kill_at).  Any other build lacks them.
KILL_POINTS = (
    [("SHMSLOTS_KILL_POINTS", None)] if os.environ.get("SHMSLOTS_KILL_POINTS") == "1" else []
)
WARNINGS = ["-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter"]
HIDDEN = "-fvisibility=hidden"  # one exported symbol per module, its PyInit
CORE_FILES = [
    "module",
    "atomic",
    "arena",
    "hotpath",
    "rowcodec",
    "rowhash",
    "refcodec",
    "leases",
    "blockcopy",
]

setup(
    install_requires=[
        f"torch=={torch.__version__.split('+')[0]}",  # any local build of it: +cpu, +cu128
        "numpy>=1.24",
        "posix_ipc>=1.1",
        "msgpack>=1.0",
        "rich>=13",
        "prometheus-client>=0.20",
    ],
    ext_modules=[
        Extension(
            "shmslots._core",
            sources=[f"shmslots/csrc/{name}.c" for name in CORE_FILES],
            depends=["shmslots/csrc/core.h", "shmslots/csrc/tensors.h"],
            define_macros=[BUILT_FOR, *KILL_POINTS],
            extra_compile_args=["-O2", "-std=gnu11", *WARNINGS, HIDDEN],
        ),
        Extension(
            "shmslots._tensors",
            sources=["shmslots/csrc/tensors.cpp"],
            depends=["shmslots/csrc/tensors.h"],
            language="c++",
            # -isystem: torch's headers are not held to this project's warnings; -g0: their
            # debug information doubled the compile (32 -> 17 s on a 2-core machine)
            extra_compile_args=[
                "-O2",
                "-g0",
                "-std=c++17",
                *WARNINGS,
                HIDDEN,
                "-isystem",
                os.path.join(TORCH, "include"),
            ],
            define_macros=[
                ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI))),
                BUILT_FOR,
            ],
            library_dirs=[os.path.join(TORCH, "lib")],
            # torch's libraries beside an installed package (site-packages); elsewhere the
            # ones `import torch` loaded, which _core does before it loads this module
            runtime_library_dirs=["$ORIGIN/../torch/lib"],
            libraries=["c10", "torch_cpu", "torch_python"],
        ),
    ],
)
