"""Only the compiled modules live here; all metadata is in pyproject.toml."""

from setuptools import Extension, setup

FLAGS = [
    "-O2",
    "-std=gnu11",
    "-Wall",
    "-Wextra",
    "-Wno-missing-field-initializers",
    "-Wno-unused-parameter",
]

setup(
    ext_modules=[
        Extension("shmslots._atomic", sources=["shmslots/_atomic.c"], extra_compile_args=FLAGS),
        Extension("shmslots._hotpath", sources=["shmslots/_hotpath.c"], extra_compile_args=FLAGS),
        Extension("shmslots._rowcodec", sources=["shmslots/_rowcodec.c"], extra_compile_args=FLAGS),
        Extension("shmslots._leases", sources=["shmslots/_leases.c"], extra_compile_args=FLAGS),
    ]
)
