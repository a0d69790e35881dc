"""``chameleon-ft run``'s flags (torchrun's, and ours) and the checks on their values that need
no running job; ``cli/launch.py`` does the rest."""

from __future__ import annotations

import argparse
import os
from typing import Optional

from chameleon_ft.cli.warmstart import DEFAULT_PRELOAD

__all__ = ["LaunchError", "build_parser", "parse_endpoint", "parse_nnodes", "apply_accelerate_flags"]


class LaunchError(RuntimeError):
    """Bad input or an unusable environment, found before any worker started."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chameleon-ft run", allow_abbrev=False,
        description="Start elastic data-parallel workers that keep training in place when a "
                    "peer dies, hangs or slows down.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="workers on this node (default 1)")
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                   help="host:port of the coordinator (node 0 binds it; default: loopback, "
                        "random port, single node)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", choices=("c10d", "etcd"), default="c10d",
                   help="c10d (default): node 0's launcher hosts the coordinator (a single point of "
                        "failure); etcd: membership, generations and group set-up in an etcd cluster, "
                        "--rdzv-endpoint host:2379[,host:2379...] (no node is special)")
    p.add_argument("--rdzv-id", "--rdzv_id", default="default",
                   help="the job's name in etcd (its key space): one per job (default 'default')")
    p.add_argument("--etcd-cacert", default=None, metavar="FILE",
                   help="etcd backend over TLS: the CA that signed the etcd members' certificates "
                        "(etcdctl's --cacert); user and password for etcd's authentication from "
                        "$CHAMELEON_FT_ETCD_USER / $CHAMELEON_FT_ETCD_PASSWORD (docs/security.md)")
    p.add_argument("--etcd-cert", default=None, metavar="FILE",
                   help="the client certificate for etcd's --client-cert-auth (without a Common Name: "
                        "etcd's JSON gateway refuses one that has it)")
    p.add_argument("--etcd-key", default=None, metavar="FILE", help="the client certificate's private key")
    p.add_argument("--job-token", default=None, metavar="TOKEN",
                   help="a secret every node of the job shares (default: $CHAMELEON_FT_JOB_TOKEN; a "
                        "one-node job makes one up): a launcher or worker with another token is refused "
                        "by the coordinator or etcd, and never sees the job's keys (docs/security.md)")
    p.add_argument("--quorum-wait", type=float, default=60.0,
                   help="etcd backend: how long the job stays paused while etcd has no quorum "
                        "(nothing is committed), before its workers stop (seconds, default 60)")
    p.add_argument("--rdzv-timeout", type=float, default=30.0,
                   help="seconds to reach the coordinator from nodes > 0 (default 30)")
    p.add_argument("--join-timeout-ms", type=int, default=50,
                   help="how long the membership quorum waits for survivors after the first one "
                        "asks (node 0 only; default 50): agreement after a failure costs about this")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="when the engine chooses checkpoint-restart (workers exit 75), relaunch every "
                        "worker up to this many times; the script resumes from its checkpoint "
                        "(single node only; default 0: exit 75 and leave it to the caller)")
    p.add_argument("--max-replacements", type=int, default=0,
                   help="replacement workers this launcher may start (default 0)")
    p.add_argument("--preempt-signal", default="", metavar="SIG[,SIG]",
                   help="more signals that announce a preemption, as SIGTERM does (e.g. USR1 for "
                        "SLURM's --signal=USR1@90): forwarded to the workers, which leave at a step "
                        "boundary")
    p.add_argument("--requeue", action="store_true",
                   help="SLURM: when every worker of node 0 left on a preemption notice (the whole job "
                        "was preempted or reached --signal's time), node 0's launcher runs `scontrol "
                        "requeue $SLURM_JOB_ID`; the requeued job resumes from the script's checkpoint "
                        "(ElasticTrainer writes it at the step the job left)")
    p.add_argument("--term-grace", type=float, default=30.0,
                   help="after a SIGTERM (a preemption notice: spot, Kubernetes, SLURM), how long the "
                        "workers get to leave at a step boundary before they are killed (seconds, "
                        "default 30, as SLURM's KillWait and Kubernetes' grace period)")
    p.add_argument("--hang-timeout", type=float, default=10.0,
                   help="watchdog on every collective, seconds (default 10)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0,
                   help="a worker whose heartbeat stopped this long is lost (a dead node, a "
                        "partition, a stopped process): its peers' collectives end then, not at "
                        "--hang-timeout (seconds, default 1; 0: off)")
    p.add_argument("--coordinator-judges", action="store_true",
                   help="the embedded coordinator judges the workers' liveness from beats on their "
                        "presence connections (no liveness request to the store; experimental, "
                        "off by default)")
    p.add_argument("--cut-off", type=float, default=3.0,
                   help="a worker that gets no answer from the coordinator this long stops with "
                        "exit 3: the wrong side of a partition never trains on alone (seconds, "
                        "default 3; 0: off)")
    p.add_argument("--run-dir", default=None, help="event log directory (default: a new temp dir)")
    p.add_argument("--faults", default="", help="fault-injection spec (see runtime/faults.py)")
    p.add_argument("--on-worker-error", choices=("stop", "continue"), default="stop",
                   help="an exception raised by the script in a worker: stop the job on every node "
                        "and exit 70, its traceback printed once (default; a bug is not a failure to "
                        "survive), or continue: treat the worker as lost, the survivors carry on")
    p.add_argument("--mttf", type=float, default=None, metavar="SECONDS",
                   help="expected time to the next failure (D) the engine scores its choices "
                        "over (default: estimated from a per-device failure rate and this run)")
    p.add_argument("--preload", default=",".join(DEFAULT_PRELOAD), metavar="MODULES",
                   help="modules a template interpreter imports once; every worker and "
                        "replacement is a fork of it, which saves each its start-up imports "
                        f"(default {','.join(DEFAULT_PRELOAD)}; '+a,b' adds a and b to it, e.g. "
                        "'+lightning,lightning_ft' for Lightning scripts; '' starts each worker "
                        "as a fresh interpreter; see cli/warmstart.py for what a module may not "
                        "do at import)")
    acc = p.add_argument_group(
        "accelerate launch's flags (swap `accelerate launch` for `chameleon-ft run`, keep the rest; "
        "without --config_file the default Accelerate config is read when it exists)")
    acc.add_argument("--num_processes", "--num-processes", type=int, default=None,
                     help="processes of the whole job (per node: this / --num_machines)")
    acc.add_argument("--num_machines", "--num-machines", type=int, default=None)
    acc.add_argument("--machine_rank", "--machine-rank", type=int, default=None)
    acc.add_argument("--main_process_ip", "--main-process-ip", default=None)
    acc.add_argument("--main_process_port", "--main-process-port", type=int, default=None)
    acc.add_argument("--config_file", "--config-file", default=None)
    acc.add_argument("--multi_gpu", "--multi-gpu", action="store_true", help="accepted (the script decides its device)")
    acc.add_argument("--cpu", action="store_true", help="sets ACCELERATE_USE_CPU for the workers")
    acc.add_argument("--mixed_precision", "--mixed-precision", default=None,
                     help="sets ACCELERATE_MIXED_PRECISION for the workers")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``; an empty host is loopback) or a clear error."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise LaunchError(f"--rdzv-endpoint {text!r}: expected host:port (e.g. 127.0.0.1:29500)")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_nnodes(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= lo_n <= hi_n:
        raise LaunchError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo_n, hi_n


def default_accelerate_config() -> Optional[str]:
    """Accelerate's default config file (``accelerate config`` writes it), when it exists."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface")
    path = os.path.join(os.environ.get("ACCELERATE_CONFIG_HOME", os.path.join(home, "accelerate")),
                        "default_config.yaml")
    return path if os.path.isfile(path) else None


def apply_accelerate_flags(args: argparse.Namespace, argv: list[str]) -> dict:
    """Turn ``accelerate launch``'s flags (and its config file's keys) into ours; flags given on
    the command line win over the config file, ours (``--nproc-per-node`` ...) over both.
    Returns the environment the workers get for Accelerate (``ACCELERATE_USE_CPU``, ...)."""
    import yaml

    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    path = args.config_file or default_accelerate_config()
    cfg: dict = {}
    if args.config_file and not os.path.isfile(args.config_file):
        raise LaunchError(f"--config_file {args.config_file!r}: no such file")
    if path:
        try:
            with open(path) as f:
                cfg = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise LaunchError(f"--config_file {path!r}: not a readable Accelerate config: {exc}") from None
        if not isinstance(cfg, dict):
            raise LaunchError(f"--config_file {path!r}: not a readable Accelerate config")

    def pick(name: str):
        v = getattr(args, name)
        return v if v not in (None, False) else cfg.get(name)

    procs, machines = pick("num_processes"), pick("num_machines") or 1
    ip, port, rank = pick("main_process_ip"), pick("main_process_port"), pick("machine_rank")
    if procs is not None and not given & {"--nproc-per-node", "--nproc_per_node"}:
        if int(procs) % int(machines):
            raise LaunchError(f"--num_processes {procs} is not a multiple of --num_machines {machines}")
        args.nproc_per_node = int(procs) // int(machines)
    if not given & {"--nnodes"} and machines:
        args.nnodes = str(int(machines))
    if rank is not None and not given & {"--node-rank", "--node_rank"}:
        args.node_rank = int(rank)
    if (ip or port) and not args.rdzv_endpoint:
        if int(machines) > 1 and not ip:
            raise LaunchError("--num_machines > 1 needs --main_process_ip (node 0's address)")
        args.rdzv_endpoint = f"{ip or '127.0.0.1'}:{port or 29500}"
    env = {}
    if pick("cpu") or cfg.get("use_cpu"):
        env["ACCELERATE_USE_CPU"] = "true"
    if pick("mixed_precision") and pick("mixed_precision") != "no":
        env["ACCELERATE_MIXED_PRECISION"] = str(pick("mixed_precision"))
    return env
