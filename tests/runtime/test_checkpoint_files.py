"""Torn and damaged checkpoints (``runtime/codec.py``): a write interrupted by a kill never
leaves a file that loads as valid -- written to a temporary file, flushed to the disk, renamed
-- and a damaged one (cut short, a flipped byte: its CRC-32 no longer matches) is refused
saying why, the previous one read instead."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from chameleon_ft.runtime.codec import load_checkpoint, previous_of, save_checkpoint
from chameleon_ft.runtime.errors import CheckpointError

pytestmark = [pytest.mark.timeout(120)]


def _tree(v: float, n: int = 1000) -> dict:
    return {"step": int(v), "w": torch.full((n,), v), "note": f"tree {v}"}


def _flip_a_byte(path: str, at: float = 0.6) -> None:
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        where = int(f.tell() * at)
        f.seek(where)
        b = f.read(1)
        f.seek(where)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_read(tmp_path, caplog):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, _tree(1.0))
    save_checkpoint(path, _tree(2.0))
    assert load_checkpoint(path)["step"] == 2 and load_checkpoint(previous_of(path))["step"] == 1
    _flip_a_byte(path)
    with pytest.raises(CheckpointError, match="ckpt.pt is (damaged|corrupt)"):
        load_checkpoint(path, fallback=False)
    with caplog.at_level(logging.WARNING):
        got = load_checkpoint(path)
    assert got["step"] == 1 and torch.equal(got["w"], torch.full((1000,), 1.0))
    assert "reading the previous checkpoint" in caplog.text and "ckpt.pt.prev" in caplog.text
    with open(previous_of(path), "r+b") as f:  # cut short
        f.truncate(os.path.getsize(previous_of(path)) // 2)
    with pytest.raises(CheckpointError, match="the previous one is damaged too"):
        load_checkpoint(path)


def test_a_flipped_byte_in_the_tensors_fails_the_checksum(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, _tree(3.0, n=200_000))  # most of the file is the tensor's bytes
    _flip_a_byte(path, at=0.5)
    with pytest.raises(CheckpointError, match="damaged|corrupt"):
        load_checkpoint(path, fallback=False)


_WRITER = """
import sys, torch
from chameleon_ft.runtime.codec import save_checkpoint
path = sys.argv[1]
save_checkpoint(path, {"step": 1, "w": torch.ones(10)})
print("first", flush=True)
big = torch.randn(60_000_000)  # 240 MB: each write takes a while
for i in range(2, 100):
    save_checkpoint(path, {"step": i, "w": big})
"""


def test_a_kill_during_a_checkpoint_write_leaves_a_whole_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    p = subprocess.Popen([sys.executable, "-c", _WRITER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "first"
        tmp = f"{path}.tmp.{p.pid}"
        deadline = time.monotonic() + 60
        while not (os.path.exists(tmp) and os.path.getsize(tmp) > 50_000_000):  # mid-write
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    tree = load_checkpoint(path, fallback=False)  # whole: the first, or a later write completed
    assert tree["step"] >= 1
    assert os.path.exists(tmp)  # the torn write stayed where nothing reads it


def test_a_writer_killed_inside_the_final_save_does_not_end_the_job_without_it(tmp_path):
    """``ElasticTrainer`` (4 gloo workers): rank 0, the checkpoint's only writer, is killed by
    the fault injector inside the run's last save -- its data in the temporary file, not yet
    renamed (phase ``save``) -- while its peers have finished training.  Without a confirmation
    they would exit 0 and the job would end without its final checkpoint; they meet after the
    write, find the writer gone, recover and the new rank 0 writes it: the job exits 0 with a
    checkpoint that loads, at the last step, and the victim's torn write left aside."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_workers"))
    from elastic_job import STEPS_PER_EPOCH, Job

    ckpt, last = tmp_path / "ckpt.pt", 2 * STEPS_PER_EPOCH
    job = Job(tmp_path / "run", epochs=2, mb_sleep=0.01, worker_args=("--checkpoint", str(ckpt)),
              launch_args=("--faults", f"kill:rank=0:step={last}:phase=save"))
    try:
        job.start()
        assert job.wait(120) == [0], job.output()[-3000:]
        evs, finals = job.events(), job.final()
    finally:
        job.cleanup()
    assert sorted(finals) == [1, 2, 3]
    assert any(e["event"] == "failure" and e["workers"] == [0] for e in evs)
    assert any(e["event"] == "membership" and e["members"] == [1, 2, 3] for e in evs)
    assert load_checkpoint(ckpt, fallback=False)["step"] == last
    assert list(tmp_path.glob("ckpt.pt.tmp.*")), "the kill did not land inside the write"
