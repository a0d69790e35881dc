"""``run``: a benchmark worker's loop, under cProfile into ``OUT.prof`` when asked (the benchmark
workers' ``--profile``); ``fit``: ``trainer.fit(max_steps=steps)`` so, on worker 0."""

from __future__ import annotations

import os
from typing import Callable


def run(fn: Callable[[], object], out: str, profile: bool) -> None:
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.runcall(fn)
        prof.dump_stats(out + ".prof")
    else:
        fn()


def fit(trainer, steps: int, out: str, profile: bool) -> None:
    run(lambda: trainer.fit(max_steps=steps), out, profile and os.environ.get("CHAMELEON_FT_WORKER_ID") == "0")
