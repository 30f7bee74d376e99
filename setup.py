"""Only the compiled module lives here; all metadata is in pyproject.toml."""

from setuptools import Extension, setup

FLAGS = [
    "-O2",
    "-std=gnu11",
    "-Wall",
    "-Wextra",
    "-Wno-missing-field-initializers",
    "-Wno-unused-parameter",
    "-fvisibility=hidden",  # one exported symbol, PyInit__core: core.h's names stay inside
]
FILES = ["module", "atomic", "hotpath", "rowcodec", "leases"]

setup(
    ext_modules=[
        Extension(
            "shmslots._core",
            sources=[f"shmslots/csrc/{name}.c" for name in FILES],
            depends=["shmslots/csrc/core.h"],
            extra_compile_args=FLAGS,
        )
    ]
)
