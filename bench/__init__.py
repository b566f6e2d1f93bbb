"""Benchmarks of the production path against the hardware limits (``python3 -m bench.run``).

Not a test suite: nothing here is collected by pytest and CI never runs it.
"""
