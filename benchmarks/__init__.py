"""Benchmark suite of issue 5: fast gates and conditional computation, ratios measured side by side.

Run ``python -m benchmarks`` (``--quick`` for a short pass, ``--device cuda`` on a GPU). Not
collected by the test run (pytest's ``testpaths`` is ``tests``); nothing here asserts timings.
"""
