"""The known-harmless warnings Megatron-Core and torch print on every CPU run, silenced once for
all CPU entry points (finetune.py, evaluate.py, generate.py, pretrain_gpt.py, make_indexed_dataset.py)."""

from __future__ import annotations

import logging
import warnings

import torch


def quiet_known_cpu_warnings() -> None:
    """CPU runs only: drop the warnings Megatron-Core (0.16-0.19) and torch print on every CPU run that
    ask nothing of the user (no Transformer Engine/Apex/absl, deprecated names inside Megatron's own
    calls, the distributed optimizer's shard views seen through the CPU compatibility layer, LLEP's
    MoELayer subclass unknown to TransformerLayer's kwargs table, 0.19's notes on GPTModel, DDP layouts,
    async saves, single-process loads of a checkpoint's common state and experimental MIMO configs);
    every other warning still shows. Does nothing where CUDA is available."""
    if torch.cuda.is_available():
        return
    for message in (
        r"Transformer Engine and Apex are not installed",
        r"Apex is not installed\. Falling back to Torch Norm",
        r"absl\.logging is not installed",
        r"full scope is deprecated",
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"`load_state_dict` is deprecated and will be removed",  # dist_checkpointing's torch strategy
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"The argument order of load has been changed",
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single",
        r"MimoModelConfig is experimental",
    ):
        warnings.filterwarnings("ignore", message=message)
    for logger, prefix in (("megatron.core.transformer.transformer_layer", "Unknown MLP type"),
                           ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
                           ("megatron.core.distributed.distributed_data_parallel",
                            "DistributedDataParallel: full_param_layout not provided"),
                           ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated")):
        logging.getLogger(logger).addFilter(lambda record, prefix=prefix: not record.getMessage().startswith(prefix))
