"""Pure logic behind the loop's shape (issue 11): how a worker's share of a step is cut into the
loop's items (``sampler.step_items``) and how accelerate_ft learns a loop's loss recipe
(``LossReplay``).  The real-process behaviour is in test_accelerate_examples.py."""

from __future__ import annotations

import pytest
import torch

from accelerate_ft.replay import LossReplay
from chameleon_ft.runtime.sampler import MicroBatch, step_items


def _mbs(k: int, size: int = 4, global_batch: int = 32) -> list[MicroBatch]:
    return [MicroBatch(0, j, tuple(range(size * j, size * j + size)), size / global_batch) for j in range(k)]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_items_always_n_and_every_sample_and_slot_once(k, n):
    mbs = _mbs(k)
    items = step_items(mbs, n)
    assert len(items) == n
    assert [i for it in items for i in it.indices] == [i for mb in mbs for i in mb.indices]
    assert sorted(s for it in items for s in it.completes) == [mb.index for mb in mbs]
    assert sum(it.weight for it in items) == pytest.approx(sum(mb.weight for mb in mbs))
    sizes = [len(it.indices) for it in items if not it.ghost]
    assert not sizes or max(sizes) - min(sizes) <= 4  # whole micro-batches, merged evenly
    assert all(len(it.completes) == len(it.parts) for it in items)  # no micro-batch is cut
    assert all(it.ghost == (len(it.indices) == 0) for it in items)
    assert sum(it.ghost for it in items) == max(0, n - k)  # fewer micro-batches than items: ghosts
    assert [it.seed_slot for it in items if not it.ghost] == [it.parts[0].index for it in items if not it.ghost]


def test_items_merge_whole_microbatches_larger_first():
    items = step_items(_mbs(5), 2)
    assert [it.completes for it in items] == [(0, 1, 2), (3, 4)]
    assert items[0].seed_slot == 0 and items[1].seed_slot == 3


class HFLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}


def _learn(model, batch, call, loss_of):
    rp = LossReplay()
    model.register_forward_hook(lambda m, a, kw, out: rp.on_forward(a, kw, out, batch), with_kwargs=True)
    out = call(model, batch)
    rp.on_backward(loss_of(out, batch))
    return rp


BATCH = {"x": torch.randn(4, 3), "labels": torch.tensor([0, 1, 1, 0])}


@pytest.mark.parametrize("call,loss_of,ready", [
    (lambda m, b: m(**b), lambda o, b: o["loss"], True),
    (lambda m, b: m(b["x"], labels=b["labels"]), lambda o, b: o["loss"] / 4, True),
    (lambda m, b: m(b["x"], b["labels"]), lambda o, b: o["loss"] * 2.0, True),
    (lambda m, b: m(**b), lambda o, b: torch.nn.functional.cross_entropy(o["logits"], b["labels"]), False),
    (lambda m, b: m(b["x"] * 2, b["labels"]), lambda o, b: o["loss"], False),  # transformed input
    (lambda m, b: m(**b), lambda o, b: o["loss"] + 0.1 * o["logits"].pow(2).mean(), False),
])
def test_recipe_learnt_only_when_the_loss_is_the_models_own(call, loss_of, ready):
    torch.manual_seed(0)
    model = HFLike()
    rp = _learn(model, BATCH, call, loss_of)
    assert rp.ready is ready
    if ready:
        other = {"x": torch.randn(4, 3), "labels": torch.tensor([1, 1, 0, 0])}
        expected = loss_of(call(model, other), other)
        assert torch.allclose(rp.loss(model, other), expected)
        restored = LossReplay()
        restored.load_state_dict(rp.state_dict())
        assert restored.ready and not restored.seen
        assert torch.allclose(restored.loss(model, other), expected)


def test_spill_before_and_after_the_first_backward():
    rp = LossReplay()
    # The first item teaches it, also when it is the only one (merged, a surplus micro-batch
    # would run with the first one's seed: random layers off the failure-free run).
    assert rp.spill(0, 2) and not rp.spill(1, 2) and rp.spill(0, 1)
    rp.seen = True
    assert not rp.spill(0, 2)
