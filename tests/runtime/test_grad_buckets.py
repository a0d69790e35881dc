"""Gradients reduced in buckets while backward runs (``executors/buckets.py``).

Unit tests of the bucket logic run in one process with a recording "launch" (no collective: a
world of one sums nothing); the live kill with three buckets is
``tests/runtime/test_elastic_recovery.py::test_random_sigkill_run_completes_exactly_once_and_on_trajectory[three-buckets]``
(exactly once, replicas bitwise equal, within 1e-5 of the one-bucket failure-free run); the host
reads of a step are counted below on a 2-worker job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chameleon_ft.runtime.executors.buckets import GradientBuckets



def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


class _Recorder:
    """A ``launch`` that records which bucket started when, and how far backward had come."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.launched: list[tuple[int, bool]] = []  # (numel, the first layer's weight grad ready yet)
        self.first = model[0].weight
        self.first_ready = False
        self.first.register_post_accumulate_grad_hook(lambda p: setattr(self, "first_ready", True))

    def __call__(self, buf: torch.Tensor):
        self.launched.append((buf.numel(), self.first_ready))
        return buf


# ---------------------------------------------------------------------------- unit
def test_buckets_follow_reverse_parameter_order_and_the_cap():
    model = _mlp()
    params = list(model.parameters())  # w1 (512), b1 (32), w2 (128), b2 (4)
    b = GradientBuckets(params, cap_mb=26 * 4 / 2 ** 20)
    assert [[tuple(params[i].shape) for i in idx] for idx in b.buckets] == [[(4,), (4, 32)], [(32,)], [(32, 16)]]
    assert GradientBuckets(params).buckets == [[3, 2, 1, 0]]  # DDP's 25 MiB: one bucket
    with pytest.raises(ValueError):
        GradientBuckets(params, cap_mb=0)


def test_buckets_launch_during_the_final_backward_and_hold_the_local_gradients():
    model = _mlp()
    params = list(model.parameters())
    b = GradientBuckets(params, cap_mb=26 * 4 / 2 ** 20)
    rec = _Recorder(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()  # not armed: accumulates locally (no_sync)
    assert rec.launched == []
    rec.first_ready = False
    b.set_tail(1)
    b.arm(rec)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    # Buckets 0 and 1 started inside backward, before the first layer's weight gradient was
    # final; the last one waits for finish (it carries the tail).
    assert rec.launched == [(132, False), (32, False)]
    local = [p.grad.clone() for p in params]
    b.tail()[0] = 7.0
    bufs = b.finish(lambda work: None)
    assert rec.launched[-1] == (512 + 1, True)
    assert float(bufs[-1][-1]) == 7.0
    # .grad kept the local sum (the redone step's share after a failure) ...
    assert all(torch.equal(p.grad, g) for p, g in zip(params, local))
    # ... and the buckets hold the same values, given to .grad as views for the update.
    b.assign_grads()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, local))
    assert params[0].grad.data_ptr() == bufs[2].data_ptr()


def test_parameters_without_a_gradient_in_the_final_backward_are_filled_at_finish():
    model = _mlp()
    params = list(model.parameters())
    b = GradientBuckets(params, cap_mb=26 * 4 / 2 ** 20)
    rec = _Recorder(model)
    model(torch.randn(2, 16)).sum().backward()
    before = [p.grad.clone() for p in params]
    b.set_tail(0)
    b.arm(rec)  # armed, but this member runs no backward (no share, or a ghost last item)
    bufs = b.finish(lambda work: None)
    assert len(rec.launched) == 3
    flat = torch.cat([bufs[k] for k in range(3)])
    expect = torch.cat([before[i].reshape(-1) for idx in b.buckets for i in idx])
    assert torch.equal(flat, expect)
    # An unused parameter (no .grad at all) is reduced as zeros.
    model2 = _mlp()
    b2 = GradientBuckets(list(model2.parameters()), cap_mb=26 * 4 / 2 ** 20)
    b2.set_tail(0)
    b2.arm(lambda buf: buf)
    model2[0](torch.randn(2, 16)).sum().backward()  # the last layer is unused
    bufs2 = b2.finish(lambda work: None)
    assert torch.count_nonzero(bufs2[0]) == 0


def test_release_drops_each_gradient_into_its_bucket_as_backward_produces_it():
    """``release`` (DDP's ``gradient_as_bucket_view``): after the final backward no parameter
    holds a local gradient (one copy per step: the buckets), the buckets hold what the local
    sums would have been, a second backward is refused as without it, and ``released`` says the
    member keeps nothing for a redone step."""
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    ref = _mlp()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    expect = [p.grad.clone() for p in ref.parameters()]
    model = _mlp()
    params = list(model.parameters())
    b = GradientBuckets(params, cap_mb=26 * 4 / 2 ** 20, release=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()  # not armed: accumulates locally
    assert all(p.grad is not None for p in params) and not b.released
    b.set_tail(0)
    b.arm(lambda buf: buf)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is None for p in params) and b.released  # the last bucket's too
    b.finish(lambda work: None)
    b.assign_grads()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, expect))
    b.arm(lambda buf: buf)
    assert not b.released  # a new step
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="produced twice"):
        b.finish(lambda work: None)


@pytest.mark.parametrize("dtype,name", [(torch.float16, "fp16"), (torch.bfloat16, "bf16")])
def test_compression_reduces_the_gradients_in_the_half_dtype_as_ddps_hooks_do_and_the_tail_exact(dtype, name):
    """DDP's compression hooks: each bucket divided by the world size, cast, reduced, cast back
    (times the world size: the buckets keep the sum).  The commit's tail goes in full precision,
    an op of its own after the last bucket's gradients.  A launch standing for 4 members with
    the same gradients (it multiplies what it is given by 4)."""
    model = _mlp()
    params = list(model.parameters())
    b = GradientBuckets(params, cap_mb=26 * 4 / 2 ** 20, compress=name)
    sent = []

    def launch(buf):
        sent.append(buf.dtype)
        buf.mul_(4)  # four members' equal contributions summed
        return buf
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    b.set_tail(1)
    b.arm(launch, world=4)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    b.tail()[0] = 0.1  # not representable in fp16/bf16: must come back exact
    bufs = b.finish(lambda work: None)
    assert sent == [dtype, dtype, dtype, torch.float32]  # three buckets' gradients, then the tail
    assert float(bufs[-1][-1]) == float(torch.tensor(0.1) * 4)  # summed in float32
    local = {id(p): p.grad for p in params}
    for k, idx in enumerate(b.buckets):
        g = torch.cat([local[id(params[i])].reshape(-1) for i in idx])
        got = bufs[k][:g.numel()]
        # DDP's order: cast, divide by 4, summed over the 4 in that dtype, cast back, times 4
        assert torch.equal(got, (g.to(dtype).div(4) * 4).float() * 4)
        assert not torch.equal(got, g * 4)  # not the float32 sum
    with pytest.raises(ValueError):
        GradientBuckets(params, compress="int8")


def test_ddp_settings_become_the_buckets_size_and_compression_or_a_clear_refusal():
    """What a user sets on DDP (Accelerate's kwargs handler, Lightning's strategy) reaches the
    buckets: the size, fp16/bf16 compression by Accelerate's enum or torch's hook functions;
    PowerSGD and communication wrappers are refused by name, not dropped."""
    from accelerate.utils import DDPCommunicationHookType as Hook
    from accelerate.utils import DistributedDataParallelKwargs as Kw
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from chameleon_ft import ElasticConfig
    from chameleon_ft.runtime.adapter_kit import ddp_reduction
    from chameleon_ft.runtime.errors import ConfigError

    cfg = ElasticConfig()  # bucket_cap_mb 25, no compression

    def got(*args, **kw):
        r = ddp_reduction(*args, **kw)
        return r["bucket_cap_mb"], r["grad_compression"], r["gradient_as_bucket_view"]
    assert got(None, cfg) == (25.0, None, False)
    assert got(Kw(bucket_cap_mb=4), cfg) == (4.0, None, False)
    assert got(Kw(comm_hook=Hook.FP16), cfg) == (25.0, "fp16", False)
    assert got(Kw(comm_hook=Hook.BF16, bucket_cap_mb=8), cfg) == (8.0, "bf16", False)
    assert got({"bucket_cap_mb": 2}, cfg, hook=default_hooks.bf16_compress_hook) == (2.0, "bf16", False)
    assert got({}, cfg, hook=default_hooks.fp16_compress_hook) == (25.0, "fp16", False)
    assert got(Kw(gradient_as_bucket_view=True), cfg) == (25.0, None, True)
    assert got({"gradient_as_bucket_view": True}, cfg) == (25.0, None, True)
    # No DDP setting: the user's ElasticConfig stands.
    assert got(None, ElasticConfig(bucket_cap_mb=8, grad_compression="bf16")) == (8.0, "bf16", False)
    assert got(Kw(), ElasticConfig(grad_compression="bf16")) == (25.0, "bf16", False)  # DDP's defaults
    assert got(None, ElasticConfig(gradient_as_bucket_view=True)) == (25.0, None, True)
    for bad in (dict(handler=Kw(comm_hook=Hook.POWER_SGD)),
                dict(handler=Kw(comm_hook=Hook.BF16, comm_wrapper=Hook.FP16)),
                dict(handler={}, hook=powerSGD_hook.powerSGD_hook),
                dict(handler={}, hook=lambda state, bucket: None),
                dict(handler={}, hook=default_hooks.fp16_compress_hook, wrapper=default_hooks.fp16_compress_wrapper)):
        with pytest.raises(ConfigError, match="communication"):
            ddp_reduction(bad.pop("handler"), cfg, **bad)


def test_a_second_backward_into_a_reduced_bucket_is_refused_and_a_failed_launch_waits_for_finish():
    model = _mlp()
    b = GradientBuckets(list(model.parameters()), cap_mb=26 * 4 / 2 ** 20)
    x = torch.randn(2, 16)
    b.set_tail(0)
    b.arm(lambda buf: buf)
    model(x).sum().backward()
    model(x).sum().backward()  # no exception inside the user's backward() ...
    with pytest.raises(RuntimeError, match="produced twice"):
        b.finish(lambda work: None)  # ... the step's sync raises it
    assert not b.armed

    def broken(buf):
        raise ConnectionError("peer gone")
    model.zero_grad()
    b.arm(broken)
    model(x).sum().backward()
    with pytest.raises(ConnectionError):
        b.finish(lambda work: None)


# ---------------------------------------------------------------------------- host reads
SYNC_WORKER = Path(__file__).with_name("_workers") / "sync_worker.py"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("control,tokens", [(False, False), (True, False), (False, True)],
                         ids=["trainer", "adapters", "token-weighted"])
def test_the_step_reads_nothing_from_the_device_but_the_reduced_tail(tmp_path, control, tokens):
    """Over 6 steps of 2 workers (three buckets), the package's own code calls none of the
    APIs that make a host wait for a device (``item``, ``tolist``, ``float(t)``...) but the
    sampler's epoch order (computed on the host by construction): the one read of the reduced
    tail after the commit point goes through its numpy view (the gradients are on the host), and
    ``last_loss`` (a number taken from it) reads nothing more; the counter sees the same read
    given a tensor (as on a GPU, where the timings come back in a host tensor).  On a GPU the
    counted calls would each stop the CPU from running ahead (``gpu_check.py`` runs
    ``torch.cuda.set_sync_debug_mode`` there)."""
    from chameleon_ft.cli.localjob import LocalJob

    job = LocalJob(tmp_path, SYNC_WORKER, ["--out", str(tmp_path)] + (["--control"] if control else [])
                   + (["--tokens"] if tokens else []), nproc=2, hang_timeout=30)
    try:
        job.start()
        assert job.wait(90) == [0], job.output()
    finally:
        job.cleanup()
    for w in (0, 1):
        got = json.loads((tmp_path / f"syncs_{w}.json").read_text())
        # (the sampler's epoch order is a host tensor by construction: a CPU generator's randperm)
        on_device = {k: v for k, v in got["counts"].items() if k != "tolist in order"}
        assert on_device == {}, got
        assert got["deliberate"] == {}, got
        assert got["control"] == {"tolist in _read_tail": 1}, got
        assert 0.05 < got["loss"] < 5, got
    if tokens:
        _same_as_token_means(job, tmp_path)


def _same_as_token_means(job, tmp_path) -> None:
    """The workers' weights after the 9 token-weighted steps equal one process's, each step's
    gradient the sum over its 32 samples of (tokens x loss) divided by its tokens (the sample
    ids of each committed step from the event log); the sample-weighted run differs."""
    from chameleon_ft.runtime.eventlog import committed_attempts

    steps = committed_attempts(job.events())
    ids = {s: [i for r in recs for i in r["ids"]] for s, recs in steps.items()}
    assert sorted(ids) == list(range(9)) and all(len(v) == 32 for v in ids.values())

    import sys

    sys.path.insert(0, str(SYNC_WORKER.parent))
    from sync_worker import build

    def run(token_mean: bool) -> list:
        model, opt, (x, y, tokens) = build()
        for s in range(9):
            idx = ids[s]
            per = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="none")
            w = tokens[idx] / tokens[idx].sum() if token_mean else torch.full((32,), 1 / 32)
            (per * w).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()]

    want, by_samples = run(True), run(False)
    for w in (0, 1):
        got = torch.load(tmp_path / f"params_{w}.pt", weights_only=True)
        assert max(float((a - b).norm() / b.norm()) for a, b in zip(got, want)) < 1e-5
    assert max(float((a - b).norm() / b.norm()) for a, b in zip(by_samples, want)) > 1e-3
