"""Issue 23's quality control: how far a *harmless* change moves a failure-free run's final
test loss, beside how far a rehabilitation moves it.

    python benchmarks/sharded_controls.py --matrix-json F [--steps 12,36,52] [--jobs 2]
        [--workdir DIR] [--reuse] [--json OUT]

The matrix (``sharded_matrix.py``) judges a rehabilitated run's final test loss against the
spread of the failure-free seeds (min..max).  A seed at either end of that spread leaves it
with any change of its trajectory at all, for better or worse: the question that the spread
cannot answer is whether a rehabilitation moves the final loss *more than a change that costs
no quality*.  The control is such a change: the failure-free run of the same seed, every
setting the same, where one step (``--steps``: early, mid and late in the run) trains on another
random draw of samples than its scheduled batch (``_shard_bench.py --perturb-step``; SGD's batch
is itself a random draw).  For the seeds and models of ``--matrix-json`` (its failure-free runs
are the reference: the same code path, no failure), each control run's final test loss is
compared with its seed's failure-free one exactly as the matrix compares a rehabilitated run's.

Report (``markdown``, rendered by ``sharded_bench.py --parts matrix`` when the controls'
JSON is given with the matrix's): per model and framework, for the controls and for the
rehabilitated runs (all of them, and those killed at the controls' steps), how many end
inside the seed spread and above its worst seed, how many changed it by no more than the spread's width (no more than
changing the seed does), and the size of the change against the same seed (|relative
change|: median, 90th percentile, largest); a one-sided Mann-Whitney test of
whether rehabilitation's changes are larger than the harmless one's (scipy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharded_matrix  # noqa: E402

STEPS = (12, 36, 52)  # the default interval's kills: early (mid-interval), mid and late in the run


def seeds_of(matrix: dict) -> dict[tuple[str, str], list[int]]:
    """(engine, kind) -> the seeds of the matrix's failure-free runs."""
    out: dict = {}
    for key in matrix["free"]:
        engine, kind, seed = key.rsplit("-", 2)
        out.setdefault((engine, kind), []).append(int(seed))
    return {k: sorted(v) for k, v in out.items()}


def controls(work: Path, matrix: dict, steps, jobs: int) -> tuple[list[dict], list[dict]]:
    """Every control run: (results, errors)."""
    pool = ThreadPoolExecutor(max(1, jobs))
    futs = []
    for (engine, kind), seeds in seeds_of(matrix).items():
        for step in steps:
            for seed in seeds:
                out = work / f"{engine}-{kind}-ctl{step}-s{seed}"
                futs.append(({"engine": engine, "kind": kind, "seed": seed, "step": step},
                             pool.submit(sharded_matrix.run, out, engine, kind, seed, None, None, None,
                                         ("--perturb-step", str(step)))))
    res, errors = [], []
    for meta, fut in futs:
        name = f"{meta['engine']}-{meta['kind']}-ctl{meta['step']}-s{meta['seed']}"
        try:
            w = fut.result()
        except RuntimeError as exc:
            errors.append({"run": name, "error": str(exc)[-1500:]})
            continue
        low = w[min(w)]
        res.append({**meta, "test_loss": low.get("test_loss"), "test_acc": low.get("test_acc"),
                    "traj": sharded_matrix._traj(low["rows"])})
        print(f"{name}: {low.get('test_loss')}", flush=True)
    pool.shutdown()
    return res, errors


# ------------------------------------------------------------------ report (pure)
def changes(matrix: dict) -> dict:
    """(engine, kind) -> {"control": [...], "rehab": [...], "rehab_at": [...]}: each run as
    (relative change against its seed's failure-free test loss, inside the spread, above the
    worst seed, its change no larger than the spread's width -- than changing the seed)."""
    free = matrix["free"]
    steps = sorted({c["step"] for c in matrix.get("controls", [])})
    out: dict = {}

    def entry(engine, kind, seed, loss):
        lo, hi = sharded_matrix.spread(free, engine, kind)
        ref = free[f"{engine}-{kind}-{seed}"]["test_loss"]
        return (loss / ref - 1.0, sharded_matrix._inside(loss, lo, hi), loss > hi * (1 + 1e-4),
                abs(loss - ref) <= (hi - lo) * (1 + 1e-4))

    for c in matrix.get("controls", []):
        if f"{c['engine']}-{c['kind']}-{c['seed']}" in free:
            out.setdefault((c["engine"], c["kind"]), {"control": [], "rehab": [], "rehab_at": []})["control"].append(
                entry(c["engine"], c["kind"], c["seed"], c["test_loss"]))
    for c in matrix["cells"]:
        a = c["auto"]
        key = (c["engine"], c["kind"])
        if key not in out or a["chosen"] != "rehabilitate" or a["fallback"]:
            continue
        e = entry(c["engine"], c["kind"], c["seed"], a["test_loss"])
        out[key]["rehab"].append(e)
        if c["kill_step"] in steps and c["k_label"] == "default":
            out[key]["rehab_at"].append(e)
    return out


def larger_p(rehab: list[float], control: list[float]):
    """One-sided Mann-Whitney p-value of 'rehabilitation's |changes| are larger than the
    control's' (None with too few runs)."""
    if len(rehab) < 3 or len(control) < 3:
        return None
    from scipy.stats import mannwhitneyu
    return float(mannwhitneyu(rehab, control, alternative="greater").pvalue)


def _row(who: str, label: str, xs: list) -> str:
    mags = sorted(abs(x[0]) for x in xs)
    if not mags:
        return f"| {who} | {label} | 0 | - | - | - | - | - | - |"
    q90 = sharded_matrix.quantile(mags, 90)
    return (f"| {who} | {label} | {len(xs)} | {sum(x[1] for x in xs)} ({100 * sum(x[1] for x in xs) / len(xs):.0f} %) | "
            f"{sum(x[2] for x in xs)} | {sum(x[3] for x in xs)} | {100 * statistics.median(mags):.2f} % | {100 * q90:.2f} % | {100 * mags[-1]:.2f} % |")


def markdown(matrix: dict) -> list[str]:
    if not matrix.get("controls"):
        return []
    inv = matrix.get("controls_command")
    by = changes(matrix)
    steps = sorted({c["step"] for c in matrix["controls"]})
    lines = ["### Quality against a harmless change (the control)", "",
             (f"`{inv['command']}` ({inv['date']}; {inv['minutes']:.0f} min).  " if inv else "")
             + "Each seed's failure-free run once more, every setting the same, where step "
             + ", ".join(map(str, steps)) + " (one per run) trains on another random draw of samples than its "
             "scheduled batch -- a change that costs no quality (SGD's batch is itself a random draw) -- "
             "against the same seed's failure-free test loss, beside the rehabilitated runs (the engine's "
             "choice, every kill; and those killed at the same steps with the default interval).  "
             "Method: `benchmarks/sharded_controls.py`.", "",
             "| model | runs | n | inside the seed spread | above the worst seed | \\|change\\| within the spread's width | \\|change\\| median | 90th percentile | largest |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    verdicts = []
    for (engine, kind), d in sorted(by.items()):
        who = f"{kind} ({'Lightning' if engine == 'lightning' else 'ElasticTrainer'})"
        for label, key in (("harmless change", "control"), ("rehabilitated, every kill", "rehab"),
                           (f"rehabilitated, killed at {'/'.join(map(str, steps))}", "rehab_at")):
            lines.append(_row(who, label, d[key]))
        p = larger_p([abs(x[0]) for x in d["rehab"]], [abs(x[0]) for x in d["control"]])
        if p is not None:
            verdicts.append(f"{who}: p = {p:.3f}")
    lines += ["", "One-sided Mann-Whitney test that rehabilitation's |change| is larger than the harmless "
              "change's (every rehabilitated run against every control run): " + "; ".join(verdicts) + ".", ""]
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matrix-json", required=True, help="a sharded_matrix.py --json result: its seeds and models")
    p.add_argument("--steps", default=",".join(map(str, STEPS)))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--reuse", action="store_true", help="as sharded_matrix.py's")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    sharded_matrix.REUSE = a.reuse
    matrix = sharded_matrix.merge([json.loads(Path(f).read_text()) for f in a.matrix_json.split(",")])
    work = Path(a.workdir or tempfile.mkdtemp(prefix="cft_controls_"))
    t0 = time.time()
    res, errors = controls(work, matrix, [int(s) for s in a.steps.split(",") if s], a.jobs)
    out = {"controls": res, "control_errors": errors, "controls_command": {
        "command": ("python benchmarks/sharded_controls.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "minutes": (time.time() - t0) / 60}}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print("\n".join(markdown({**matrix, **out})))
    return out


if __name__ == "__main__":
    main()
