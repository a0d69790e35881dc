"""Warm start (``cli/warmstart.py``): a forked worker must behave as ``python -u script.py``
would -- argv, sys.path[0], ``__main__``, its own environment and session, exit statuses,
atexit -- and a template that cannot start must not stop the job.  Real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from chameleon_ft.cli.warmstart import DEFAULT_PRELOAD, WarmSpawner, preload_modules

PROBE = textwrap.dedent("""
    import atexit, json, os, sys
    out = os.environ["PROBE_OUT"]
    def bye():
        with open(out + ".atexit", "w") as f:
            f.write("ran")
    atexit.register(bye)
    with open(out, "w") as f:
        json.dump({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                   "rank": os.environ.get("RANK"), "pid": os.getpid(),
                   "sid": os.getsid(0), "preloaded": "fractions" in sys.modules,
                   "preload_s": os.environ.get("CHAMELEON_FT_PRELOAD_S")}, f)
    mode = sys.argv[1]
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("boom from the script")
    if mode == "sleep":
        import time
        time.sleep(60)
""")


@pytest.fixture
def spawner(tmp_path):
    with open(tmp_path / "stderr.txt", "wb") as err:
        sp = WarmSpawner(["fractions"], dict(os.environ), stderr=err)
    yield sp
    sp.close()


def _run(spawner, tmp_path, mode, rank="0"):
    script = tmp_path / "probe.py"
    if not script.exists():  # rewriting it could truncate it under a child still reading it
        script.write_text(PROBE)
    out = tmp_path / f"probe_{mode}.json"
    env = dict(os.environ, RANK=rank, PROBE_OUT=str(out))
    return spawner.spawn([str(script), mode, "x"], env), out


def test_forked_worker_sees_what_a_fresh_interpreter_would(spawner, tmp_path):
    p, out = _run(spawner, tmp_path, "ok", rank="3")
    assert p.wait(30) == 0
    got = json.loads(out.read_text())
    assert got["argv"] == [str(tmp_path / "probe.py"), "ok", "x"]
    assert got["path0"] == str(tmp_path)
    assert got["name"] == "__main__"
    assert got["rank"] == "3"  # its own environment, set after the fork
    assert got["pid"] == p.pid and got["sid"] == p.pid  # its own session, as start_new_session
    assert got["preloaded"]  # the template's import is inherited
    assert float(got["preload_s"]) == pytest.approx(spawner.preload_s) and spawner.preload_s > 0
    assert (tmp_path / "probe_ok.json.atexit").read_text() == "ran"


def test_ps_shows_the_workers_own_command_line(spawner, tmp_path):
    p, _ = _run(spawner, tmp_path, "sleep")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cmdline = open(f"/proc/{p.pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if "probe.py" in cmdline:
                break
            time.sleep(0.05)
        assert f"-u {tmp_path / 'probe.py'} sleep x" in cmdline, cmdline
    finally:
        p.kill()
        p.wait(30)


def test_exit_status_exception_and_signal_come_back(spawner, tmp_path):
    p3, _ = _run(spawner, tmp_path, "exit3")
    praise, _ = _run(spawner, tmp_path, "raise")
    psleep, _ = _run(spawner, tmp_path, "sleep")
    assert p3.wait(30) == 3
    assert praise.wait(30) == 1
    assert "ValueError: boom from the script" in (tmp_path / "stderr.txt").read_text()
    time.sleep(0.2)
    assert psleep.poll() is None
    os.kill(psleep.pid, signal.SIGKILL)  # from outside, by PID
    assert psleep.wait(30) == -signal.SIGKILL
    late, _ = _run(spawner, tmp_path, "sleep")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            late.wait(0.3)
    finally:
        late.kill()
    assert late.wait(30) == -signal.SIGKILL


def test_a_preload_that_does_not_import_falls_back_to_fresh_interpreters(tmp_path):
    script = tmp_path / "w.py"
    # each worker leaves a file (two workers printing to one pipe may interleave their writes)
    script.write_text("import os, pathlib\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'ran_' + os.environ['RANK']).write_text('x')\n")
    r = subprocess.run([sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", "2",
                        "--run-dir", str(tmp_path / "run"), "--preload", "no_such_module_xyz",
                        str(script)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warm start off" in r.stderr and "no_such_module_xyz" in r.stderr
    assert (tmp_path / "ran_0").exists() and (tmp_path / "ran_1").exists()


def test_startup_counts_the_inherited_imports():
    from chameleon_ft.runtime.env import PRELOAD_S, process_age_s, startup_s

    age = process_age_s()
    assert startup_s({}) == pytest.approx(age, abs=0.5)
    assert startup_s({PRELOAD_S: "2.5"}) == pytest.approx(age + 2.5, abs=0.5)
    assert startup_s({PRELOAD_S: "junk"}) == pytest.approx(age, abs=0.5)


def test_preload_spec():
    assert preload_modules("") == ()
    assert preload_modules("a, b") == ("a", "b")
    assert preload_modules("+lightning,torch") == DEFAULT_PRELOAD + ("lightning",)


def test_lightnings_rank_read_at_import_is_set_again_in_each_fork(tmp_path):
    """Lightning sets ``rank_zero_only.rank`` from RANK when imported; imported in the template
    it would say 0 in every worker.  Each fork must see its own."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\n"
                      "from lightning_utilities.core.rank_zero import rank_zero_only\n"
                      "open(os.environ['PROBE_OUT'], 'w').write(str(rank_zero_only.rank))\n")
    sp = WarmSpawner(["lightning_utilities.core.rank_zero"], dict(os.environ))
    try:
        procs = [(r, sp.spawn([str(script)], dict(os.environ, RANK=str(r), PROBE_OUT=str(tmp_path / f"r{r}"))))
                 for r in (0, 1, 2)]
        for r, p in procs:
            assert p.wait(30) == 0
            assert (tmp_path / f"r{r}").read_text() == str(r)
    finally:
        sp.close()


def test_a_preloaded_accelerate_ft_hides_torchruns_variables_in_each_fork(tmp_path):
    """``accelerate_ft`` records the launch environment and removes torchrun's variables when
    imported in a ``chameleon-ft run`` worker (Accelerate would otherwise set up a fixed default
    process group).  Imported in the template (``--preload +transformers_ft``), that import saw
    no worker: each fork must do it with its own environment -- the variables gone, its own
    rank recorded."""
    from chameleon_ft.runtime import env as E

    script = tmp_path / "acc.py"
    script.write_text("import json, os\n"
                      "from accelerate_ft._env import launch_env\n"
                      "json.dump({'left': [k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR') if k in os.environ],\n"
                      "           'rank': launch_env().rank}, open(os.environ['PROBE_OUT'], 'w'))\n")
    sp = WarmSpawner(["accelerate_ft"], dict(os.environ))
    try:
        procs = []
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                       PROBE_OUT=str(tmp_path / f"r{r}"), **{E.STORE: "127.0.0.1:1", E.LIGHTHOUSE: "x",
                                                             E.WORKER_ID: str(r)})
            procs.append((r, sp.spawn([str(script)], env)))
        for r, p in procs:
            assert p.wait(60) == 0
            assert json.loads((tmp_path / f"r{r}").read_text()) == {"left": [], "rank": r}
    finally:
        sp.close()


def test_with_warm_start_the_launcher_never_loads_torch(tmp_path):
    """The coordinator lives in an agent forked from the template (``cli/coordinator.py``):
    the launcher process itself maps no libtorch while its job runs."""
    script = tmp_path / "w.py"
    flag = tmp_path / "started"
    script.write_text(f"import time, pathlib; pathlib.Path({str(flag)!r}).write_text('x'); time.sleep(3)\n")
    p = subprocess.Popen([sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", "1",
                          "--run-dir", str(tmp_path / "run"), str(script)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert flag.exists(), p.communicate(timeout=30)
        maps = open(f"/proc/{p.pid}/maps").read()
        assert "libtorch" not in maps
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "coordinator 127.0.0.1:" in err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_the_coordinator_agent_ends_without_an_abort(tmp_path):
    """When its node's workers are done, the agent shuts the coordinator down and ends at once,
    without the interpreter's finalization (which would stop the coordinator's daemon threads
    inside C++ calls and abort the agent: "FATAL: exception not rethrown")."""
    script = tmp_path / "w.py"
    script.write_text("import sys, time; time.sleep(1); sys.exit(1)\n")
    p = subprocess.run([sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", "2",
                        "--max-replacements", "0", "--run-dir", str(tmp_path / "run"), str(script)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "exited with code 1" in p.stderr
    assert "FATAL" not in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
