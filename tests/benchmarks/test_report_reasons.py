"""``docs/benchmarks.md``'s reasons come from the runs' data (synthetic results, pure logic).

Each reason must quote the figures of the run it explains (shrink's global batch from its own
log, the spread that makes a difference noise, the core count behind an efficiency above 1), and
a difference that nothing in the data explains must read "not explained"."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness.report import write_report  # noqa: E402


def row(system, scenario, mb=0.025, **kw):
    fam = "chameleon-ft" if system.startswith("chameleon-ft") else system.split("+")[0]
    r = {"system": system, "family": fam, "variant": "", "scenario": scenario, "nproc": 4, "mb_sleep": mb,
         "crashed": False, "completed": True, "note": "", "t_fault": 1.0, "fault_times": [1.0],
         "mttr_s": 0.2, "mttrs_s": [0.2], "throughput": 800.0, "throughput_before": 1000.0,
         "throughput_after": 750.0, "efficiency": 0.94, "step_time_s": 0.060, "step_time_after_s": 0.085,
         "survivors": 3, "samples_lost": 0, "samples_duplicated": 0, "peak_rss_mb": 370.0, "final_loss": 2.0533,
         "wall_s": 12.0, "startup_s": 4.0, "batch_first": 64, "batch_last": 64, "failure_free_throughput": 1000.0,
         "timeline": [[0.0, 0, 64, 4], [1.0, 10, 64, 3]], "chameleon": {"decisions": [], "breakdowns": []}}
    if scenario == "failure-free":
        r.update(mttr_s=None, mttrs_s=[], throughput_before=None, throughput_after=None, efficiency=None,
                 step_time_after_s=None, survivors=None, t_fault=None, fault_times=[],
                 timeline=[[0.0, 0, 64, 4], [1.0, 10, 64, 4]])
    r.update(kw)
    return r


def results(runs):
    return {"runs": runs, "command": "python benchmarks/matrix.py", "date": "today", "cpu_count": 2,
            "machine": "vm: 2 CPU cores", "steps": 60, "global_batch": 64, "micro_batch": 8, "duration_s": 1.0,
            "modes": {"0.025": "emulation", "0.0": "plain CPU"},
            "systems": {s: {"family": "", "variant": "", "note": ""} for s in dict.fromkeys(r["system"] for r in runs)},
            "scenarios": {"failure-free": "", "kill": ""}}


def test_reasons_quote_the_runs_data_and_say_not_explained(tmp_path):
    runs = [
        row("chameleon-ft", "failure-free"), row("torchrun-restart+fix", "failure-free"),
        # three repeats: throughput_before spread (1000-1010)/1005 = 1.0 %
        *[row("chameleon-ft", "kill", throughput_before=v) for v in (1000.0, 1005.0, 1010.0)],
        # shrink cut the batch to 32 (not the 48 a fixed sentence would claim)
        row("chameleon-ft[shrink]", "kill", batch_last=32, survivors=2, throughput_after=780.0,
            step_time_after_s=0.041, timeline=[[0.0, 0, 64, 4], [1.0, 10, 32, 2]]),
        # 3 % faster before the fault than chameleon-ft's median: three times the measured spread
        row("torchrun-restart+fix", "kill", throughput_before=1035.0, survivors=4, samples_duplicated=448,
            throughput_after=1040.0, step_time_after_s=0.061, efficiency=1.0),
        row("torchft-tuned", "kill", mttr_s=0.4, samples_lost=448),
        # plain CPU: efficiency 2.14 with 4 -> 3 processes on 2 cores
        row("chameleon-ft", "failure-free", mb=0.0, throughput=5309.0, step_time_s=0.012),
        row("chameleon-ft", "kill", mb=0.0, throughput_before=6483.0, throughput_after=8531.0, efficiency=2.14,
            failure_free_throughput=5309.0, step_time_after_s=0.007),
    ]
    text = write_report(results(runs), tmp_path / "benchmarks.md").read_text()
    shrink = next(line for line in text.splitlines() if line.startswith("* samples/s after: chameleon-ft[shrink]"))
    assert "from 64 to 32 samples" in shrink and "2 survivors" in shrink and "41 ms" in shrink
    assert "64 -> 48" not in text
    before = next(line for line in text.splitlines() if line.startswith("* samples/s before: torchrun-restart+fix"))
    assert "not explained" in before and "3.0% difference" in before and "1.0%" in before
    assert "noise" not in before
    restart = next(line for line in text.splitlines() if line.startswith("* samples/s after: torchrun-restart+fix"))
    assert "all 4 workers again" in restart and "redid 448 samples" in restart
    assert "chameleon-ft's median is 0.50x TorchFT tuned's (TorchFT tuned lost 448 samples, chameleon-ft 0)" in text
    cpu = next(line for line in text.splitlines() if line.startswith("* chameleon-ft 2.14:"))
    assert "4 processes shared 2 cores" in cpu and "3 after" in cpu and "1.33x" in cpu
    assert "not explained" in cpu and "1.75" in cpu   # against its own before: 8531 / (6483 x 3/4)


def test_a_difference_within_the_measured_spread_is_noise(tmp_path):
    runs = [row("chameleon-ft", "failure-free"), row("torchrun-restart+fix", "failure-free"),
            *[row("chameleon-ft", "kill", throughput_before=v) for v in (1000.0, 1030.0, 1060.0)],
            row("torchrun-restart+fix", "kill", throughput_before=1045.0)]
    text = write_report(results(runs), tmp_path / "benchmarks.md").read_text()
    before = next(line for line in text.splitlines() if line.startswith("* samples/s before: torchrun-restart+fix"))
    assert "within the run-to-run spread" in before and "5.8%" in before and "noise" in before
