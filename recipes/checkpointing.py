"""Checkpoint save/resume with Megatron's ``dist_checkpointing`` (model, distributed optimizer,
LR scheduler, RNG, data position), laid out as Megatron-LM does::

    <save>/iter_0000004/...                    one dist_checkpointing directory per save
    <save>/latest_checkpointed_iteration.txt   the newest complete one

A save is written to ``iter_XXXXXXX.tmp`` and renamed only after every rank finished, and the
"latest" file is replaced atomically after that, so a run killed mid-save leaves the previous
checkpoint intact. Resuming restores everything a step depends on: with the same world size the
continued run is bitwise the run that never stopped.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_llep.placement import ExpertPlacement, read_checkpoint_placement, write_checkpoint_placement

LATEST_FILE = "latest_checkpointed_iteration.txt"
# Megatron-LM's default: distributed-optimizer state saved by every rank in parallel, reshardable
# across data-parallel sizes
SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or from an incompatible run."""


@dataclass
class TrainingProgress:
    """What the loop needs besides parameters and optimizer state to continue exactly."""

    iteration: int = 0
    consumed_samples: int = 0


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _create_empty_adam_state(optimizer) -> None:
    """Give a fresh optimizer Adam's state entries (zero moments, step 0) without stepping it.

    Megatron-Core 0.16's DistributedOptimizer reads ``state["step"]`` of every parameter when
    building the sharded state dict to load into; without TE/Apex the torch Adam it wraps has no
    state before its first step. The loaded checkpoint overwrites these entries.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _restore_adam_steps(optimizer, loaded_state: Any) -> None:
    """Set every parameter's Adam step counter from the checkpoint, each its own tensor.

    Without TE/Apex, Megatron-Core 0.16's DistributedOptimizer keeps the step in the saved param
    groups but its load_state_dict leaves the counters of an already-initialised state untouched
    (and would share ONE tensor between all parameters, which torch Adam increments once per
    parameter). Bias correction after a resume depends on it.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded_state[i] for i in range(len(chained))] if len(chained) > 1 else [loaded_state]
    for inner_optimizer, state in zip(chained, states):
        steps = {g["step"] for g in state["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue  # TE/Apex optimizers keep the step in their param groups themselves
        step = float(steps.pop())
        for param_state in inner_optimizer.optimizer.state.values():
            param_state["step"] = torch.tensor(step)


def _sharded_state(model, optimizer, is_loading: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if is_loading:
        _create_empty_adam_state(optimizer)
    model_state = model.module.sharded_state_dict(metadata=SHARDING_METADATA)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=SHARDING_METADATA),
        # every rank's RNG (expert-parallel ranks differ), one shard per global rank
        "rng_state": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
    }


def save_checkpoint(
    root: str, model, optimizer, scheduler, progress: TrainingProgress, run_info: dict[str, Any],
    placement: Optional[ExpertPlacement] = None,
) -> str:
    """Save everything under ``root``; returns the checkpoint directory. Collective.

    A model placed with a CAP placement is saved in its physical expert order, with the placement
    recorded next to it (``expert_placement.json``; see :mod:`megatron_llep.placement.apply` for
    restoring the original order)."""
    final = _iteration_dir(root, progress.iteration)
    staging = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state.update(
        iteration=progress.iteration,
        consumed_samples=progress.consumed_samples,
        scheduler=scheduler.state_dict(),
        run_info=run_info,
        world_size=dist.get_world_size(),
    )
    dist_checkpointing.save(state, staging)
    dist.barrier()
    if dist.get_rank() == 0:
        if placement is not None:
            write_checkpoint_placement(staging, placement)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        latest_tmp = os.path.join(root, LATEST_FILE + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(str(progress.iteration))
        os.replace(latest_tmp, os.path.join(root, LATEST_FILE))
    dist.barrier()
    return final


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory for ``--load``: a save root (its latest checkpoint) or an
    ``iter_*`` directory."""
    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            return _iteration_dir(path, int(f.read().strip()))
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise CheckpointError(f"no checkpoint at {path!r} (neither {LATEST_FILE} nor a dist_checkpointing directory)")


def load_checkpoint(
    path: str, model, optimizer, scheduler, run_info: dict[str, Any], strict_keys: tuple[str, ...],
    placement: Optional[ExpertPlacement] = None,
) -> TrainingProgress:
    """Restore a checkpoint saved by :func:`save_checkpoint` into freshly built objects.

    ``strict_keys`` name the ``run_info`` entries that must match the saved run (model shape,
    sequence length, ...), and the model's expert placement must be the checkpoint's: resuming a
    different model fails with a message instead of loading mismatched tensors. Collective.
    """
    directory = resolve_checkpoint(path)
    saved_placement = read_checkpoint_placement(directory)
    as_layers = lambda p: None if p is None else p.to_json()["layers"]  # noqa: E731
    if as_layers(saved_placement) != as_layers(placement):
        raise CheckpointError(f"{directory} stores experts in {'a CAP placement' if saved_placement else 'original order'}"
                              f" but this run uses {'a different placement' if placement else 'none'} (--placement)")
    common = dist_checkpointing.load_common_state_dict(directory)
    saved_info = common.get("run_info", {})
    mismatched = {k: (saved_info.get(k), run_info.get(k)) for k in strict_keys if saved_info.get(k) != run_info.get(k)}
    if mismatched:
        details = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in mismatched.items())
        raise CheckpointError(f"{directory} was saved by an incompatible run ({details})")
    same_world = common.get("world_size") == dist.get_world_size()
    state = _sharded_state(model, optimizer, is_loading=True)
    if not same_world:  # RNG shards are per global rank; a resharded resume starts fresh RNG
        state.pop("rng_state")
    loaded = dist_checkpointing.load(state, directory)
    model.module.load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(common["scheduler"])
    if same_world:
        _set_rng_state(loaded["rng_state"])
    return TrainingProgress(iteration=int(common["iteration"]), consumed_samples=int(common["consumed_samples"]))


def latest_iteration(root: str) -> Optional[int]:
    """The newest complete checkpoint's iteration under ``root`` (``None`` if there is none)."""
    latest = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return int(f.read().strip())
