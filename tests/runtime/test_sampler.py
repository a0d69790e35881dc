"""ElasticSampler: exactly-once data and membership-independent global batches."""

import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, Dataset

from chameleon_ft.runtime.sampler import (
    ElasticBatchSampler,
    ElasticSampler,
    MicroBatch,
    equal_allocation,
)


class IndexDataset(Dataset):
    """Returns its own index, so a batch tells which samples were loaded."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def failure_free_batches(n, mb, m, seed, drop_last, epoch=0):
    s = ElasticSampler(n, mb * m, mb, seed=seed, drop_last=drop_last, members=[0], epoch=epoch)
    return [set(s.global_batch_indices(t)) for t in range(s.steps_per_epoch)]


# -- basic shape -------------------------------------------------------------------------


def test_order_is_seeded_permutation_and_differs_by_epoch():
    a = ElasticSampler(100, 10, 2, seed=7)
    b = ElasticSampler(100, 10, 2, seed=7)
    assert a.order() == b.order()
    assert sorted(a.order()) == list(range(100))
    first = list(a.order())
    a.set_epoch(1)
    assert a.order() != first
    assert sorted(a.order()) == list(range(100))
    assert ElasticSampler(100, 10, 2, seed=8).order() != first


def test_no_shuffle_is_identity():
    s = ElasticSampler(10, 4, 2, shuffle=False, members=[0, 1])
    assert s.order() == list(range(10))
    assert s.step_plan(0) == {
        0: [MicroBatch(0, 0, (0, 1), 0.5)],
        1: [MicroBatch(0, 1, (2, 3), 0.5)],
    }


def test_equal_allocation_gives_extra_to_earlier_members():
    assert equal_allocation(3, 8) == [3, 3, 2]
    assert equal_allocation(4, 2) == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="empty"):
        equal_allocation(0, 4)


def test_steps_per_epoch_and_partial_last_batch():
    s = ElasticSampler(10, 4, 1, shuffle=False, members=[0, 1])
    assert s.steps_per_epoch == 3
    last = s.step_plan(2)
    # 2 samples over 4 slots: slots 0 and 1 get one each, 2 and 3 are empty and left out.
    assert last == {0: [MicroBatch(2, 0, (8,), 0.5), MicroBatch(2, 1, (9,), 0.5)], 1: []}
    d = ElasticSampler(10, 4, 1, shuffle=False, drop_last=True, members=[0])
    assert d.steps_per_epoch == 2
    assert d.epoch_samples() == 8
    with pytest.raises(ValueError, match="out of range"):
        d.step_plan(2)


def test_partial_last_batch_is_split_fairly_across_slots():
    s = ElasticSampler(22, 8, 2, shuffle=False, members=[0, 1])  # last batch: 6 samples, 4 slots
    plan = s.step_plan(2)
    sizes = [mb.n_samples for m in (0, 1) for mb in plan[m]]
    assert sizes == [2, 2, 1, 1]
    assert [mb.n_samples for mb in plan[0]] == [2, 2]
    assert sum(mb.weight for m in plan for mb in plan[m]) == pytest.approx(1.0)
    assert plan[0][0].weight == pytest.approx(2 / 6)


def test_explicit_allocation_sequence_and_mapping():
    s = ElasticSampler(64, 16, 2, shuffle=False)
    s.set_allocation([3, 0, 5], [5, 1, 2])
    plan = s.step_plan(0)
    assert list(plan) == [3, 0, 5]
    assert [mb.index for mb in plan[3]] == [0, 1, 2, 3, 4]
    assert [mb.index for mb in plan[0]] == [5]
    assert [mb.index for mb in plan[5]] == [6, 7]
    s.set_allocation([3, 0, 5], {3: 8})  # missing members get 0
    assert [len(v) for v in s.step_plan(0).values()] == [8, 0, 0]
    assert s.local_microbatches(3) == s.step_plan()[3]


@pytest.mark.parametrize(
    "members, counts, match",
    [
        ([0, 1], [3, 3], "sums to 6 micro-batches, but a step has 4"),
        ([0, 1], [4], "2 members"),
        ([0, 1], [5, -1], ">= 0"),
        ([], None, "empty"),
        ([0, 0], None, "duplicate"),
        ([0, -1], None, ">= 0"),
        ([0, 1], {0: 2, 7: 2}, "non-members"),
        ([0, True], None, "integer"),
    ],
)
def test_bad_allocation_is_rejected_clearly(members, counts, match):
    s = ElasticSampler(32, 8, 2, members=[0])
    with pytest.raises(ValueError, match=match):
        s.set_allocation(members, counts)
    assert s.members == (0,)  # unchanged


def test_unknown_member_and_missing_allocation():
    s = ElasticSampler(32, 8, 2)
    with pytest.raises(ValueError, match="set_allocation"):
        s.step_plan()
    s.set_allocation([0, 2])
    with pytest.raises(ValueError, match="unknown member 1"):
        s.local_microbatches(1)
    with pytest.raises(ValueError, match="unknown member 1"):
        list(ElasticBatchSampler(s, 1))


@pytest.mark.parametrize("kwargs", [dict(global_batch=10, micro_batch=4), dict(global_batch=0, micro_batch=1)])
def test_bad_batch_sizes(kwargs):
    with pytest.raises(ValueError):
        ElasticSampler(10, **kwargs)


def test_commit_moves_cursor_in_order_only():
    s = ElasticSampler(10, 4, 2, members=[0])
    assert s.remaining_samples() == 10
    with pytest.raises(ValueError, match="cursor step 0"):
        s.commit(1)
    s.commit(0)
    s.commit()
    assert s.cursor == 2 and s.remaining_samples() == 2
    s.commit(2)
    assert s.epoch_done and s.remaining_samples() == 0
    with pytest.raises(ValueError, match="complete"):
        s.commit()


def test_set_epoch_resets_cursor_only_on_change():
    s = ElasticSampler(10, 4, 2, members=[0])
    s.commit()
    s.set_epoch(0)
    assert s.cursor == 1
    s.set_epoch(1)
    assert (s.epoch, s.cursor) == (1, 0)


def test_drop_last_remaining_samples():
    s = ElasticSampler(10, 4, 2, drop_last=True, members=[0])
    assert s.remaining_samples() == 8
    s.commit()
    assert s.remaining_samples() == 4


# -- invariants under membership changes ---------------------------------------------------


@st.composite
def scenarios(draw):
    mb = draw(st.integers(1, 4))
    m = draw(st.integers(1, 8))
    n = draw(st.integers(0, 120))
    drop_last = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    # Events per step: None, or ("kill", which, interrupted) / ("join",) / ("realloc",).
    events = draw(
        st.lists(
            st.one_of(
                st.none(),
                st.tuples(st.just("kill"), st.integers(0, 7), st.booleans()),
                st.tuples(st.just("join")),
                st.tuples(st.just("realloc"), st.integers(0, 2**16)),
            ),
            max_size=40,
        )
    )
    return n, mb, m, drop_last, seed, events


def random_counts(n_members, total, salt):
    g = torch.Generator().manual_seed(salt)
    cuts = sorted(torch.randint(0, total + 1, (n_members - 1,), generator=g).tolist())
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(n_members)]


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_exactly_once_and_same_batches_under_membership_changes(scenario):
    n, mb, m, drop_last, seed, events = scenario
    expected = failure_free_batches(n, mb, m, seed, drop_last)
    s = ElasticSampler(n, mb * m, mb, seed=seed, drop_last=drop_last, members=[0, 1, 2, 3])
    next_id = 4
    processed = []
    ev = iter(events)
    while not s.epoch_done:
        t = s.cursor
        plan = s.step_plan()
        # Every slot's samples are the failure-free slot's, whoever runs it.
        assert [mb_ for w in plan for mb_ in plan[w]] == s.microbatches(t)
        assert set().union(*[set(x.indices) for w in plan for x in plan[w]]) == expected[t]
        assert sum(x.weight for w in plan for x in plan[w]) == pytest.approx(1.0)
        e = next(ev, None)
        done = [x.indices for w in plan for x in plan[w]]
        if e is not None and e[0] == "kill" and len(s.members) > 1:
            victim = s.members[e[1] % len(s.members)]
            survivors = [w for w in s.members if w != victim]
            if e[2]:
                # Interrupted step: whatever ran is discarded, the step is redone.
                s.set_allocation(survivors)
                continue
            s.set_allocation(survivors)
        elif e is not None and e[0] == "join":
            s.set_allocation([*s.members, next_id])
            next_id += 1
        elif e is not None and e[0] == "realloc":
            s.set_allocation(s.members, random_counts(len(s.members), s.num_microbatches, e[1]))
        processed.extend(i for idx in done for i in idx)
        s.commit(t)
    assert len(processed) == len(set(processed)), "a sample was processed twice"
    assert len(processed) == s.epoch_samples()
    if drop_last:
        assert set(processed) == set().union(*expected) if expected else not processed
    else:
        assert set(processed) == set(range(n))


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_state_dict_round_trips_through_json(scenario):
    n, mb, m, drop_last, seed, events = scenario
    s = ElasticSampler(n, mb * m, mb, seed=seed, drop_last=drop_last, members=[4, 1, 9])
    for _ in range(min(len(events), s.steps_per_epoch)):
        s.commit()
    s.set_allocation([1, 9], random_counts(2, s.num_microbatches, seed))
    state = json.loads(json.dumps(s.state_dict()))
    r = ElasticSampler.from_state_dict(state)
    assert r.state_dict() == s.state_dict()
    if not r.epoch_done:
        assert r.step_plan() == s.step_plan()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dataset_len=11), "dataset_len=11"),
        (dict(global_batch=8), "global_batch"),
        (dict(shuffle=0), "shuffle"),
        (dict(cursor=99), "cursor=99"),
        (dict(cursor="1"), "integer"),
        (dict(epoch=-1), "epoch=-1"),
        (dict(allocation=[1, 1]), "sums to 2"),
        (dict(members="0"), "lists"),
        (dict(version=1), "version"),
        (dict(offset=99), "inconsistent"),
    ],
)
def test_load_state_dict_validates(change, match):
    s = ElasticSampler(10, 4, 1, members=[0, 1])
    state = {**s.state_dict(), **change}
    t = ElasticSampler(10, 4, 1, members=[0])
    before = t.state_dict()
    with pytest.raises(ValueError, match=match):
        t.load_state_dict(state)
    assert t.state_dict() == before


def test_load_state_dict_missing_key():
    state = ElasticSampler(10, 4, 1).state_dict()
    del state["cursor"]
    with pytest.raises(ValueError, match="missing"):
        ElasticSampler(10, 4, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        ElasticSampler.from_state_dict({"dataset_len": 3})


# -- DataLoader ------------------------------------------------------------------------


def loader_batches(s, member, num_workers, limit=None):
    dl = DataLoader(IndexDataset(s.dataset_len), batch_sampler=ElasticBatchSampler(s, member),
                    num_workers=num_workers)
    out = []
    for batch in dl:
        out.append(batch.tolist())
        if limit is not None and len(out) == limit:
            break
    return out


def test_batch_sampler_matches_schedule_and_len():
    s = ElasticSampler(37, 8, 2, seed=3, members=[0, 1, 2])
    for member in s.members:
        bs = ElasticBatchSampler(s, member)
        assert [list(mb.indices) for mb in bs.schedule()] == list(bs)
        assert len(bs) == len(bs.schedule())
    assert len(ElasticBatchSampler(s, 42)) == 0


def test_live_iterator_keeps_its_snapshot_but_refuses_epoch_change():
    s = ElasticSampler(32, 8, 2, seed=3, members=[0, 1])
    it = iter(ElasticBatchSampler(s, 0))
    first = next(it)
    s.set_allocation([0, 1], [0, 4])  # member 0 would now get nothing
    old = ElasticSampler(32, 8, 2, seed=3, members=[0, 1]).step_plan(0)[0]
    assert [first, next(it)] == [list(old[0].indices), list(old[1].indices)]
    s.set_epoch(1)
    with pytest.raises(RuntimeError, match="epoch changed"):
        list(it)


def test_dataloader_with_workers_matches_sampler_across_reconfiguration():
    """Run an epoch with num_workers=2 while member 1 dies during step 2 (interrupted) and a
    member 7 joins at step 4; every member's loader yields exactly what the sampler says and the
    committed steps cover the dataset once."""
    n, mb, m = 53, 2, 6
    s = ElasticSampler(n, mb * m, mb, seed=11, members=[0, 1, 2])
    seen = []
    while not s.epoch_done:
        t = s.cursor
        if t == 2 and 1 in s.members:
            s.set_allocation([0, 2])  # the half-run step 2 is discarded: nothing recorded
            continue
        if t == 4 and 7 not in s.members:
            s.set_allocation([0, 2, 7], [1, 2, 3])
        for member in s.members:
            expected = [list(x.indices) for x in s.local_microbatches(member)]
            # A fresh loader per step is what a reconfigured worker does; take only this step.
            got = loader_batches(s, member, num_workers=2, limit=len(expected)) if expected else []
            assert got == expected
            seen.extend(i for b in got for i in b)
        s.commit()
    assert sorted(seen) == list(range(n))


def test_dataloader_full_epoch_num_workers_2_equals_schedule():
    s = ElasticSampler(40, 8, 2, seed=5, members=[0, 1])
    s.commit()
    for member in (0, 1):
        got = loader_batches(s, member, num_workers=2)
        assert got == [list(x.indices) for x in ElasticBatchSampler(s, member).schedule()]
    assert math.isclose(sum(x.weight for x in ElasticBatchSampler(s, 0).schedule()), 4 / 2)


@pytest.mark.parametrize("members, counts", [([0, 1, 2, 3], None), ([0, 2, 3], [1, 3, 0]), ([5], None)])
@pytest.mark.parametrize("step", [0, 3])  # step 3 is the partial last batch
def test_sample_weighted_gradients_equal_the_failure_free_update(members, counts, step):
    """Summing each member's weight-scaled micro-batch gradients (what a SUM all-reduce does)
    gives the full global batch's mean-loss gradient, whatever the membership."""
    torch.manual_seed(0)
    x, y = torch.randn(45, 3, dtype=torch.float64), torch.randn(45, dtype=torch.float64)
    s = ElasticSampler(45, 12, 3, seed=1)
    s.set_allocation(members, counts)
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)

    def grad(idx, scale=1.0):
        w.grad = None
        (scale * ((x[idx] @ w - y[idx]) ** 2).mean()).backward()
        return w.grad.clone()

    reference = grad(s.global_batch_indices(step))
    total = sum(grad(list(mb.indices), mb.weight) for m in s.members for mb in s.step_plan(step)[m])
    torch.testing.assert_close(total, reference)


# -- global batch changes (shrink and growing back) ----------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 120), data=st.data())
def test_global_batch_changes_keep_every_sample_exactly_once(n, data):
    mb = data.draw(st.integers(1, 4))
    base = mb * data.draw(st.integers(1, 6))
    s = ElasticSampler(n, base, mb, seed=5, members=[0, 1, 2])
    seen, epochs = [], 2
    for epoch in range(epochs):
        s.set_epoch(epoch)
        while not s.epoch_done:
            if data.draw(st.booleans()):
                s.set_global_batch(mb * data.draw(st.integers(1, base // mb)))
                s.set_allocation([0, 1])
            for mbs in s.step_plan().values():
                for m in mbs:
                    seen.extend((epoch, i) for i in m.indices)
            plan = [i for mbs in s.step_plan().values() for m in mbs for i in m.indices]
            assert len(plan) == s.samples_in_step(s.cursor) <= s.global_batch
            s.commit()
    assert sorted(seen) == sorted((e, i) for e in range(epochs) for i in range(n))


def test_global_batch_change_round_trips_and_validates():
    s = ElasticSampler(20, 8, 2, members=[0, 1])
    s.commit()
    s.set_global_batch(6)
    s.set_allocation([0, 1], [2, 1])
    assert s.global_batch_indices(1) == s.order()[8:14]
    state = json.loads(json.dumps(s.state_dict()))
    t = ElasticSampler(20, 8, 2)
    t.load_state_dict(state)
    assert t.state_dict() == s.state_dict() and t.step_plan() == s.step_plan()
    assert t.steps_per_epoch == 1 + 2  # 12 samples left in batches of 6
    with pytest.raises(ValueError, match="at most 8"):
        s.set_global_batch(10)
    with pytest.raises(ValueError, match="multiple"):
        s.set_global_batch(5)


def test_warm_computes_the_next_steps_microbatches_once_and_changes_nothing(monkeypatch):
    """``warm`` (a step's reduction in flight) computes the next step's micro-batches into the
    cache: that step then reads them without computing, the same as a sampler never warmed;
    past the epoch's last step, or for a member without a share, it does nothing."""
    a = ElasticSampler(100, 20, 5, seed=3, members=[0, 1])
    b = ElasticSampler(100, 20, 5, seed=3, members=[0, 1])
    computed = []
    real = ElasticSampler._microbatches
    monkeypatch.setattr(ElasticSampler, "_microbatches", lambda self, step: computed.append(step) or real(self, step))
    a.warm(1, a.cursor + 1)
    assert computed == [1]
    a.commit()
    assert a.local_microbatches(1) == b.local_microbatches(1, 1) and computed == [1, 1]  # (b computed its own)
    assert a.local_microbatches(0) == b.local_microbatches(0, 1) and computed == [1, 1]
    a.set_allocation([0, 1], [4, 0])  # the cache does not depend on the allocation
    assert a.local_microbatches(0) == b.microbatches(1) and computed == [1, 1]
    computed.clear()
    a.warm(7, 2)  # not a member
    a.warm(0, a.steps_per_epoch)  # the next epoch's order is drawn at its start
    assert computed == []
