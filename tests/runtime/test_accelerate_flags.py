"""``chameleon-ft run`` takes ``accelerate launch``'s own flags and config file (issue 26): a
user swaps only the command name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from chameleon_ft.cli.launch_flags import LaunchError, apply_accelerate_flags, build_parser


def parse(argv, monkeypatch, tmp_path, config: str | None = None):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no default config unless written below
    if config is not None:
        d = tmp_path / "hf" / "accelerate"
        d.mkdir(parents=True)
        (d / "default_config.yaml").write_text(config)
    args = build_parser().parse_args([*argv, "train.py", "--lr", "1"])
    env = apply_accelerate_flags(args, argv)
    return args, env


def test_accelerate_launch_flags_become_ours(monkeypatch, tmp_path):
    args, env = parse(["--num_processes", "8", "--num_machines", "2", "--machine_rank", "1",
                       "--main_process_ip", "10.0.0.1", "--main_process_port", "29400", "--mixed_precision", "bf16"],
                      monkeypatch, tmp_path)
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint) == (4, "2", 1, "10.0.0.1:29400")
    assert env == {"ACCELERATE_MIXED_PRECISION": "bf16"} and args.script_args == ["--lr", "1"]
    args, env = parse(["--num-processes", "4", "--cpu"], monkeypatch, tmp_path)
    assert (args.nproc_per_node, args.nnodes, args.rdzv_endpoint) == (4, "1", None) and env == {"ACCELERATE_USE_CPU": "true"}


def test_the_default_config_is_read_and_flags_win(monkeypatch, tmp_path):
    cfg = "num_processes: 6\nnum_machines: 1\nuse_cpu: true\nmain_process_port: 29555\n"
    args, env = parse([], monkeypatch, tmp_path, config=cfg)
    assert args.nproc_per_node == 6 and args.rdzv_endpoint == "127.0.0.1:29555" and env["ACCELERATE_USE_CPU"] == "true"
    args, _ = parse(["--num_processes", "2"], monkeypatch, tmp_path / "x", config=cfg)
    assert args.nproc_per_node == 2
    args, _ = parse(["--nproc-per-node", "3", "--num_processes", "2"], monkeypatch, tmp_path / "y", config=cfg)
    assert args.nproc_per_node == 3  # ours win


def test_bad_accelerate_input_is_refused(monkeypatch, tmp_path):
    with pytest.raises(LaunchError, match="not a multiple"):
        parse(["--num_processes", "5", "--num_machines", "2", "--main_process_ip", "h"], monkeypatch, tmp_path)
    with pytest.raises(LaunchError, match="no such file"):
        parse(["--config_file", str(tmp_path / "none.yaml")], monkeypatch, tmp_path)
    with pytest.raises(LaunchError, match="needs --main_process_ip"):
        parse(["--num_processes", "4", "--num_machines", "2", "--main_process_port", "1"], monkeypatch, tmp_path)


def test_a_real_job_started_with_accelerate_flags(tmp_path):
    import subprocess

    worker = str(Path(__file__).with_name("_workers") / "mlp_worker.py")
    r = subprocess.run([sys.executable, "-m", "chameleon_ft.cli.launch", "--num_processes", "2", "--cpu",
                        "--run-dir", str(tmp_path), worker, "--out", str(tmp_path), "--epochs", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.glob("final_*.pt")) == ["final_0.pt", "final_1.pt"]
