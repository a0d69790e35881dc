"""A minimal run of the benchmark matrix: chameleon-ft and the torchrun checkpoint-restart
baseline (with its workaround), failure-free and one SIGKILL, 4 workers.  Asserts the result
structure and that chameleon-ft survived the kill; no timing assertions.  Every process is
cleaned up by PID inside ``run_one`` (``Job.cleanup``), also on failure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import matrix  # noqa: E402

KEYS = {"system", "family", "variant", "scenario", "crashed", "completed", "mttr_s", "throughput",
        "throughput_before", "throughput_after", "efficiency", "samples_lost", "samples_duplicated",
        "peak_rss_mb", "final_loss", "wall_s", "note"}


def test_matrix_short(tmp_path):
    out, doc = tmp_path / "res.json", tmp_path / "benchmarks.md"
    rc = matrix.bench_main(["--systems", "chameleon-ft,torchrun-restart+fix", "--scenarios", "failure-free,kill",
                            "--steps", "30", "--timeout", "90", "--json", str(out), "--doc", str(doc)])
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
    text = doc.read_text()
    assert "accelerator emulation" in text and res["date"] in text and "### kill:" in text
