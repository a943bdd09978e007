"""TransformerConfig builders for the models megatron-llep ships recipes for."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig


def tiny_moe(ep_size: int, num_experts: int = 8, topk: int = 2, num_layers: int = 2) -> TransformerConfig:
    """A CPU-sized GPT with MoE layers (SwiGLU experts), for the default job and tests."""
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_moe_experts=num_experts,
        moe_ffn_hidden_size=48,
        moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_enable_routing_replay=True,
        expert_model_parallel_size=ep_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
    )
