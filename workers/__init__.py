"""Spawnable worker processes that run the real flows over a shmslots table.

Installed as `shmslots.workers` (pyproject.toml: package-dir), so the wheel holds no
top-level package but `shmslots`; the modules import each other relatively.  The library
never imports this package; the CLI's demo, the tests and the tools do.
"""
