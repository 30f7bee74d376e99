"""Only the compiled atomics live here; all metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmslots._atomic",
            sources=["shmslots/_atomic.c"],
            extra_compile_args=[
                "-O2",
                "-std=gnu11",
                "-Wall",
                "-Wextra",
                "-Wno-missing-field-initializers",
                "-Wno-unused-parameter",
            ],
        )
    ]
)
