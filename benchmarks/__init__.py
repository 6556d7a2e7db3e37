"""Benchmarks and the demo builder: run from the repository root as modules.

    python -m benchmarks.fused          python -m benchmarks.train_step
    python -m benchmarks.paper_table    python -m benchmarks.serve
    python -m benchmarks.build_demo

Not part of the installed wheel. ``common`` holds what the scripts share; random adapters come from
``tests/factories.py`` and the server launcher from ``tests/server/launcher.py``, as the tests use them.
"""
