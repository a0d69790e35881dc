"""Benchmark harness: the scenario x system matrix (issue 6).

``systems``   how each system is launched on the shared script (``benchmarks/baselines/``)
``scenarios`` what is injected, from outside, by PID
``metrics``   per-run figures derived from the common progress log (``steps.jsonl``)
``report``    results JSON -> ``docs/benchmarks.md`` tables and plots
Entry point: ``benchmarks/matrix.py`` (``bench_main``).
"""
