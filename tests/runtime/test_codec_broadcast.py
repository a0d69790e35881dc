"""``codec.broadcast_tree`` over a real gloo group of 3 processes: small trees travel inline in
the first broadcast, a skeleton or tensors over ``INLINE_BYTES`` in broadcasts of their own;
every member gets the root's tree, tensors bit for bit.  ``send_tree`` / ``recv_tree`` (a
recovery's state, sent only to the members behind) from rank 1 to rank 2 alone: rank 2 gets the
tree bit for bit -- many small tensors joined, large ones in messages of their own, empty ones,
every dtype -- and the bytes sent are the tensors' bytes plus the skeleton, once.  The same trees
held by ranks 1 and 0 and sent together (``share``: each holder its messages) arrive alike, each
holder sending a share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from chameleon_ft.runtime.codec import INLINE_BYTES, encode, _SMALL_BYTES

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


def p2p_trees() -> list:
    g = torch.Generator().manual_seed(11)
    return [
        {"model": {f"w{i}": torch.randn(7, generator=g) for i in range(300)},  # many small ones
         "big": torch.randn(3 * _SMALL_BYTES // 4, generator=g), "empty": torch.zeros(0, 3),
         "step": 5, "betas": (0.9, 0.999)},
        {"h": torch.randn(5, generator=g).to(torch.bfloat16), "b": torch.tensor([True, False]),
         "i": torch.arange(4, dtype=torch.int32), "one": torch.tensor(2.5, dtype=torch.float64)},
        {"k": 1},
    ]


def as_rows(tree_list) -> list:
    """Trees as ``codec.encode``'s skeleton plus the tensors' values, as JSON reads
    them back (the workers write these; the test compares)."""
    out = []
    for tree in tree_list:
        skeleton, tensors = encode(tree)
        out.append({"skeleton": skeleton, "tensors": [[str(t.dtype), t.tolist()] for t in tensors]})
    return json.loads(json.dumps(out))


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
    got = [json.loads(o.read_text()) for o in outs]
    for r in range(3):
        assert got[r]["broadcast"] == as_rows(trees()), r
    # Point to point: only rank 2 received, bit for bit.
    assert got[2]["p2p"] == as_rows(p2p_trees()) and got[0]["p2p"] == [] and got[1]["p2p"] == []
    for tree, sent in zip(p2p_trees(), got[1]["sent"]):
        skeleton, tensors = encode(tree)
        data = sum(t.numel() * t.element_size() for t in tensors)
        assert data <= sent <= data + 8 + len(json.dumps(skeleton)) + 64 * len(tensors) + 64, (sent, data)
    # Shared by two holders: the same trees, and each holder sent messages of the first tree
    # (its two data messages: the 300 small tensors joined, and the large one).
    assert got[2]["shared"] == as_rows(p2p_trees())
    assert got[1]["messages"][0] == 3 and got[0]["messages"][0] == 1, (got[1]["messages"], got[0]["messages"])


def test_a_replicated_part_splits_off_and_merges_back_and_its_digest_is_its_layout():
    from chameleon_ft.runtime.codec import layout_digest, merge_tree, split_tree

    tree = {"model": {"w": torch.ones(3), "running_mean": torch.zeros(3)}, "optimizer": {"state": {0: {}}},
            "step": 4}
    part = {"model": {"w": tree["model"]["w"]}, "optimizer": tree["optimizer"]}
    rest = split_tree(tree, part)
    assert rest == {"model": {"running_mean": tree["model"]["running_mean"]}, "step": 4}
    back = merge_tree(rest, part)
    assert back.keys() == tree.keys() and back["model"].keys() == tree["model"].keys()
    assert back["optimizer"] is tree["optimizer"] and back["model"]["w"] is tree["model"]["w"]
    assert layout_digest(part) == layout_digest({"model": {"w": torch.zeros(3)}, "optimizer": {"state": {0: {}}}})
    assert layout_digest(part) != layout_digest({"model": {"w": torch.zeros(4)}, "optimizer": {"state": {0: {}}}})
    assert layout_digest(part) != layout_digest({"model": {"w": torch.zeros(3, dtype=torch.float64)},
                                                 "optimizer": {"state": {0: {}}}})
