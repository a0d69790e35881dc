"""The bytes a carried-out migration reports to the calibration are what it sent: weights
alone before the optimizer has state (the start-up migration), weights + state after; its
critical path and seconds follow each transfer's measured seconds (``migration.confirm``)."""

import types

import torch

from chameleon_ft.runtime.executors.pipeline.executor import PipelineExecutor


def _ctx(stateful: bool) -> PipelineExecutor:
    ctx = object.__new__(PipelineExecutor)
    ctx.block_numel = [10, 20, 30, 40]
    ctx.policy = types.SimpleNamespace(weight_bytes=4, optim_bytes=8)
    opts = {}
    for b in range(4):
        p = torch.nn.Parameter(torch.zeros(ctx.block_numel[b]))
        opts[b] = torch.optim.Adam([p])
        if stateful:
            p.grad = torch.ones_like(p)
            opts[b].step()
    ctx.block_opt, ctx.held = opts, {0, 1, 2, 3}
    return ctx


def test_path_bytes_count_the_optimizer_state_only_once_it_exists():
    timed = [[[0, 1, 0, 2, 3.0], [2, 3, 2, 3, 1.0]], [[1, 0, 3, 4, 4.0]]]  # (src, dst, lo, hi, seconds)
    # 0->1 (blocks 0-1: 30 elements) then 1->0 (block 3: 40): the path; 2->3 runs beside it
    assert _ctx(stateful=False)._timed_path(timed) == (2, (30 + 40) * 4, 7.0)
    assert _ctx(stateful=True)._timed_path(timed) == (2, (30 + 40) * (4 + 8), 7.0)


def test_path_follows_the_chain_not_the_rounds():
    # Round 2's 2->3 does not wait for round 1's 0->1: the critical path is 0->1, then 1->0
    # (one chain through workers 0 and 1), not the sum of each round's longest transfer.
    timed = [[[0, 1, 0, 1, 4.0], [2, 3, 3, 4, 5.0]], [[1, 0, 1, 2, 3.0], [3, 2, 2, 3, 1.0]]]
    assert _ctx(stateful=False)._timed_path(timed) == (2, (10 + 20) * 4, 7.0)
    # The measured seconds choose the path, not the bytes: 2->3 then 3->2 when they took longer.
    timed[1][1][4] = 2.5
    assert _ctx(stateful=False)._timed_path(timed) == (2, (40 + 30) * 4, 7.5)
