"""``codec.broadcast_tree`` over a real gloo group of 3 processes: small trees travel inline in
the first broadcast, a skeleton or tensors over ``INLINE_BYTES`` in broadcasts of their own;
every member gets the root's tree, tensors bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from chameleon_ft.runtime.codec import INLINE_BYTES, encode

WORKER = Path(__file__).parent / "_workers" / "codec_worker.py"


def trees() -> list:
    g = torch.Generator().manual_seed(7)
    return [
        {"a": 1, "t": (1.5, -0.0), "none": None},  # skeleton only, inline
        {"x": torch.arange(10, dtype=torch.float64), "i": torch.tensor([3], dtype=torch.int64)},  # both inline
        {"big": "y" * (2 * INLINE_BYTES), "t": torch.ones(3)},  # skeleton too big: its own broadcast
        {"w": torch.randn(INLINE_BYTES, generator=g), "k": 2},  # tensors too big: their own broadcast
        {},
    ]


def test_every_member_gets_the_roots_tree_inline_or_not(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"  # no port to race for with other jobs
    outs = [tmp_path / f"{r}.json" for r in range(3)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "3", init, str(Path(__file__).parent), str(outs[r])],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(3)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), logs
    want = []
    for tree in trees():
        skeleton, tensors = encode(tree)
        want.append({"skeleton": skeleton, "tensors": [[str(t.dtype), t.tolist()] for t in tensors]})
    want = json.loads(json.dumps(want))  # as the workers' JSON reads back
    for r in range(3):
        assert json.loads(outs[r].read_text()) == want, r
