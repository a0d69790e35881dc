"""The bytes a carried-out migration reports to the calibration are what it sent: weights
alone before the optimizer has state (the start-up migration), weights + state after."""

import types

import torch

from chameleon_ft.runtime.pipeline.context import PipelineContext


def _ctx(stateful: bool) -> PipelineContext:
    ctx = object.__new__(PipelineContext)
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


def test_round_bytes_count_the_optimizer_state_only_once_it_exists():
    rounds = [[[0, 1, 0, 2], [2, 3, 2, 3]], [[1, 0, 3, 4]]]  # (src, dst, lo, hi)
    # round 1: max(blocks 0-1 = 30, block 2 = 30) elements; round 2: block 3 = 40 elements
    assert _ctx(stateful=False)._round_bytes(rounds) == (30 + 40) * 4
    assert _ctx(stateful=True)._round_bytes(rounds) == (30 + 40) * (4 + 8)
