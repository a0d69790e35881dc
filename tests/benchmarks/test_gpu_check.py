"""``benchmarks/gpu_check.py --cpu --quick`` end to end (issue 25): the GPU check's three
executors and both adapters, each killed from outside, with its checks and its baselines, on
the CPU -- so that the script a GPU machine runs is known to work before its minutes are spent."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


# Chaos since 2026-12-02 (42 s of the default run on this machine): the three kills it makes are
# each a default test (tests/README.md); run it before a device session (docs/gpu.md).
@pytest.mark.chaos
def test_gpu_check_runs_on_the_cpu(tmp_path):
    res = gpu_check.main(["--cpu", "--quick", "--hidden", "32", "--json", str(tmp_path / "gpu.json")])
    assert set(res["kinds"]) == {"dp", "pipeline", "sharded", "accelerate", "lightning"}
    for kind, r in res["kinds"].items():
        assert r["device"] == "cpu"
        assert r["exactly_once"], kind
        assert r["trajectory_ok"], (kind, r["trajectory_rel"])
        assert r["replicas_equal"] is not False, kind
        assert r["survivors"] == sorted({0, 1, 2, 3} - set(r["killed"])), kind
        assert all(m is not None and 0 < m < 10 for m in r["mttr_s"]), (kind, r["mttr_s"])
        assert r["baseline_run"]["ran"], (kind, r["baseline_run"])  # gloo on the CPU runs every baseline
        assert "overhead" in r and r["memory_mb"]["before"] and r["memory_mb"]["after"], kind
    assert res["kinds"]["dp"]["killed"] == [2, 3, 1] and len(res["kinds"]["dp"]["memory_mb"]["after"]) == 3
    assert "growth_mb" in res["kinds"]["dp"]["memory_mb"]
    assert res["passed"]
    assert res["nccl_abort"] == {"ran": False, "why": "--cpu"}
    # The step at size: ours and plain DDP ran the same loop; on the CPU no syncs are counted.
    pf = res["perf"]
    assert pf["ran"] and pf["size"] == "tiny" and pf["workers"] == 2, pf
    assert len(pf["runs"]["ours"]) == len(pf["runs"]["ddp"]) == 2
    assert pf["step_s"]["ours"] > 0 and pf["step_s"]["ddp"] > 0 and pf["peak_mb"]["ddp"] > 0
    assert pf["syncs_per_step"] is None


def test_a_baseline_that_failed_is_reported_by_its_workers_exception():
    # On the H200 (2026-12-04) torch's pipelining baseline failed under torchrun and the report
    # kept torchrun's summary line ("error_file: <N/A>"), not the worker's exception.
    out = ("[rank1]: RuntimeError: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:3507\n"
           "[rank1]: Traceback (most recent call last):\n"
           "[rank1]:   File \"w.py\", line 3, in <module>\n"
           "[rank1]: RuntimeError: no CUDA send here\n"
           "E1204 12:00:00 torch/distributed/elastic: failed\n"
           "  error_file: <N/A>\n")
    assert gpu_check._worker_error(out) == "[rank1]: RuntimeError: no CUDA send here"
    assert gpu_check._worker_error("x\n  error_file: <N/A>\n") == "error_file: <N/A>"
