"""A minimal run of the benchmark matrix: chameleon-ft and the torchrun checkpoint-restart
baseline (with its workaround), failure-free and one SIGKILL, 4 workers.  Asserts the result
structure, that chameleon-ft survived the kill, and the samples lost / duplicated the harness
counts from the ids each worker logged: chameleon-ft trains every committed step's samples
exactly once, torchrun's restart trains the steps after its checkpoint twice; no timing
assertions.  Every process is
cleaned up by PID inside ``run_one`` (``Job.cleanup``), also on failure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import matrix  # noqa: E402
from harness import metrics  # noqa: E402

KEYS = {"system", "family", "variant", "scenario", "crashed", "completed", "mttr_s", "throughput",
        "throughput_before", "throughput_after", "efficiency", "samples_lost", "samples_duplicated",
        "peak_rss_mb", "final_loss", "wall_s", "note"}


@pytest.mark.chaos  # the harness on real runs is a benchmark (tests/README.md)
# Four real runs: ~60 s on an idle 2-core machine, ~5 min when it is shared.
@pytest.mark.timeout(900)
def test_matrix_short(tmp_path):
    out, doc, keep = tmp_path / "res.json", tmp_path / "benchmarks.md", tmp_path / "runs"
    rc = matrix.bench_main(["--systems", "chameleon-ft,torchrun-restart+fix", "--scenarios", "failure-free,kill",
                            "--steps", "30", "--timeout", "240", "--json", str(out), "--doc", str(doc),
                            "--keep", str(keep)])
    assert rc == 0
    res = json.loads(out.read_text())
    runs = {(r["system"], r["scenario"]): r for r in res["runs"]}
    assert set(runs) == {(s, sc) for s in ("chameleon-ft", "torchrun-restart+fix") for sc in ("failure-free", "kill")}
    for r in runs.values():
        assert KEYS <= set(r), KEYS - set(r)
    ff, kill = runs[("chameleon-ft", "failure-free")], runs[("chameleon-ft", "kill")]
    assert not ff["crashed"] and ff["samples_lost"] == 0 and ff["samples_duplicated"] == 0
    assert not kill["crashed"], kill.get("error_tail")
    assert kill["mttr_s"] is not None and kill["survivors"] == 3
    assert kill["samples_lost"] == 0 and kill["samples_duplicated"] == 0
    # The ids behind those counts: chameleon-ft's committed steps trained each sample once.
    run = next(keep.glob("*-chameleon-ft-kill-*"))
    recs = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    from chameleon_ft.runtime.eventlog import read_events

    ids = metrics.trained_ids(recs + metrics.attempts_from_events(read_events(run / "events.jsonl")))
    per_step = {}
    for (step, _key), got in ids.items():
        per_step.setdefault(step, []).extend(got)
    assert sorted(per_step) == list(range(30))
    for step, got in per_step.items():
        assert sorted(got) == list(range(64 * step, 64 * step + 64)), f"step {step}"
    # torchrun's restart: the steps both rounds committed were trained twice, measured from ids.
    tr = runs[("torchrun-restart+fix", "kill")]
    assert not tr["crashed"], tr.get("error_tail")
    run = next(keep.glob("*-torchrun-restart+fix-kill-*"))
    recs = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    rounds = {}
    for r in recs:
        if r["kind"] == "step":
            rounds.setdefault(r["step"], set()).add(r["restart"])
    twice = [s for s, rs in rounds.items() if len(rs) > 1]
    assert twice, "the restart redid no step"
    assert tr["samples_duplicated"] == 64 * len(twice) and tr["samples_lost"] == 0
    text = doc.read_text()
    assert "accelerator emulation" in text and res["date"] in text and "### kill:" in text
