"""Start fine-tuning from a checkpoint written by Megatron-LM's loop (``recipes/pretrain_gpt.py``).

Megatron-LM records its full command line (``args``) in every checkpoint. Rebuilding the model
from those arguments with Megatron-LM's own ``core_transformer_config_from_args`` and the layer spec
its ``gpt_builders.py`` picks gives exactly the module tree that was saved, so the weights load by
their sharded keys with no conversion table. Like Megatron-LM's ``--finetune``, only the model
weights are taken: the optimizer, LR schedule, iteration and RNG start fresh. Needs megatron-core
>= 0.17 (``megatron.training``), which wrote the checkpoint in the first place.
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch

from recipes.models import Recipe

LATEST_FILE = "latest_checkpointed_iteration.txt"
# Megatron-LM's sharding metadata for the model state (megatron.training.checkpointing
# ._build_sharded_state_dict_metadata); the model's sharded keys depend on it
MEGATRON_LM_MODEL_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                              "distrib_optim_sharding_type": "dp_reshardable"}


class PretrainedError(ValueError):
    """A --pretrained directory that is not a usable Megatron-LM checkpoint (one line)."""


def checkpoint_directory(path: str) -> str:
    """The ``iter_*`` directory to read: ``path`` itself, or the one its ``latest_checkpointed_iteration.txt``
    names (Megatron-LM's save root)."""
    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        if not tag.isdigit():
            raise PretrainedError(f"--pretrained {path}: {LATEST_FILE} holds {tag!r}, not an iteration number")
        directory = os.path.join(path, f"iter_{int(tag):07d}")
    else:
        directory = path
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise PretrainedError(f"--pretrained {path}: no Megatron-LM torch_dist checkpoint there (expected "
                              f"{LATEST_FILE} or an iter_* directory with metadata.json; write one with "
                              "recipes/pretrain_gpt.py --save DIR)")
    return directory


def _megatron_lm_problem() -> Optional[str]:
    """Why Megatron-LM checkpoints cannot be read here (None: they can): megatron.training, which
    megatron-core ships from 0.17 on, rebuilds their model and reads their format."""
    from megatron_llep.compat.megatron_training import missing_reason

    reason = missing_reason()
    if reason is None:
        return None
    return (f"Megatron-LM checkpoints (recipes/pretrain_gpt.py), which --pretrained reads, need megatron-core >= 0.17: "
            f"{reason}; docs/compat.md shows how to install it on Python 3.11")


def saved_arguments(path: str) -> argparse.Namespace:
    """The Megatron-LM command line recorded in the checkpoint at ``path`` (save root or ``iter_*``)."""
    from recipes.runtime.checkpointing import CheckpointError, read_common_state

    problem = _megatron_lm_problem()
    if problem:
        raise PretrainedError(f"--pretrained {path}: {problem}")
    directory = checkpoint_directory(path)
    try:
        common = read_common_state(directory)
    except CheckpointError as err:
        raise PretrainedError(f"--pretrained: {err}") from None
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise PretrainedError(f"--pretrained {directory}: the checkpoint records no Megatron-LM arguments "
                              "(a fine-tuning checkpoint of recipes/finetune.py resumes with --load instead)")
    if not getattr(args, "num_experts", None):
        raise PretrainedError(f"--pretrained {directory}: a dense model (no --num-experts); LLEP fine-tunes MoE models")
    return args


@dataclass
class PretrainedRecipe(Recipe):
    """A recipe built from a Megatron-LM checkpoint's arguments, with the layer spec it was trained with."""

    transformer_engine: bool = False
    rotary_percent: float = 1.0
    source: Optional[str] = None

    def layer_spec(self, use_transformer_engine: Optional[bool] = None):
        return super().layer_spec(self.transformer_engine if use_transformer_engine is None else use_transformer_engine)

    def mtp_spec(self, decoder_spec, use_transformer_engine: Optional[bool] = None):
        return super().mtp_spec(decoder_spec, self.transformer_engine if use_transformer_engine is None else use_transformer_engine)

    def gpt_model_kwargs(self) -> dict:
        return dict(super().gpt_model_kwargs(), rotary_percent=self.rotary_percent)


def recipe_from_arguments(saved: argparse.Namespace, ep_size: int = 1, tp_size: int = 1, pp_size: int = 1,
                          dtype: torch.dtype = torch.float32, cpu: bool = True, source: Optional[str] = None) -> Recipe:
    """The model Megatron-LM built from ``saved``, at this run's parallel layout and precision."""
    problem = _megatron_lm_problem()
    if problem:
        raise PretrainedError(f"--pretrained {source}: {problem}")
    from megatron.training.arguments import core_transformer_config_from_args

    args = copy.copy(saved)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp_size, pp_size
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep_size, 1
    args.sequence_parallel = tp_size > 1 and not cpu  # as recipes/models/__init__.py: torch norms (CPU) refuse it
    args.params_dtype = dtype
    args.bf16, args.fp16 = dtype == torch.bfloat16, False
    args.use_cpu_initialization = cpu
    if cpu:  # the CPU run's settings (compat/megatron_training_cpu.py adds the same flags to pretraining)
        args.gradient_accumulation_fusion = False
        args.moe_grouped_gemm = False
        args.moe_permute_fusion = False
    config = core_transformer_config_from_args(args)
    config.moe_enable_routing_replay = cpu  # --force-routing (and the forced-balance ideal) on CPU, as the recipes
    use_te = args.transformer_impl == "transformer_engine" and args.spec != ["local"]
    return PretrainedRecipe(
        name=f"pretrained:{source or 'megatron-lm'}", config=config, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        transformer_engine=use_te, rotary_percent=args.rotary_percent, source=source,
    )


def load_weights(model: torch.nn.Module, path: str) -> str:
    """Load the model weights of the Megatron-LM checkpoint at ``path`` into ``model`` (the bare
    GPTModel, before DDP); returns the ``iter_*`` directory read. Collective."""
    from megatron.core import dist_checkpointing

    directory = checkpoint_directory(path)
    state = {"model": model.sharded_state_dict(metadata=MEGATRON_LM_MODEL_METADATA)}
    try:
        loaded = dist_checkpointing.load(state, directory)
    except Exception as err:  # noqa: BLE001 - missing/mismatched shards raise CheckpointingException and others
        raise PretrainedError(f"--pretrained {directory}: the model weights do not load into the model its arguments "
                              f"describe ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise PretrainedError(f"--pretrained {directory}: weights missing {missing[:3]} / unexpected {unexpected[:3]}")
    return directory
