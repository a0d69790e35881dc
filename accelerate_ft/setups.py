"""Which setups ``FaultTolerantAccelerator`` carries, checked before Accelerate builds its
state: the device each worker is put on (``place_on_device``), an FSDP2 plugin read into what
the sharded executor needs (``fsdp_setup``), and the sharded setups it does not carry,
refused with what they are in FSDP2 terms (``refuse_sharding``)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from chameleon_ft.runtime.adapter_kit import refuse_grad_scaler
from chameleon_ft.runtime.errors import ConfigError, LauncherError

__all__ = ["place_on_device", "refuse_sharding", "fsdp_setup", "fsdp_env_hidden", "FsdpSetup", "unit_names"]


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


@dataclass(frozen=True)
class FsdpSetup:
    """An FSDP2 plugin as the sharded executor carries it: FULL_SHARD (``reshard_after_forward``)
    or SHARD_GRAD_OP, and the wrap policy (``unit_names`` applies it to the model)."""

    reshard_after_forward: bool = True
    policy: str = "none"  # "transformer" | "size" | "none" (the root only)
    class_names: tuple = ()  # transformer_cls_names_to_wrap (empty: the model's _no_split_modules)
    min_num_params: int = 0


@contextlib.contextmanager
def fsdp_env_hidden():
    """``accelerate launch --use_fsdp``'s switch hidden while Accelerate builds its state (the
    runtime shards the model: ``fsdp_setup``)."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def _fsdp_enabled_by_env() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


def fsdp_setup(kwargs: dict) -> Optional[FsdpSetup]:
    """The FSDP2 plugin of ``FaultTolerantAccelerator(fsdp_plugin=...)`` or of ``accelerate
    launch --use_fsdp`` (its environment), read and removed from what Accelerate gets: the
    runtime shards the model itself (``LoopShardedExecutor``).  None without one.  What it
    does not carry is refused by name: FSDP1, CPU offload, a mixed-precision policy,
    FSDP's activation checkpointing, ignored modules."""
    plugin = kwargs.pop("fsdp_plugin", None)
    if plugin is None and _fsdp_enabled_by_env():
        from accelerate.utils import FullyShardedDataParallelPlugin
        plugin = FullyShardedDataParallelPlugin()  # reads accelerate launch's FSDP_* variables
    if plugin is None:
        return None
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    if version != 2:
        raise ConfigError("FaultTolerantAccelerator carries FSDP2 only: FullyShardedDataParallelPlugin(fsdp_version=2) "
                          "(`accelerate config`: fsdp_version 2; the Trainer: fsdp_config={'version': 2}, its default)")
    from torch.distributed.fsdp import CPUOffloadPolicy
    refused = [name for name, on in (
        ("cpu_offload", isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy)),
        ("mixed_precision_policy", getattr(plugin, "mixed_precision_policy", None) is not None),
        ("activation_checkpointing", bool(getattr(plugin, "activation_checkpointing", False))),
        ("ignored_modules", bool(getattr(plugin, "ignored_modules", None)))) if on]
    if refused:
        raise ConfigError(f"FaultTolerantAccelerator's sharded training does not carry the FSDP plugin's "
                          f"{', '.join(refused)} yet (docs/accelerate.md, 'Sharded training'); remove "
                          f"{'it' if len(refused) == 1 else 'them'} or use a plain Accelerator")
    wrap = getattr(plugin, "auto_wrap_policy", None)
    name = getattr(wrap, "__name__", getattr(getattr(wrap, "func", None), "__name__", str(wrap or "")))
    policy = "transformer" if "transformer" in name else "size" if "size" in name else "none"
    if wrap is not None and policy == "none":
        raise ConfigError(f"FaultTolerantAccelerator: the FSDP auto_wrap_policy {name!r} is not carried; use "
                          "transformer_based_wrap (transformer_cls_names_to_wrap) or size_based_wrap (min_num_params)")
    return FsdpSetup(reshard_after_forward=bool(getattr(plugin, "reshard_after_forward", True)), policy=policy,
                     class_names=tuple(getattr(plugin, "transformer_cls_names_to_wrap", None) or ()),
                     min_num_params=int(getattr(plugin, "min_num_params", None) or 0))


def unit_names(model, setup: FsdpSetup) -> list[str]:
    """The submodules Accelerate's FSDP2 preparation would shard as units of their own (the
    root is always one): those of the named classes (or the model's ``_no_split_modules``), or
    those with more than ``min_num_params`` parameters."""
    if setup.policy == "transformer":
        names: Sequence[str] = setup.class_names or tuple(getattr(model, "_no_split_modules", None) or ())
        if not names:
            raise ConfigError("FaultTolerantAccelerator: transformer_based_wrap needs transformer_cls_names_to_wrap "
                              "(the model has no _no_split_modules)")
        found = [n for n, m in model.named_modules() if n and type(m).__name__ in set(names)]
        if not found:
            raise ConfigError(f"FaultTolerantAccelerator: no module of the model is a {', '.join(names)} "
                              "(transformer_cls_names_to_wrap)")
        return found
    if setup.policy == "size":
        return [n for n, m in model.named_modules()
                if n and sum(p.numel() for p in m.parameters()) > setup.min_num_params]
    return []


def refuse_sharding(kwargs: dict) -> None:
    """DeepSpeed setups are not carried by this adapter yet: refused with what the ZeRO stage
    is in FSDP2 terms (which is carried: ``fsdp_setup``)."""
    ds = kwargs.get("deepspeed_plugin") is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")
    if not ds:
        return
    stage = _zero_stage(kwargs)
    same = _ZERO_AS_FSDP2.get(stage, "FSDP2 (ZeRO-3 is FULL_SHARD, ZeRO-2 SHARD_GRAD_OP)")
    raise ConfigError(
        f"FaultTolerantAccelerator does not carry DeepSpeed setups yet; your ZeRO stage "
        f"{stage if stage is not None else '(unknown)'} is, in FSDP2 terms, {same} -- `accelerate "
        f"config` writes an FSDP config (fsdp_version 2), which FaultTolerantAccelerator carries, and "
        f"Accelerate's 'FSDP vs DeepSpeed' guide maps the other options")
