"""Which setups ``FaultTolerantAccelerator`` carries, checked before Accelerate builds its
state: the device each worker is put on (``place_on_device``), and the sharded setups it does
not carry yet, refused with what they are in FSDP2 terms (``refuse_sharding``)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from chameleon_ft.runtime.adapter_kit import refuse_grad_scaler
from chameleon_ft.runtime.errors import ConfigError, LauncherError

__all__ = ["place_on_device", "refuse_sharding"]


def place_on_device(cpu: bool, env, mixed_precision=None) -> None:
    """Put this worker on its device before Accelerate picks one.

    Under ``chameleon-ft run`` Accelerate sees a single process (torchrun's variables are
    hidden, ``_env.py``), so its device is ``torch.device("cuda")``: the *current* CUDA device.
    Each worker makes that ``cuda:<local rank mod GPUs>`` (one GPU per worker when the node has
    enough; several workers share one otherwise, their tensor collectives then go over gloo
    on CUDA tensors -- ``runtime/nccl.py``).  XPU and MPS are refused clearly (not silently
    replaced by the CPU), and so is fp16 mixed precision: its ``GradScaler`` skips or rescales
    updates outside our atomic step (bf16 needs no scaler and is fine)."""
    mp = str(mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")).lower()
    if mp == "fp16":
        refuse_grad_scaler("accelerate_ft", "mixed_precision='fp16'")
    if cpu:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(getattr(env, "local_rank", 0) or 0) % torch.cuda.device_count())
        return
    found = [name for name, ok in (("XPU", hasattr(torch, "xpu") and torch.xpu.is_available()),
                                   ("MPS", torch.backends.mps.is_available())) if ok]
    if found:
        raise LauncherError(
            f"accelerate_ft runs on CUDA GPUs or the CPU; this machine has a {found[0]} device, "
            "which is not supported yet. Build FaultTolerantAccelerator(cpu=True) to train on the "
            "CPU, or use a plain Accelerator (no in-place fault tolerance) for it.")


#: DeepSpeed's ZeRO stage -> what FSDP2 calls the same sharding (Accelerate's "FSDP vs
#: DeepSpeed" guide maps the other options).
_ZERO_AS_FSDP2 = {
    0: "no sharding: plain data parallelism (drop the DeepSpeed plugin)",
    1: "FSDP2 with reshard_after_forward=False (SHARD_GRAD_OP; ZeRO-1's optimizer-only sharding has no "
       "FSDP form, this also shards gradients)",
    2: "FSDP2 with reshard_after_forward=False (SHARD_GRAD_OP)",
    3: "FSDP2 with reshard_after_forward=True (FULL_SHARD)",
}


def _zero_stage(kwargs: dict) -> Optional[int]:
    plugin = kwargs.get("deepspeed_plugin")
    stage = getattr(plugin, "zero_stage", None) if plugin is not None else \
        os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    try:
        return int(stage) if stage is not None else None
    except (TypeError, ValueError):
        return None


def refuse_sharding(kwargs: dict) -> None:
    """FSDP / DeepSpeed setups are not carried by this adapter yet, and Accelerate drops an FSDP
    plugin on the CPU without a word (docs/accelerate.md): refuse it instead of training DDP.
    A DeepSpeed setup is told what its ZeRO stage is in FSDP2 terms."""
    fsdp = kwargs.get("fsdp_plugin") is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    ds = kwargs.get("deepspeed_plugin") is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")
    if not (fsdp or ds):
        return
    where = ("for sharded training that survives failures use chameleon_ft's ElasticTrainer(..., "
             "sharding='full' (FSDP2, FULL_SHARD) or 'hybrid') or Lightning's ModelParallelStrategy "
             "(docs/runtime-sharded.md)")
    if ds:
        stage = _zero_stage(kwargs)
        same = _ZERO_AS_FSDP2.get(stage, "FSDP2 (ZeRO-3 is FULL_SHARD, ZeRO-2 SHARD_GRAD_OP)")
        raise ConfigError(
            f"FaultTolerantAccelerator does not carry DeepSpeed setups yet; your ZeRO stage "
            f"{stage if stage is not None else '(unknown)'} is, in FSDP2 terms, {same} -- `accelerate "
            f"config` writes an FSDP config and Accelerate's 'FSDP vs DeepSpeed' guide maps the other "
            f"options; {where}")
    raise ConfigError(
        "FaultTolerantAccelerator does not carry FSDP setups yet (and Accelerate ignores an FSDP plugin "
        f"on the CPU); {where}")
