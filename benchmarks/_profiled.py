"""``fit``: run ``trainer.fit(max_steps=steps)``, under cProfile into ``OUT.prof`` on worker 0 when
asked (the benchmark workers' ``--profile``)."""

from __future__ import annotations

import os


def fit(trainer, steps: int, out: str, profile: bool) -> None:
    if profile and os.environ.get("CHAMELEON_FT_WORKER_ID") == "0":
        import cProfile

        prof = cProfile.Profile()
        prof.runcall(trainer.fit, max_steps=steps)
        prof.dump_stats(out + ".prof")
    else:
        trainer.fit(max_steps=steps)
