"""Spawnable worker processes that run the real flows over a shmslots table.

The library never imports this package; the CLI's demo, the tests and the
tools do.
"""
