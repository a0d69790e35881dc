"""Which repair recipe should a rehabilitated shard get?  A sweep over ``RehabRecipe`` settings
on the issue-23 matrix's jobs (``benchmarks/sharded_matrix.py``: 4 CPU workers, FSDP2 over all
4, AdamW, 64 steps, ``ElasticConfig()`` defaults, worker 2 SIGKILLed from outside at the kill
step), reporting per (model kind, kill step, recipe) the median lag (``lag_estimate``: steps of
progress behind the same seed's failure-free run, on the same batches; none on a plateau) and
the final test loss over the same seed's failure-free one (median and worst).

    python benchmarks/rehab_recipe_sweep.py [--kinds lm,conv,mlp] [--kills 12,36,52] [--seeds 5]
        [--recipes "warmup_steps=10;warmup_steps=0,extrapolate_snapshots=2"] [--jobs 2]
        [--workdir DIR] [--jsonl F] [--markdown F]

A recipe is ``RehabRecipe`` fields (``_shard_bench.py --recipe``).  Every run is kept in
``--jsonl`` (its loss curve and its failure-free run's), ``--from-jsonl F`` renders without
running.  The engine chooses the path in each run (rehabilitation is what it chose in every run
of the sweep recorded in ``docs/runtime-sharded.md``; a run where it did not is marked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import sharded_matrix as sm  # noqa: E402


def run(work: Path, kind: str, seed: int, kill, recipe: str) -> dict:
    """One job (``kill`` None: failure-free), the matrix's (``sharded_matrix.run``, kept and
    reused by the same code and settings) with the recipe; the lowest member's final JSON."""
    out = work / f"{kind}-s{seed}-{kill}-{recipe or 'default'}"
    finals = sm.run(out, "ours", kind, seed, None, kill, extra=("--recipe", recipe) if recipe else ())
    return finals[min(finals)]


def sweep(work: Path, kinds, kills, seeds: int, recipes, jobs: int, jsonl: Path) -> None:
    sm.REUSE = True  # a run this code already finished is not run again
    pool = ThreadPoolExecutor(max(1, jobs))
    refs = {(k, s): pool.submit(run, work, k, s, None, "") for k in kinds for s in range(seeds)}
    futs = {(k, s, at, r): pool.submit(run, work, k, s, at, r)
            for k in kinds for at in kills for s in range(seeds) for r in recipes}
    with open(jsonl, "w") as f:  # every run again: finished ones are reused, not rerun
        for (k, s, at, r), fut in futs.items():
            try:
                w, ref = fut.result(), refs[(k, s)].result()
            except RuntimeError as exc:
                print(f"{k} seed {s} kill {at} {r}: ERROR {str(exc)[-300:]}", flush=True)
                continue
            d = w.get("decision") or {}
            f.write(json.dumps({"kind": k, "seed": s, "kill": at, "recipe": r, "chosen": d.get("chosen"),
                                "pred": d.get("predicted_heal_steps"), "step": d.get("step"),
                                "test": w.get("test_loss"), "ref": ref.get("test_loss"),
                                "rows": w["rows"], "ref_rows": ref["rows"]}) + "\n")
            f.flush()
    pool.shutdown()


def markdown(records: list[dict]) -> list[str]:
    groups: dict = {}
    for r in records:
        # the matrix's window, max(8, 2K), at the default interval of a 64-step run (K = 8)
        est = sm.lag_estimate(sm.trajectory(r["rows"]), sm.trajectory(r["ref_rows"]), r["step"] or r["kill"], 16)
        groups.setdefault((r["kind"], r["kill"], r["recipe"] or "default"), []).append(
            (est["lag"], r["test"] / r["ref"], r["chosen"]))
    lines = ["| model | kill at | recipe | runs | lag, median of the measurable (runs) | final test loss / failure-free: median | worst | engine chose |",
             "| --- | ---: | --- | ---: | --- | ---: | ---: | --- |"]
    for (kind, at, recipe), xs in sorted(groups.items()):
        lags = [x[0] for x in xs if x[0] is not None]
        rel = [x[1] for x in xs]
        chose = sorted({x[2] for x in xs})
        lines.append(f"| {kind} | {at} | `{recipe}` | {len(xs)} | "
                     + (f"{statistics.median(lags):.2f} ({len(lags)})" if lags else "plateau") + " | "
                     f"{statistics.median(rel):.3f} | {max(rel):.3f} | {', '.join(map(str, chose))} |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="lm,conv,mlp")
    p.add_argument("--kills", default="12,36,52")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--recipes", default="warmup_steps=10;warmup_steps=10,extrapolate_snapshots=2;"
                                        "warmup_steps=0;warmup_steps=0,extrapolate_snapshots=2")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--jsonl", default=None, help="every run (written anew; finished runs are reused)")
    p.add_argument("--from-jsonl", default=None, help="render these runs instead of running")
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    if a.from_jsonl:
        src = [Path(x) for x in a.from_jsonl.split(",")]
    else:
        work = Path(a.workdir or tempfile.mkdtemp(prefix="cft_recipe_"))
        src = [Path(a.jsonl or work / "runs.jsonl")]
        src[0].parent.mkdir(parents=True, exist_ok=True)
        sweep(work, a.kinds.split(","), [int(x) for x in a.kills.split(",")], a.seeds, a.recipes.split(";"),
              a.jobs, src[0])
    records = [json.loads(line) for f in src for line in f.read_text().splitlines() if line.strip()]
    text = "\n".join(markdown(records)) + "\n"
    if a.markdown:
        Path(a.markdown).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
