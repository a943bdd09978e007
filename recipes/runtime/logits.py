"""Logits of a Megatron-Core ``GPTModel`` with multi-token-prediction (MTP) layers.

Such a model cannot simply be called without labels for its logits: Megatron-Core 0.16's
``GPTModel._postprocess`` clones the labels for the MTP loss (``None.clone()`` fails), and 0.19 runs
the MTP layers anyway and derives labels from the input ids. :func:`lm_logits` runs the main model
alone (the MTP block skipped, which both releases then treat as a model without MTP), for
evaluation, generation and checking an imported checkpoint; :func:`lm_and_mtp_logits` also returns
every MTP depth's logits (depth ``k`` predicts token ``i + k + 2`` at position ``i``).

Both work on the last pipeline stage's model chunk (the one holding the output layer and, with MTP,
the MTP block), under any DDP / Float16Module wrappers, on Megatron-Core 0.16 to 0.19; the logits
are gathered over tensor parallelism and returned as ``[batch, sequence, vocab]``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


def unwrap_gpt_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


@contextlib.contextmanager
def mtp_skipped(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block, the model's forward skips its MTP layers and returns the main logits
    without labels (loss with labels, as a model without MTP). The final norm stays where Megatron
    put it for MTP models (the decoder's last layer), so the main logits are unchanged. The
    config object is shared by every module: do not run another forward of this model concurrently."""
    gpt = unwrap_gpt_model(model)
    config = gpt.config
    saved = (getattr(gpt, "mtp_process", False), config.mtp_num_layers)
    gpt.mtp_process = False
    config.mtp_num_layers = None  # 0.16 tests "is not None", 0.19 truthiness
    try:
        yield model
    finally:
        gpt.mtp_process, config.mtp_num_layers = saved


def _position_ids(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)


def lm_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
              attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Next-token logits ``[batch, sequence, vocab]`` of the main model (MTP layers not run)."""
    with mtp_skipped(model):
        return model(input_ids, _position_ids(input_ids, position_ids), attention_mask, runtime_gather_output=True)


def lm_and_mtp_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                      attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The main logits and each MTP depth's logits (all ``[batch, sequence, vocab]``). MTP depth
    ``k`` sees the input shifted left by ``k + 1`` (Megatron's roll, the vacated tail filled
    with token 0), so its logits at position ``i`` predict token ``i + k + 2``. Runs the full
    forward once with labels (the returned loss is discarded) and reads the MTP block's output."""
    gpt = unwrap_gpt_model(model)
    if not getattr(gpt, "mtp_process", False):
        raise ValueError("lm_and_mtp_logits: this model chunk has no MTP block (mtp_num_layers unset, or not the "
                         "last pipeline stage)")
    captured: list[torch.Tensor] = []
    handle = gpt.mtp.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    labels = torch.roll(input_ids, shifts=-1, dims=-1)  # any labels: 0.16 needs them for the MTP branch
    try:
        model(input_ids, _position_ids(input_ids, position_ids), attention_mask, labels=labels)
    finally:
        handle.remove()
    (hidden,) = captured
    output_weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    chunks = torch.chunk(hidden, 1 + gpt.config.mtp_num_layers, dim=0)
    logits = []
    for chunk in chunks:
        out, _ = gpt.output_layer(chunk, weight=output_weight, runtime_gather_output=True)
        logits.append(out.transpose(0, 1).contiguous())  # [s, b, v] -> [b, s, v], as GPTModel returns
    return logits[0], logits[1:]
