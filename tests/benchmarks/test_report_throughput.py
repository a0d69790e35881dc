"""``chameleon-ft report``: throughput is global samples committed per wall-clock second.

Synthetic event log (hand-computed figures) and one real ``chameleon-ft demo`` run whose worker
is SIGKILLed in accelerator-emulation mode: 3 survivors commit fewer samples per second than 4.
"""

from __future__ import annotations

import json

import pytest

from chameleon_ft.runtime.eventlog import read_events

from chameleon_ft.cli import report


def _step(ts, worker, step, samples, token, compute=0.1):
    return {"ts": ts, "event": "step", "worker": worker, "step": step, "world_size": 2, "samples": samples,
            "step_time": compute, "token": token}


def synthetic_log() -> list[dict]:
    """2 workers, 8 samples each per step, a step every 0.5 s; worker 1 dies during step 5's
    attempt; worker 0 redoes step 5 alone, then trains both shares, a step a second."""
    ev = [{"ts": 9.0, "event": "run_start", "worker": 0}]
    for i in range(5):
        ev += [_step(10 + 0.5 * i, 0, i, 8, "a"), _step(10.01 + 0.5 * i, 1, i, 8, "a")]
    ev += [_step(12.51, 0, 5, 8, "a"), _step(12.52, 1, 5, 8, "a")]          # interrupted attempt
    ev += [{"ts": 12.6, "event": "failure", "worker": 0, "workers": [1], "kind": "fail_stop", "step": 5}]
    ev += [_step(13.5 + i, 0, 5 + i, 16, "b", compute=0.9) for i in range(4)]  # steps 5-8
    ev += [{"ts": 17.0, "event": "run_end", "worker": 0}]
    return ev


def test_wall_clock_throughput_before_and_after_the_failure(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in synthetic_log()))
    summary = report.render(tmp_path, plot=False)
    # before: steps 1-4 (4 x 16 samples) between step 0 (10.01 s) and step 4 (12.01 s)
    assert summary["throughput_before_failure"] == pytest.approx(64 / 2.0)
    # after: steps 6-8 (3 x 16) between the redone step 5 (13.5 s) and step 8 (16.5 s)
    assert summary["throughput_after_failure"] == pytest.approx(48 / 3.0)
    assert summary["throughput"] == pytest.approx(8 * 16 / (16.5 - 10.01))
    assert "global samples/s, wall clock" in capsys.readouterr().out
    assert report.main([str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["throughput_before_failure"] == pytest.approx(32.0)
    assert printed["throughput_after_failure"] == pytest.approx(16.0)
    xs, ys = report.throughput_series(synthetic_log(), window=1)
    assert ys[-1] == pytest.approx(16.0) and ys[0] == pytest.approx(32.0)


@pytest.mark.slow
def test_demo_kill_lowers_wall_clock_throughput(tmp_path, capsys):
    """A real demo (4 workers, 20 ms per micro-batch, worker 2 SIGKILLed from outside): with 3
    survivors doing 4 workers' work, fewer samples are committed per second after the kill.

    Run with ``--mttf 3`` (``chameleon-ft demo`` -> launcher -> the workers' engine): the next
    failure is expected before the replacement (configured eta 5 s) could help, so waiting
    scores as rerouting and the engine reroutes, saying ``D = 3`` (the demo's default D,
    days, chooses ``wait``; ``runtime/test_demo_mttf.py`` runs the CLI itself, marked chaos)."""
    from chameleon_ft.cli import demo

    run = tmp_path / "demo"
    assert demo.main(["--epochs", "1", "--at-step", "8", "--mttf", "3", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    d = next(e["decision"] for e in read_events(run / "events.jsonl") if e["event"] == "decision"
             and e["decision"]["event"]["kind"] == "fail_stop")
    assert d["mttf_s"] == 3.0 and d["chosen"] == "reroute", d
    cand = {c["policy"]: c for c in d["candidates"]}
    assert cand["wait"]["feasible"] and cand["wait"]["score"] == pytest.approx(cand["reroute"]["score"])
    assert "D = 3" in out and "reroute" in out, out[-3000:]
    summary = report.render(run, plot=False)
    assert summary["failures"] >= 1
    assert summary["throughput_after_failure"] < summary["throughput_before_failure"], summary
