"""Memory a fine-tuning run needs per rank for its parameters, gradients and optimizer state,
estimated from the recipe's config and the parallel layout before anything is built, so that
``finetune.py`` refuses a recipe too big for the machine with the numbers instead of being
OOM-killed minutes later.

Counted as ``finetune.py`` builds the run: Megatron DDP's gradient buffers in fp32
(``grad_reduce_in_fp32``), the distributed optimizer's Adam moments (and fp32 master weights under
bf16) sharded over the data-parallel ranks (dense parameters) or the expert-data-parallel ranks
(experts). Activations, communication buffers and the framework itself come on top.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class StageParameters:
    """One pipeline stage's parameters on one rank: ``dense`` (replicated over data parallelism)
    and ``expert`` (this rank's share of the routed experts)."""

    dense: int
    expert: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the heaviest pipeline stage."""

    parameters: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _norm(config, width: int) -> int:
    return width * (2 if config.normalization == "LayerNorm" else 1)


def _attention(config) -> int:
    """Self-attention's parameters: GQA (with gpt-oss's learnable softmax offsets) or MLA."""
    h, heads = config.hidden_size, config.num_attention_heads
    out_bias = h if config.add_bias_linear else 0
    if config.multi_latent_attention:
        qk = config.qk_head_dim + config.qk_pos_emb_head_dim
        if config.q_lora_rank is None:
            q = h * heads * qk
        else:
            q = h * config.q_lora_rank + _norm(config, config.q_lora_rank) + config.q_lora_rank * heads * qk
        kv = (h * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + _norm(config, config.kv_lora_rank)
              + config.kv_lora_rank * heads * (config.qk_head_dim + config.v_head_dim))
        return q + kv + heads * config.v_head_dim * h + out_bias
    q_width = heads * config.kv_channels
    qkv_width = q_width + 2 * (config.num_query_groups or heads) * config.kv_channels
    qkv = h * qkv_width + (qkv_width if config.add_bias_linear or config.add_qkv_bias else 0)
    qk_norms = 2 * _norm(config, config.kv_channels) if config.qk_layernorm else 0
    offsets = heads if config.softmax_type == "learnable" else 0
    return qkv + q_width * h + out_bias + qk_norms + offsets


def _mlp(config, ffn: int) -> int:
    fc1 = ffn * (2 if config.gated_linear_unit else 1)
    bias = fc1 + config.hidden_size if config.add_bias_linear else 0
    return config.hidden_size * fc1 + ffn * config.hidden_size + bias


def _layer(config, moe: bool, ep: int) -> StageParameters:
    """One transformer layer: norms, attention and a dense MLP or a MoE layer (router, shared expert,
    1/EP of the routed experts)."""
    dense = 2 * _norm(config, config.hidden_size) + _attention(config)
    if not moe:
        return StageParameters(dense + _mlp(config, config.ffn_hidden_size), 0)
    h, experts = config.hidden_size, config.num_moe_experts
    dense += experts * h + (experts if config.add_bias_linear else 0)  # router
    if config.moe_shared_expert_intermediate_size:
        dense += _mlp(config, config.moe_shared_expert_intermediate_size)
        dense += h if config.moe_shared_expert_gate else 0
    return StageParameters(dense, experts // ep * _mlp(config, config.moe_ffn_hidden_size))


def _is_moe_layer(config, index: int) -> bool:
    freq = config.moe_layer_freq
    return bool(freq[index]) if isinstance(freq, (list, tuple)) else index % freq == 0


def stage_parameters(recipe, tp: int, pp: int, ep: int) -> list[StageParameters]:
    """Parameters on one rank of each pipeline stage (embedding on the first; output layer, final
    norm and MTP layers, with an embedding of their own under PP, on the last). Tensor parallelism
    divides the dense parameters (its replicated norms are ignored), expert parallelism the routed
    experts."""
    config = recipe.config
    h = config.hidden_size
    per_stage = -(-config.num_layers // pp)
    stages = []
    for stage in range(pp):
        layers = range(stage * per_stage, min((stage + 1) * per_stage, config.num_layers))
        parts = [_layer(config, config.num_moe_experts is not None and _is_moe_layer(config, i), ep) for i in layers]
        dense, expert = sum(p.dense for p in parts), sum(p.expert for p in parts)
        if stage == 0:
            dense += recipe.vocab_size * h
            if recipe.position_embedding_type == "learned_absolute":
                dense += recipe.max_sequence_length * h
        if stage == pp - 1:
            dense += _norm(config, h)
            if not recipe.share_embeddings_and_output_weights or pp > 1:  # PP keeps a copy on the last stage
                dense += recipe.vocab_size * h
            if config.mtp_num_layers and pp > 1:  # MTP embeds the next tokens: the last stage keeps an embedding
                dense += recipe.vocab_size * h
            for _ in range(config.mtp_num_layers or 0):  # enorm, hnorm, eh_proj, a layer like the last, its norm
                mtp = _layer(config, config.num_moe_experts is not None and _is_moe_layer(config, config.num_layers - 1), ep)
                dense += 3 * _norm(config, h) + 2 * h * h + mtp.dense
                expert += mtp.expert
        stages.append(StageParameters(dense // tp, expert))
    return stages


def estimate_training_memory(recipe, tp: int, pp: int, ep: int, dp: int, dtype: torch.dtype) -> MemoryEstimate:
    """Parameters, fp32 gradient buffers and distributed-optimizer Adam state (moments, plus fp32
    master weights for 16-bit parameters) per rank, on the heaviest pipeline stage."""
    param_size = torch.finfo(dtype).bits // 8
    adam_size = 8 + (4 if param_size < 4 else 0)
    expert_dp = max(1, dp * tp // ep)  # ranks sharing one expert shard (expert tensor parallelism is 1)
    estimates = [
        MemoryEstimate(
            parameters=s.dense + s.expert,
            param_bytes=(s.dense + s.expert) * param_size,
            grad_bytes=(s.dense + s.expert) * 4,
            optimizer_bytes=s.dense * adam_size // dp + s.expert * adam_size // expert_dp,
        )
        for s in stage_parameters(recipe, tp, pp, ep)
    ]
    return max(estimates, key=lambda e: e.total_bytes)


def available_memory(device: torch.device) -> tuple[int, int, str]:
    """(bytes available, ranks sharing them, what they are): the GPU's free memory for this rank,
    or the host's available memory shared by this node's ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), 1, f"free on {device}"
    import psutil

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return int(psutil.virtual_memory().available), ranks, "available in host memory"


def memory_shortfall(name: str, estimate: MemoryEstimate, available: int, ranks: int, what: str) -> str | None:
    """One line saying why ``estimate`` x ``ranks`` cannot fit in ``available`` bytes (None if it fits)."""
    needed = estimate.total_bytes * ranks
    if needed <= available:
        return None
    on_node = f" x {ranks} ranks on this node = {needed / GIB:,.1f} GiB" if ranks > 1 else ""
    return (f"{name} needs about {estimate.total_bytes / GIB:,.1f} GiB per rank before activations "
            f"({estimate.parameters / 1e9:,.2f} B parameters {estimate.param_bytes / GIB:,.1f} GiB, fp32 gradients "
            f"{estimate.grad_bytes / GIB:,.1f} GiB, Adam state {estimate.optimizer_bytes / GIB:,.1f} GiB){on_node}, "
            f"but {available / GIB:,.1f} GiB is {what}")
