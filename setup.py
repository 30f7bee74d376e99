"""The compiled modules; all other metadata is in pyproject.toml.

`shmslots._core` is C and needs only Python.  `shmslots._tensors` is C++ against the torch
installed beside it (torch's C++ API has no stable ABI), so torch must be importable while
this builds: install torch first, then shmslots with `pip install --no-build-isolation`.
"""

import os

from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter"]
HIDDEN = "-fvisibility=hidden"  # one exported symbol per module, its PyInit
CORE_FILES = ["module", "atomic", "hotpath", "rowcodec", "refcodec", "leases"]


def tensors_extension() -> Extension:
    try:
        import torch
    except ImportError as e:
        raise SystemExit(
            "shmslots compiles against the installed torch: install torch first "
            "(pip install torch==2.13.0), then shmslots with pip install --no-build-isolation"
        ) from e
    root = os.path.dirname(torch.__file__)
    include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return Extension(
        "shmslots._tensors",
        sources=["shmslots/csrc/tensors.cpp"],
        depends=["shmslots/csrc/tensors.h"],
        language="c++",
        # -isystem: torch's own headers are not held to this project's warnings; -g0: their
        # debug information doubled the compile (32 -> 17 s on a 2-core machine)
        extra_compile_args=["-O2", "-g0", "-std=c++17", *WARNINGS, HIDDEN, "-isystem", include],
        define_macros=[
            ("_GLIBCXX_USE_CXX11_ABI", str(abi)),
            ("SHMSLOTS_TORCH_VERSION", f'"{torch.__version__}"'),
        ],
        library_dirs=[lib],
        runtime_library_dirs=[lib],
        libraries=["c10", "torch_cpu", "torch_python"],
    )


setup(
    ext_modules=[
        Extension(
            "shmslots._core",
            sources=[f"shmslots/csrc/{name}.c" for name in CORE_FILES],
            depends=["shmslots/csrc/core.h", "shmslots/csrc/tensors.h"],
            extra_compile_args=["-O2", "-std=gnu11", *WARNINGS, HIDDEN],
        ),
        tensors_extension(),
    ]
)
