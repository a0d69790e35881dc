"""``ElasticTrainer``: a plain training loop on ``DataParallelExecutor``, and ``elastic_main``.

For scripts started by ``chameleon-ft run``::

    def main():
        trainer = ElasticTrainer(model, optimizer, dataset, loss_fn, global_batch=32,
                                 micro_batch=4, scheduler=scheduler)
        trainer.fit(epochs=3)
    elastic_main(main)

``loss_fn(model, batch)`` returns the mean loss of one micro-batch, or (data parallel) a
pair ``(sum, count)`` -- the loss summed over ``count`` items (tokens) -- for an update that
is the global batch's token mean, whoever computes which micro-batch; ``batch`` is
``collate_fn([dataset[i] for i in micro_batch.indices])`` (``default_collate`` by default).
Every member of the job runs the same loop; failures, replacements and stragglers are
handled inside ``DataParallelExecutor.sync_and_step`` -- the loop only asks again what to compute.

Pipeline parallelism (DP x PP): give the model as an ordered list of blocks (per-block
factories ``fn() -> nn.Module``, so that a worker builds only the blocks it holds, or an
``nn.Sequential``, built or on the ``meta`` device; ``device=`` where held blocks live) and
``stages=P``; the engine's plan then decides the layout (pipelines of
``P`` stages at first, re-planned over the survivors after a failure) and ``loss_fn(output,
batch)`` receives the last block's output (``input_fn(batch)``, default ``batch[0]``, feeds the
first block).  See ``runtime/executors/pipeline/``.

Sharded training (FSDP2): ``sharding="full"`` shards the model over all workers, ``"hybrid"``
is HSDP with ``replicas`` replica groups; ``loss_fn(model, batch)`` then receives the sharded
model (``trainer.ctx.module``) -- see ``runtime/executors/sharded/``.

Limits: map-style datasets only (the sampler addresses samples by index); a DataLoader with
workers can be built on ``ElasticBatchSampler`` instead of this loop (see sampler.py).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch
from torch.utils.data import default_collate

from chameleon_ft.runtime.errors import ConfigError, end_process, exit_code_for, exit_worker, user_error
from chameleon_ft.runtime.config import ElasticConfig
from chameleon_ft.runtime.recovery import StepEnd
from chameleon_ft.runtime.executors.dp import DataParallelExecutor

__all__ = ["ElasticTrainer", "elastic_main"]


class ElasticTrainer:
    """Data-parallel training that survives worker failures in place.

    Args:
        checkpoint: optional path; resumed from when it exists, written by the lowest-ranked
            member every ``checkpoint_every`` committed steps, at the end, and at the step every
            member left at when the whole job got a preemption notice (a requeued job resumes
            there: ``chameleon-ft run --requeue``).
        on_step: optional ``fn(ctx)`` called after every committed step (logging, metrics).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset,
                 loss_fn: Callable, global_batch: int, micro_batch: int, scheduler=None, *,
                 collate_fn: Callable = default_collate, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, config: Optional[ElasticConfig] = None,
                 checkpoint: Optional[str] = None, checkpoint_every: int = 0,
                 on_step: Optional[Callable] = None, stages: int = 1,
                 input_fn: Optional[Callable] = None, sharding: Optional[str] = None,
                 replicas: int = 2, snapshot_every: Optional[int] = None, recipe=None,
                 device=None):
        self.model, self.dataset, self.loss_fn = model, dataset, loss_fn
        self.collate_fn = collate_fn
        self.pipeline = stages > 1
        self.sharded = sharding is not None
        if sharding not in (None, "full", "hybrid"):
            raise ConfigError(f"sharding must be None, 'full' or 'hybrid', got {sharding!r}")
        if self.sharded and self.pipeline:
            raise ConfigError("sharding and pipeline stages together are not supported")
        if device is not None and not self.pipeline:
            raise ConfigError("device= is for pipeline jobs (stages > 1): move the model yourself")
        if self.sharded:
            from chameleon_ft.runtime.executors.sharded.executor import ShardedExecutor
            self.ctx = ShardedExecutor(model, optimizer, len(dataset), global_batch, micro_batch,
                                      replicas=replicas if sharding == "hybrid" else 1,
                                      snapshot_every=snapshot_every, recipe=recipe,
                                      scheduler=scheduler, seed=seed, shuffle=shuffle,
                                      drop_last=drop_last, config=config)
        elif self.pipeline:
            from chameleon_ft.runtime.executors.pipeline.executor import PipelineExecutor
            self.ctx = PipelineExecutor(model, optimizer, dataset, loss_fn, global_batch, micro_batch,
                                       stages, input_fn=input_fn, collate_fn=collate_fn,
                                       scheduler=scheduler, seed=seed, shuffle=shuffle,
                                       drop_last=drop_last, config=config, device=device)
        else:
            self.ctx = DataParallelExecutor(model, optimizer, len(dataset), global_batch, micro_batch,
                                      scheduler=scheduler, seed=seed, shuffle=shuffle,
                                      drop_last=drop_last, config=config)
        self.checkpoint = checkpoint
        self.ctx.checkpoint_path = checkpoint  # the engine weighs restart only when one is written
        if self.pipeline and checkpoint:
            self.ctx.allow_restart()
        self.checkpoint_every = checkpoint_every
        self.on_step = on_step
        if checkpoint:  # the whole job preempted: resume (requeued) from the step it left at
            self.ctx.on_whole_job_leave = lambda: self.ctx.save_checkpoint(self.checkpoint)

    def fit(self, max_steps: Optional[int] = None, epochs: Optional[int] = None) -> dict:
        """Train until ``max_steps`` committed steps or ``epochs`` epochs, whichever first."""
        if max_steps is None and epochs is None:
            raise ConfigError("give max_steps or epochs")
        ctx = self.ctx
        if self.checkpoint and os.path.exists(self.checkpoint):
            ctx.load_checkpoint(self.checkpoint)
        ctx.plan_run(max_steps, epochs)
        ctx.start()
        try:
            while True:
                while not self._done(max_steps, epochs):
                    if ctx.run_step(self._attempt) is StepEnd.COMMITTED:
                        self._after_step()
                # Sharded: the trained model into the user's module (a failure during the
                # gather recovers, and training goes on where the recovery left it).  Then every
                # member waits until all have committed the last step (``depart``).
                if (not self.sharded or ctx.finish()) and ctx.depart():
                    break
            if self.checkpoint:
                ctx.save_final(self.checkpoint)
        finally:
            ctx.close(redone_steps=ctx.redone_steps, adopted_steps=ctx.adopted_steps)
        return {"step": ctx.step, "epoch": ctx.epoch, "members": list(ctx.members),
                "redone_steps": ctx.redone_steps, "adopted_steps": ctx.adopted_steps}

    @property
    def redone_steps(self) -> int:
        return self.ctx.redone_steps

    def _attempt(self) -> bool:
        """One attempt at the current step with this job's executor; True when it committed."""
        ctx = self.ctx
        if self.sharded:
            return ctx.train_step(self._loss_of)
        if self.pipeline:
            return ctx.train_step()
        for mb in ctx.microbatches():
            t0 = time.perf_counter()
            batch = self.collate_fn([self.dataset[i] for i in mb.indices])
            loss = self.loss_fn(self.model, batch)
            if isinstance(loss, tuple):  # (sum over the items, their count): token-weighted
                total, count = loss
                ctx.backward(total / count, mb, tokens=count)
            else:
                ctx.backward(loss, mb)
            # ``slow`` faults pad the micro-batch by (factor - 1) x its compute time.
            ctx.faults.at(ctx.step, "forward", time.perf_counter() - t0)
        return ctx.sync_and_step()

    def _loss_of(self, module: torch.nn.Module, indices):
        return self.loss_fn(module, self.collate_fn([self.dataset[i] for i in indices]))

    def _after_step(self) -> None:
        if self.on_step is not None:
            self.on_step(self.ctx)
        if self.checkpoint and self.checkpoint_every and self.ctx.step % self.checkpoint_every == 0:
            self.ctx.save_checkpoint(self.checkpoint)

    def _done(self, max_steps, epochs) -> bool:
        return ((max_steps is not None and self.ctx.step >= max_steps)
                or (epochs is not None and self.ctx.epoch >= epochs))


def elastic_main(fn: Callable[[], object]) -> None:
    """Run a worker's ``fn`` and end the process with a code the launcher understands:
    0 done, else ``errors.exit_code_for``'s code (checkpoint-restart, coordinator gone,
    configuration error), 70 for an exception in the user's code (``errors.user_error``).  Ends with ``os._exit`` so that a gloo op abandoned after
    a failure cannot hold the interpreter's teardown."""
    try:
        fn()
    except SystemExit as exc:  # the script chose its exit status (argparse's 2, sys.exit(n))
        end_process(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
    except BaseException as exc:
        code = exit_code_for(exc)
        if code is None:  # a bug in the script: the job stops, its traceback said once
            user_error(exc)
        exit_worker(exc, code)
    end_process(0)
