"""Model recipes: Megatron-Core TransformerConfigs for gpt-oss-20b/120b and DeepSeek-V3 with the
exact values of SPEC section 4 (every field set explicitly), tiny variants of the same
architectures for CPU, and the Kimi-K2 MoE-layer shape.

A :class:`Recipe` bundles the config with what ``GPTModel`` needs besides it (vocabulary, position
embedding, rotary base, sequence length, tied embeddings) and the layer spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_llep.compat.local_mla_attention import use_local_mla_attention

try:  # Transformer Engine is an optional GPU extra
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


@dataclass
class GptOssTransformerConfig(TransformerConfig):
    """TransformerConfig plus the YaRN fields ``GPTModel(position_embedding_type="yarn")`` reads
    (Megatron-Core 0.16 reads them with ``getattr`` but does not declare them)."""

    yarn_rotary_scaling_factor: float = 32.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # gpt-oss's YaRN does not round the correction range ("truncate": false)
    yarn_correction_range_round_to_int: bool = False


@dataclass
class Recipe:
    """A model: its TransformerConfig and the GPTModel arguments that are not config fields."""

    name: str
    config: TransformerConfig
    vocab_size: int
    max_sequence_length: int
    position_embedding_type: str
    rotary_base: float
    share_embeddings_and_output_weights: bool = False
    notes: list[str] = field(default_factory=list)

    def layer_spec(self, use_transformer_engine: Optional[bool] = None):
        """Megatron's decoder block spec for this config (local modules without TE)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        use_te = HAVE_TE if use_transformer_engine is None else use_transformer_engine
        if use_te and not HAVE_TE:
            raise RuntimeError(f"{self.name}: use_transformer_engine=True but transformer-engine is not installed")
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=use_te, normalization=self.config.normalization)
        if self.config.multi_latent_attention and not use_te:
            use_local_mla_attention(spec)
        return spec

    def mtp_spec(self, decoder_spec, use_transformer_engine: Optional[bool] = None):
        """Multi-token-prediction block spec (``None`` without MTP layers)."""
        if not self.config.mtp_num_layers:
            return None
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        use_te = HAVE_TE if use_transformer_engine is None else use_transformer_engine
        spec = get_gpt_mtp_block_spec(self.config, decoder_spec, use_transformer_engine=use_te)
        if self.config.multi_latent_attention and not use_te:
            use_local_mla_attention(spec)
        return spec

    def gpt_model_kwargs(self) -> dict:
        return dict(
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            position_embedding_type=self.position_embedding_type,
            rotary_base=self.rotary_base,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
        )


def _parallel_and_precision(ep_size: int, tp_size: int, pp_size: int, dtype: torch.dtype, cpu: bool) -> dict:
    return dict(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
        sequence_parallel=tp_size > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        use_cpu_initialization=cpu,
        # fused wgrad needs the APEX/TE CUDA extension
        gradient_accumulation_fusion=HAVE_TE and not cpu,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=HAVE_TE and not cpu,
        moe_permute_fusion=HAVE_TE and not cpu,
        moe_router_fusion=False,
        bias_activation_fusion=not cpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        moe_enable_routing_replay=cpu,  # CPU demos can force routing through Megatron's replay
    )


def gpt_oss(
    variant: str = "20b",
    ep_size: int = 1,
    tp_size: int = 1,
    pp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    cpu: bool = False,
) -> Recipe:
    """gpt-oss-20b (24 layers, 32 experts), gpt-oss-120b (36 layers, 128 experts), or ``tiny``
    (the same architecture at CPU size: 2 layers, 8 experts, width 64)."""
    sizes = {
        "20b": dict(num_layers=24, num_moe_experts=32, hidden_size=2880, moe_ffn_hidden_size=2880,
                    num_attention_heads=64, num_query_groups=8, kv_channels=64, vocab=201088),
        "120b": dict(num_layers=36, num_moe_experts=128, hidden_size=2880, moe_ffn_hidden_size=2880,
                     num_attention_heads=64, num_query_groups=8, kv_channels=64, vocab=201088),
        "tiny": dict(num_layers=2, num_moe_experts=8, hidden_size=64, moe_ffn_hidden_size=64,
                     num_attention_heads=8, num_query_groups=2, kv_channels=8, vocab=512),
    }
    if variant not in sizes:
        raise ValueError(f"gpt-oss variant must be one of {sorted(sizes)}, got {variant!r}")
    size = sizes[variant]
    vocab = size.pop("vocab")
    config = GptOssTransformerConfig(
        **size,
        ffn_hidden_size=size["moe_ffn_hidden_size"],
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        add_bias_linear=True,
        add_qkv_bias=False,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=7.0,
        softmax_type="learnable",  # attention sinks
        window_size=(127, 0),
        window_attn_skip_freq=2,  # sliding window on alternating layers
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_router_topk=4,
        moe_router_pre_softmax=False,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=None,
        moe_router_dtype="fp32",
        moe_layer_freq=1,
        init_method_std=0.02,
        **_parallel_and_precision(ep_size, tp_size, pp_size, dtype, cpu),
    )
    return Recipe(
        name=f"gpt-oss-{variant}",
        config=config,
        vocab_size=vocab,
        max_sequence_length=131072 if variant != "tiny" else 512,
        position_embedding_type="yarn",
        rotary_base=150000,
        share_embeddings_and_output_weights=False,
    )


def deepseek_v3(
    variant: str = "671b",
    ep_size: int = 1,
    tp_size: int = 1,
    pp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    cpu: bool = False,
) -> Recipe:
    """DeepSeek-V3 (61 layers, the first 3 dense, 256 routed experts + 1 shared, MLA, MTP), or
    ``tiny`` (same architecture at CPU size: 4 layers with the first dense, 8 experts)."""
    if variant == "671b":
        size = dict(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, moe_ffn_hidden_size=2048,
                    num_moe_experts=256, moe_shared_expert_intermediate_size=2048, num_attention_heads=128,
                    q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                    moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk=8)
        dense_layers, vocab, seq = 3, 129280, 163840
    elif variant == "tiny":
        size = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=32,
                    num_moe_experts=8, moe_shared_expert_intermediate_size=32, num_attention_heads=4,
                    q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                    moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=2)
        dense_layers, vocab, seq = 1, 512, 512
    else:
        raise ValueError(f"DeepSeek-V3 variant must be '671b' or 'tiny', got {variant!r}")
    config = MLATransformerConfig(
        **size,
        moe_layer_freq=[0] * dense_layers + [1] * (size["num_layers"] - dense_layers),
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        multi_latent_attention=True,
        rope_type="yarn",
        rotary_base=10000,
        rotary_scaling_factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_topk_scaling_factor=2.5,
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4,
        moe_router_dtype="fp32",
        moe_shared_expert_overlap=False,
        mtp_num_layers=1,
        mtp_loss_scaling_factor=0.1,
        init_method_std=0.006,
        **_parallel_and_precision(ep_size, tp_size, pp_size, dtype, cpu),
    )
    return Recipe(
        name=f"deepseek-v3-{variant}",
        config=config,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",  # MLA builds its YaRN rotary embedding from the config
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    )


@dataclass(frozen=True)
class MoELayerShape:
    """A MoE layer's shape (for layer benchmarks of models without a full recipe)."""

    name: str
    num_experts: int
    hidden: int
    ffn: int
    topk: int


KIMI_K2_MOE_LAYER = MoELayerShape("kimi-k2", num_experts=384, hidden=7168, ffn=2048, topk=8)

RECIPES: dict[str, Callable[..., Recipe]] = {
    "gpt-oss-20b": lambda **kw: gpt_oss("20b", **kw),
    "gpt-oss-120b": lambda **kw: gpt_oss("120b", **kw),
    "gpt-oss-tiny": lambda **kw: gpt_oss("tiny", **kw),
    "deepseek-v3": lambda **kw: deepseek_v3("671b", **kw),
    "deepseek-v3-tiny": lambda **kw: deepseek_v3("tiny", **kw),
}


def config_fields(config: TransformerConfig) -> dict:
    """Every dataclass field of a config with its value (for logging and tests)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
