"""An independent dense float64 MoE (router + all experts, no dispatcher) to check layers against."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


def expert_forward_reference(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: Optional[torch.Tensor],
    fc2_weight: torch.Tensor,
    fc2_bias: Optional[torch.Tensor],
    prob: torch.Tensor,
    config: TransformerConfig,
) -> torch.Tensor:
    """One expert on rows ``x`` weighted by ``prob`` (``[T]``), written from the model definition.

    Megatron's fused bias+GLU path clamps the fc1 output *before* adding the bias, the unfused path
    after; both are modelled, selected by ``config.bias_activation_fusion``.
    """
    h = x @ fc1_weight.t()
    clamp = config.activation_func_clamp_value
    fused = config.bias_activation_fusion and fc1_bias is not None

    def clamp_halves(z: torch.Tensor) -> torch.Tensor:
        if clamp is None or not config.gated_linear_unit:
            return z
        z_glu, z_lin = z.chunk(2, dim=-1)
        return torch.cat([z_glu.clamp(max=clamp), z_lin.clamp(min=-clamp, max=clamp)], dim=-1)

    if fused:
        h = clamp_halves(h) + fc1_bias
    else:
        if fc1_bias is not None:
            h = h + fc1_bias
        h = clamp_halves(h)
    if config.gated_linear_unit:
        h_glu, h_lin = h.chunk(2, dim=-1)
        act = config.activation_func(h_glu) * (h_lin + config.glu_linear_offset)
    else:
        act = config.activation_func(h)
    out = (act * prob[:, None]) @ fc2_weight.t()
    if fc2_bias is not None:
        out = out + fc2_bias * prob[:, None]
    return out


def dense_moe_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: Optional[torch.Tensor],
    expert_ids: torch.Tensor,
    experts: Sequence[dict[str, Optional[torch.Tensor]]],
    config: TransformerConfig,
) -> torch.Tensor:
    """``y = sum_k p_k * expert_{ids_k}(x)`` with softmax router probabilities (top-K then
    softmax, or softmax then top-K when ``config.moe_router_pre_softmax``).

    ``experts[e]`` holds ``fc1_weight [2H, D]``, ``fc1_bias``, ``fc2_weight [D, H]``, ``fc2_bias``
    (Megatron's layouts). All arithmetic happens in the dtype of ``x`` (use float64).
    """
    logits = x @ router_weight.t()
    if router_bias is not None:
        logits = logits + router_bias
    if config.moe_router_pre_softmax:
        probs = torch.softmax(logits, dim=-1).gather(1, expert_ids)
    else:
        probs = torch.softmax(logits.gather(1, expert_ids), dim=-1)
    y = torch.zeros_like(x)
    for e, weights in enumerate(experts):
        rows, slot = torch.nonzero(expert_ids == e, as_tuple=True)
        if rows.numel() == 0:
            # keep every expert in the autograd graph so its gradient is a (zero) tensor
            y = y + 0.0 * sum(w.sum() for w in weights.values() if w is not None)
            continue
        out = expert_forward_reference(x[rows], prob=probs[rows, slot], config=config, **weights)
        y = y.index_add(0, rows, out)
    return y
