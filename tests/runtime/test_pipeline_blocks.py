"""How a pipeline job's blocks are given and made (blocks.py), and which workers reduce each
block's gradient together (reduce.py).  Pure logic; the live checks are in
test_pipeline_recovery.py (a meta-device model and per-block factories, killed workers)."""

from __future__ import annotations

import functools

import pytest
import torch

from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.executors.pipeline.blocks import Blocks, block_seed
from chameleon_ft.runtime.executors.pipeline.reduce import CommitPosts, holder_sets

TWO_BY_FOUR = Plan((Pipeline((0, 1, 2, 3), (0, 2, 4, 6, 8), 4), Pipeline((4, 5, 6, 7), (0, 2, 4, 6, 8), 4)))


def block(i: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Dropout(0.1))


def test_holder_sets_pair_same_stage_replicas():
    sets = holder_sets(TWO_BY_FOUR, range(8), 8)
    assert sets == [((0, 4), (0, 1)), ((1, 5), (2, 3)), ((2, 6), (4, 5)), ((3, 7), (6, 7))]


def test_holder_sets_under_reroute_and_uneven_replan():
    # Worker 5 dead, kept in the plan (rerouted): its blocks' only alive holder is worker 1.
    assert holder_sets(TWO_BY_FOUR, set(range(8)) - {5}, 8)[1] == ((1,), (2, 3))
    # A re-plan with different splits: PP3 + PP4, blocks grouped by identical holders.
    plan = Plan((Pipeline((0, 1, 2), (0, 3, 6, 8), 4), Pipeline((4, 6, 7, 3), (0, 2, 4, 6, 8), 4)))
    assert holder_sets(plan, [0, 1, 2, 3, 4, 6, 7], 8) == [
        ((0, 4), (0, 1)), ((0, 6), (2,)), ((1, 6), (3,)), ((1, 7), (4, 5)), ((2, 3), (6, 7))]


class _Gm:
    """Pure logic of the commit's early receives: point-to-point ops recorded, waits no-ops,
    each 'received' buffer filled with its sender's rank (the real exchange: the pipeline tests)."""

    def __init__(self, rank: int, world: int):
        self.view = type("V", (), {"rank": rank, "world_size": world})()
        self.recvs, self.sends = [], []

    def recv(self, t, src, tag):
        self.recvs.append((src, tag))
        t.fill_(float(src))
        return object()

    def send(self, t, dst, tag):
        self.sends.append((dst, tag))
        return object()

    def wait_p2p(self, works, timeout_s):
        pass


def test_commit_receives_are_posted_once_the_size_is_known_and_only_for_their_generation():
    gm, posts = _Gm(0, 3), CommitPosts()
    posts.post(gm, "g1", torch.float64)
    assert gm.recvs == []  # the generation's commit size is not known yet
    buf = torch.zeros(4, dtype=torch.float64)
    posts.reduce(gm, "g1", buf, 1.0)
    assert len(gm.recvs) == 2 and buf.tolist() == [3.0] * 4  # posted at the commit: 0 + 1 + 2
    posts.post(gm, "g1", torch.float64)
    posts.post(gm, "g1", torch.float64)  # a redone step keeps its posts
    assert len(gm.recvs) == 4
    buf = torch.zeros(4, dtype=torch.float64)
    posts.reduce(gm, "g1", buf, 1.0)
    assert len(gm.recvs) == 4 and buf.tolist() == [3.0] * 4  # the early receives were used
    posts.post(gm, "g1", torch.float64)  # the next step's
    posts.reduce(gm, "g2", torch.zeros(5, dtype=torch.float64), 1.0)  # a new generation: not used
    assert len(gm.recvs) == 8
    other = _Gm(1, 3)  # not rank 0: nothing to post
    posts2 = CommitPosts()
    posts2.reduce(other, "g1", torch.zeros(4, dtype=torch.float64), 1.0)
    posts2.post(other, "g1", torch.float64)
    assert other.recvs == [(0, (1 << 29) + 1)]


def test_factories_build_only_on_make_and_alike_everywhere():
    bs = Blocks([functools.partial(block, i) for i in range(4)], seed=3, device="cpu")
    assert bs.lazy and bs.materialised() == [] and bs.made == []
    assert all(p.is_meta for p in bs.model.parameters())
    m = bs.make(2)
    assert bs.materialised() == [2] and bs.modules[2] is m and bs.model[2] is m
    torch.manual_seed(block_seed(3, 2))
    expected = block(2)
    for x, y in zip(m.state_dict().values(), expected.state_dict().values()):
        assert torch.equal(x, y)
    # The same block made by another holder (another process in a job) is bitwise equal,
    # whatever the global RNG did meanwhile; making a block leaves the global RNG alone.
    torch.manual_seed(99)
    state = torch.get_rng_state()
    other = Blocks([functools.partial(block, i) for i in range(4)], seed=3, device="cpu").make(2)
    assert torch.equal(torch.get_rng_state(), state)
    for x, y in zip(m.state_dict().values(), other.state_dict().values()):
        assert torch.equal(x, y)
    bs.release(2)
    assert bs.materialised() == []


def test_meta_model_is_initialised_like_the_factories():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[block(i) for i in range(4)])
    bs = Blocks(model, seed=3, device="cpu")
    assert bs.lazy and bs.materialised() == []
    m = bs.make(1)
    ref = Blocks([functools.partial(block, i) for i in range(4)], seed=3, device="cpu").make(1)
    for x, y in zip(m.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(x, y)


def test_built_model_is_not_lazy_and_keeps_its_device():
    bs = Blocks(torch.nn.Sequential(*[block(i) for i in range(3)]))
    assert not bs.lazy and bs.device == torch.device("cpu") and bs.materialised() == [0, 1, 2]


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w


def test_bad_block_forms_are_refused_clearly():
    with pytest.raises(ConfigError, match="reset_parameters"):
        with torch.device("meta"):
            model = torch.nn.Sequential(_Scale(), torch.nn.Linear(4, 4))
        Blocks(model)
    with torch.device("meta"):
        half = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="some blocks are on the meta device"):
        Blocks([half, torch.nn.Linear(4, 4)])
    with pytest.raises(ConfigError, match="did not return an nn.Module"):
        Blocks([lambda: 3])
    with pytest.raises(ConfigError, match="ordered list of blocks"):
        Blocks([])
    with pytest.raises(ConfigError, match="nn.Sequential, a list of modules"):
        Blocks([torch.nn.Linear(4, 4), 3])


def test_checkpoint_block_files_are_plain_and_checked(tmp_path):
    from chameleon_ft.runtime import codec
    from chameleon_ft.runtime.errors import CheckpointError
    from chameleon_ft.runtime.executors.pipeline import checkpoint as ckpt

    blocks = [block(i) for i in range(2)]
    folder = ckpt.blocks_dir(str(tmp_path / "c.pt"), 6)
    opt = torch.optim.AdamW(blocks[0].parameters())
    blocks[0](torch.randn(2, 8)).sum().backward()
    opt.step()
    digests = [ckpt.write_block(folder, b, {"params": m.state_dict(), "optim": (opt.state_dict() if b == 0 else {}),
                                            "sched": None}) for b, m in enumerate(blocks)]
    # A plain torch file: torch.load(weights_only=True), no chameleon-ft needed.
    plain = torch.load(f"{folder}/0.pt", weights_only=True)
    assert torch.equal(plain["params"]["0.weight"], blocks[0][0].weight)
    assert ckpt.read_block(folder, 0, digests[0])["optim"]["state"]
    codec.save_checkpoint(tmp_path / "c.pt", {"step": 6, "blocks": digests})
    whole = ckpt.model_state_dict(str(tmp_path / "c.pt"))
    model = torch.nn.Sequential(*[block(i) for i in range(2)])
    model.load_state_dict(whole)  # the keys of an nn.Sequential of the blocks
    assert torch.equal(model[1][0].weight, blocks[1][0].weight)
    with pytest.raises(CheckpointError, match="2 blocks, the model has 3"):
        ckpt.read_run(str(tmp_path / "c.pt"), 3)
    raw = bytearray(open(f"{folder}/1.pt", "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(f"{folder}/1.pt", "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match its digest"):
        ckpt.read_block(folder, 1, digests[1])
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.read_block(folder, 5, None)
    codec.save_checkpoint(tmp_path / "dp.pt", {"step": 3})
    with pytest.raises(CheckpointError, match="not a pipeline checkpoint"):
        ckpt.read_run(str(tmp_path / "dp.pt"))
