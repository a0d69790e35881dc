"""Warm start: one template interpreter imports the heavy modules once; each worker is a fork of it.

A worker spends its first seconds importing: torch, ``torch._dynamo`` (torch imports it the
first time an optimizer is built), our runtime.  On 2 cores, 4 workers importing at once take
several seconds before the first step, and a replacement pays it again while the survivors
wait.  ``chameleon-ft run`` therefore starts one *template* per launcher that imports the
``--preload`` modules and then forks each worker (and each replacement) on request.

What a worker sees is what ``python -u script.py args`` gives it: ``sys.argv``, ``sys.path[0]``
(the script's folder), the script run as ``__main__``, its own environment (set before the
script runs), its own session (process group) and PID, unbuffered stdio inherited from the
launcher, the script's exit status (``SystemExit``; an uncaught exception ends it as in a fresh
worker: ``runtime/errors.py``'s hook, code 70, once the runtime was preloaded, else the
traceback and code 1; a signal kills it) and ``atexit`` handlers.

The one difference: the preloaded modules were imported *before* the worker's own variables
(``RANK``, ``LOCAL_RANK``, ...) were set, with the launcher's environment.  A module that reads
them at import time would see the launcher's.  So the default preload is torch,
``torch._dynamo``, chameleon-ft's runtime and what the engine's first decision imports
(``scipy.optimize``, ``networkx``), none of which does.  Lightning does (its
``rank_zero_only.rank``, from ``RANK`` / ``LOCAL_RANK`` / ``SLURM_PROCID``): it is not in the
default, and when a script's launcher preloads it (``--preload +lightning,lightning_ft``: ``+``
adds to the default; it saves each Lightning worker its longest import) every fork sets that
rank again from its own environment, as Lightning's import would have (``accelerate_ft``'s
capture of the launch environment is run again likewise).  ``--preload ''``
starts every worker as a fresh interpreter, as before.

Supervision: the template reaps its children and sends each exit status to the launcher over a
pipe; ``WarmProcess`` gives the launcher the ``subprocess.Popen`` calls it uses (``pid``,
``poll``, ``wait``).  When the template fails to start (a preload that does not import), the
launcher falls back to fresh interpreters and says so.  Should the template die while workers
run, their exit status is lost: a worker then counts as exited with code 1 once its PID is gone.

``ps`` shows each worker's own command line (``python -u script.py ...``, set with
``setproctitle``).

Limits: Linux/macOS (``fork``); the template holds no threads when it forks (torch's import
starts none; checked on torch 2.13).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from chameleon_ft.cli.coordinator import AgentOps, send_json
from chameleon_ft.runtime import env as E

__all__ = ["DEFAULT_PRELOAD", "preload_modules", "WarmSpawner", "WarmProcess", "WarmStartError"]

# scipy.optimize and networkx: the engine's first decision imports them (0.6 s on 2 cores; the
# workers' helper threads did it after a random delay, and a failure in those first seconds
# met survivors busy importing: DP MTTR 272 ms median against ~110 ms, 2026-12-03).
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "chameleon_ft.runtime.trainer", "scipy.optimize", "networkx")


def preload_modules(spec: str) -> tuple[str, ...]:
    """``--preload``'s value: ``a,b`` (exactly these), ``+a,b`` (the default and these) or ``''``
    (none: fresh interpreters)."""
    spec = spec.strip()
    extra = spec.startswith("+")
    names = tuple(m.strip() for m in spec.lstrip("+").split(",") if m.strip())
    return (DEFAULT_PRELOAD + tuple(m for m in names if m not in DEFAULT_PRELOAD)) if extra else names


def _rerun_import_hooks() -> None:
    """Modules that read the worker's environment when imported do it again from the worker's
    own (they were imported in the template, before it existed): Lightning's rank, and
    ``accelerate_ft``'s capture of the launch environment (it hides torchrun's variables from
    Accelerate; without it a preloaded ``accelerate_ft`` or ``transformers_ft`` left them, and
    Accelerate set up a fixed default process group: ``MASTER_ADDR`` not set)."""
    rz = sys.modules.get("lightning_utilities.core.rank_zero")  # Lightning's rank_zero_only
    if rz is not None:
        rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
                     if os.environ.get(k) is not None), None)
        rz.rank_zero_only.rank = int(rank) if rank is not None else 0
    acc_env = sys.modules.get("accelerate_ft._env")
    if acc_env is not None:
        acc_env.capture()


class WarmStartError(RuntimeError):
    """The template could not start or answer; the caller starts workers the plain way."""


# ------------------------------------------------------------------------ launcher side
class WarmSpawner:
    """The launcher's end: start the template, ask it for workers, collect exit statuses."""

    def __init__(self, modules: Sequence[str], env: Optional[dict] = None, start_timeout: float = 300.0,
                 stderr=None):
        """``stderr``: where the template and its workers write it (default: inherited)."""
        self.modules = tuple(m for m in modules if m)
        self.start_timeout = start_timeout
        req_r, self._req = os.pipe()
        self._resp, resp_w = os.pipe()
        agent_r, self._agent_w = os.pipe()  # the coordinator agent's pipes (``agent()``)
        self._agent_r, agent_w = os.pipe()
        theirs = (req_r, resp_w, agent_r, agent_w)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chameleon_ft.cli.warmstart", *map(str, theirs),
                 ",".join(self.modules)],
                pass_fds=theirs, env=env, stdin=subprocess.DEVNULL, stderr=stderr)
        finally:
            for fd in theirs:
                os.close(fd)
        os.set_blocking(self._resp, False)
        self._buf = b""
        self._ready = False
        self.preload_s = 0.0  # the template's imports, seconds (known after the first spawn)
        self.exits: dict[int, int] = {}

    # -- messages
    def _pump(self, timeout: float = 0.0) -> list[dict]:
        """Messages that arrived (waiting up to ``timeout`` s for the first)."""
        if timeout > 0:
            select.select([self._resp], [], [], timeout)
        msgs = []
        while True:
            try:
                data = os.read(self._resp, 65536)
            except BlockingIOError:
                break
            if not data:  # the template is gone
                break
            self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                self.exits[int(msg["exit"])] = int(msg["rc"])
            else:
                msgs.append(msg)
        return msgs

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _request(self, req: dict, want: str) -> dict:
        try:
            send_json(self._req, req)
        except OSError as exc:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            said = [m["error"] for m in self._pump() if "error" in m]
            raise WarmStartError(said[0] if said else f"the template is gone ({exc})") from None
        # The first answer waits for the template's imports.
        deadline = time.monotonic() + (5.0 if self._ready else self.start_timeout)
        while True:
            for msg in self._pump(0.05):
                if "error" in msg:
                    raise WarmStartError(msg["error"])
                if want in msg:
                    self._ready = True
                    self.preload_s = float(msg.get("preload_s", self.preload_s))
                    return msg
            if not self.alive() and not self._pump():
                raise WarmStartError(f"the template exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise WarmStartError("the template did not answer")

    def agent(self):
        """Fork the coordinator agent (``cli/coordinator.py``) from the template, once, before
        any worker: an ``AgentOps`` that hosts or reaches the coordinator in it."""
        msg = self._request({"agent": True}, "agent_pid")
        ops = AgentOps(self._agent_w, self._agent_r, int(msg["agent_pid"]))
        self._agent_w = self._agent_r = -1  # the AgentOps owns them now
        return ops

    def spawn(self, argv: Sequence[str], env: dict) -> "WarmProcess":
        """Fork a worker running ``python -u argv[0] argv[1:]`` with ``env``; the template sets
        ``CHAMELEON_FT_PRELOAD_S`` in it to the seconds its imports took (a worker's start-up
        as a fresh interpreter would measure it is its age plus those: ``runtime/env.py``)."""
        msg = self._request({"argv": list(argv), "env": env}, "pid")
        return WarmProcess(self, int(msg["pid"]), list(argv))

    def close(self) -> None:
        """End the template (its running workers are not touched)."""
        for fd in (self._req, self._agent_w, self._agent_r):
            if fd < 0:
                continue
            try:
                os.close(fd)  # end of requests: the template exits
            except OSError:
                pass
        self._req = self._agent_w = self._agent_r = -1
        if not self._ready:  # still importing, nothing forked from it: no need to wait
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self._resp)
        except OSError:
            pass


class WarmProcess:
    """A forked worker, seen through the ``subprocess.Popen`` calls the launcher makes."""

    def __init__(self, spawner: WarmSpawner, pid: int, args: list):
        self.spawner, self.pid, self.args = spawner, pid, args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            sp = self.spawner
            if self.pid not in sp.exits:
                sp._pump()
            if self.pid in sp.exits:
                self.returncode = sp.exits.pop(self.pid)
            elif not sp.alive() and not _exists(self.pid):
                sp._pump()
                self.returncode = sp.exits.pop(self.pid, 1)  # status lost with the template
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.spawner._pump(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------ template side
def _serve(req_fd: int, resp_fd: int, agent_fds: list, modules: Sequence[str]) -> Optional[dict]:
    """Import ``modules``, then fork one child per request.  Returns the request in a child,
    None in the template once the launcher closed its end.  ``agent_fds``: the coordinator
    agent's pipe ends (given to the agent's fork, closed here once it is forked)."""
    t0 = time.monotonic()
    try:
        for m in modules:
            importlib.import_module(m)
    except BaseException as exc:  # noqa: BLE001 - any failure means: no warm start
        send_json(resp_fd, {"error": f"--preload: cannot import {m!r}: {type(exc).__name__}: {exc}"})
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    # What the imports built is never freed: out of the collector's sight, so that no
    # collection in a worker walks (and copies, page by page) the template's objects.
    gc.collect()
    gc.freeze()
    preload_s = time.monotonic() - t0
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buf = b""
    try:
        while True:
            ready, _, _ = select.select([req_fd, wake_r], [], [])
            if wake_r in ready:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            _reap(resp_fd)
            if req_fd not in ready:
                continue
            data = os.read(req_fd, 1 << 20)
            if not data:
                return None
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                req["preload_s"] = preload_s
                if req.get("agent") and not agent_fds:
                    send_json(resp_fd, {"error": "the coordinator agent was forked already"})
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for fd in (wake_r, wake_w, req_fd, resp_fd):
                        os.close(fd)
                    if not req.get("agent"):
                        for fd in agent_fds:
                            os.close(fd)
                    req["agent_fds"] = list(agent_fds)
                    return req
                if req.get("agent"):
                    for fd in agent_fds:
                        os.close(fd)
                    agent_fds.clear()
                    send_json(resp_fd, {"agent_pid": pid, "preload_s": preload_s})
                    continue
                send_json(resp_fd, {"pid": pid, "preload_s": preload_s})
    finally:
        if os.getpid() == _TEMPLATE_PID:
            _reap(resp_fd)


def _reap(resp_fd: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            send_json(resp_fd, {"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
        except OSError:  # the launcher is gone
            pass


def _become(req: dict) -> None:
    """In the forked child: turn into ``python -u argv[0] argv[1:]`` and run it."""
    import runpy

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    argv = req["argv"]
    try:  # ps, top and pkill -f show the worker's own command line, not the template's
        import setproctitle

        setproctitle.setproctitle(" ".join([sys.executable, "-u", *argv]))
    except ImportError:  # (before the environment is replaced: it reuses its memory)
        pass
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ[E.PRELOAD_S] = repr(req["preload_s"])
    _rerun_import_hooks()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    if "chameleon_ft.runtime.errors" in sys.modules:  # imported by the template, before this env
        sys.modules["chameleon_ft.runtime.errors"].install_excepthook()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    runpy.run_path(argv[0], run_name="__main__")


_TEMPLATE_PID = os.getpid()

def _agent(req: dict) -> None:
    """In the agent's fork: serve the launcher's coordinator calls until its pipe ends, then
    end the process at once (the coordinator is shut down by then): an interpreter's
    finalization would stop the coordinator's daemon threads inside C++ calls, where a thread
    exit is an abort ("FATAL: exception not rethrown")."""
    from chameleon_ft.cli.coordinator import serve_agent
    from chameleon_ft.runtime.errors import end_process

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 1
    try:
        serve_agent(*req["agent_fds"])
        code = 0
    finally:
        end_process(code)


if __name__ == "__main__":
    _req = _serve(int(sys.argv[1]), int(sys.argv[2]), [int(sys.argv[3]), int(sys.argv[4])],
                  [m for m in sys.argv[5].split(",") if m])
    if _req is not None and _req.get("agent"):
        _agent(_req)
    elif _req is not None:
        _become(_req)
