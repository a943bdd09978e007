"""Model recipes: Megatron-Core TransformerConfigs for gpt-oss-20b/120b and DeepSeek-V3 with the
exact values of the published configurations (every field set explicitly), tiny variants of the same
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

from recipes.models.local_mla_attention import use_local_mla_attention
from recipes.models.mla_latent_norms import DEEPSEEK_LATENT_NORM_EPS, exact_mla_latent_norms

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
    # MLA as DeepSeek builds it (recipes/models/mla_latent_norms.py): the q/kv latent norms' eps
    # (1e-6 whatever layernorm_epsilon) and no query norm without a query LoRA; None: Megatron-Core's
    # own MLA spec (e.g. a Megatron-LM checkpoint's model, recipes/runtime/pretrained.py)
    mla_latent_norm_eps: Optional[float] = None

    def _mla(self, spec, use_te: bool):
        if self.config.multi_latent_attention:
            if not use_te:
                use_local_mla_attention(spec)
            if self.mla_latent_norm_eps is not None:
                exact_mla_latent_norms(spec, self.config, self.mla_latent_norm_eps)
        return spec

    def layer_spec(self, use_transformer_engine: Optional[bool] = None):
        """Megatron's decoder block spec for this config (local modules without TE)."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        use_te = HAVE_TE if use_transformer_engine is None else use_transformer_engine
        if use_te and not HAVE_TE:
            raise RuntimeError(f"{self.name}: use_transformer_engine=True but transformer-engine is not installed")
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=use_te, normalization=self.config.normalization)
        return self._mla(spec, use_te)

    def mtp_spec(self, decoder_spec, use_transformer_engine: Optional[bool] = None):
        """Multi-token-prediction block spec (``None`` without MTP layers)."""
        if not self.config.mtp_num_layers:
            return None
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        use_te = HAVE_TE if use_transformer_engine is None else use_transformer_engine
        spec = get_gpt_mtp_block_spec(self.config, decoder_spec, use_transformer_engine=use_te)
        return self._mla(spec, use_te)

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
        # torch norms (CPU) refuse sequence parallelism; without it Megatron's MoE layer runs TP > 1 only in eval
        sequence_parallel=tp_size > 1 and not cpu,
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


# gpt-oss sizes per variant; ``gpt_oss(sizes=...)`` takes the same keys (e.g. from a Hugging Face
# config.json, recipes/hf/tables/gpt_oss.py).
GPT_OSS_SIZES: dict[str, dict] = {
    "20b": dict(num_layers=24, num_moe_experts=32, hidden_size=2880, moe_ffn_hidden_size=2880,
                num_attention_heads=64, num_query_groups=8, kv_channels=64, vocab_size=201088,
                max_sequence_length=131072),
    "120b": dict(num_layers=36, num_moe_experts=128, hidden_size=2880, moe_ffn_hidden_size=2880,
                 num_attention_heads=64, num_query_groups=8, kv_channels=64, vocab_size=201088,
                 max_sequence_length=131072),
    "tiny": dict(num_layers=2, num_moe_experts=8, hidden_size=64, moe_ffn_hidden_size=64,
                 num_attention_heads=8, num_query_groups=2, kv_channels=8, vocab_size=512,
                 max_sequence_length=512),
}

# gpt-oss's values of the architecture fields a Hugging Face config.json may also set (the published configurations).
# ``sliding_window`` counts the attended positions including the query's own (Hugging Face's meaning:
# Megatron's window_size is (sliding_window - 1, 0)); ``sliding_layers`` lists per layer whether it
# slides (None: every other layer starting with the first, Hugging Face's default layer_types).
GPT_OSS_ARCHITECTURE: dict = dict(
    moe_router_topk=4, sliding_window=128, sliding_layers=None, layernorm_epsilon=1e-5, activation_func_clamp_value=7.0,
    rotary_base=150000, yarn_rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0, yarn_correction_range_round_to_int=False,
)


def check_gpt_oss_expert_math(config: TransformerConfig) -> None:
    """gpt-oss clamps fc1's output AFTER adding its bias (glu = min(glu, 7), lin = clamp(lin, -7, 7)).
    Megatron-Core's fused bias + quick-GEGLU (``weighted_bias_quick_geglu_impl``, taken by ``MLP`` and
    ``SequentialMLP`` experts when ``bias_activation_fusion`` is on: their fc1 returns the bias
    separately) clamps BEFORE adding it, a different function. Raises ValueError for that combination."""
    if (config.bias_activation_fusion and config.add_bias_linear and config.gated_linear_unit
            and config.activation_func_clamp_value is not None):
        raise ValueError("bias_activation_fusion=True with a biased, clamped GLU: Megatron-Core's fused bias + "
                         "quick-GEGLU clamps before adding fc1's bias, gpt-oss after; set bias_activation_fusion=False")


def gpt_oss(
    variant: str = "20b",
    ep_size: int = 1,
    tp_size: int = 1,
    pp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    cpu: bool = False,
    sizes: Optional[dict] = None,
    architecture: Optional[dict] = None,
    name: Optional[str] = None,
) -> Recipe:
    """gpt-oss-20b (24 layers, 32 experts), gpt-oss-120b (36 layers, 128 experts), or ``tiny``
    (the same architecture at CPU size: 2 layers, 8 experts, width 64).

    ``sizes`` / ``architecture`` override entries of :data:`GPT_OSS_SIZES` [variant] /
    :data:`GPT_OSS_ARCHITECTURE` (any gpt-oss-architecture model, e.g. from a Hugging Face
    config.json: :func:`recipes.hf.tables.gpt_oss.recipe_from_hf_config`); ``name`` names the recipe.

    Every path computes gpt-oss's expert function: bias-activation fusion is off (see
    :func:`check_gpt_oss_expert_math`), on GPU too."""
    if variant not in GPT_OSS_SIZES:
        raise ValueError(f"gpt-oss variant must be one of {sorted(GPT_OSS_SIZES)}, got {variant!r}")
    size = dict(GPT_OSS_SIZES[variant])
    unknown = sorted(set(sizes or {}) - set(size)) + sorted(set(architecture or {}) - set(GPT_OSS_ARCHITECTURE))
    if unknown:
        raise ValueError(f"gpt_oss(): unknown size/architecture keys {unknown}")
    size.update(sizes or {})
    arch = dict(GPT_OSS_ARCHITECTURE, **(architecture or {}))
    vocab, max_seq = size.pop("vocab_size"), size.pop("max_sequence_length")
    layers = size["num_layers"]
    sliding = arch["sliding_layers"]
    if sliding is None or list(sliding) == [i % 2 == 0 for i in range(layers)]:
        skip_freq = 2  # sliding window on alternating layers (Megatron: layer numbers not divisible by 2)
    else:
        if len(sliding) != layers:
            raise ValueError(f"sliding_layers has {len(sliding)} entries for {layers} layers")
        skip_freq = [int(bool(s)) for s in sliding]  # Megatron's per-layer list: 1 = sliding window
    precision = _parallel_and_precision(ep_size, tp_size, pp_size, dtype, cpu)
    precision["bias_activation_fusion"] = False  # see check_gpt_oss_expert_math
    config = GptOssTransformerConfig(
        **size,
        ffn_hidden_size=size["moe_ffn_hidden_size"],
        normalization="RMSNorm",
        layernorm_epsilon=arch["layernorm_epsilon"],
        gated_linear_unit=True,
        add_bias_linear=True,
        add_qkv_bias=False,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=arch["activation_func_clamp_value"],
        softmax_type="learnable",  # attention sinks
        window_size=(arch["sliding_window"] - 1, 0),
        window_attn_skip_freq=skip_freq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_router_topk=arch["moe_router_topk"],
        moe_router_pre_softmax=False,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=None,
        moe_router_dtype="fp32",
        moe_layer_freq=1,
        init_method_std=0.02,
        yarn_rotary_scaling_factor=arch["yarn_rotary_scaling_factor"],
        yarn_original_max_position_embeddings=arch["yarn_original_max_position_embeddings"],
        yarn_beta_fast=arch["yarn_beta_fast"],
        yarn_beta_slow=arch["yarn_beta_slow"],
        yarn_mscale=arch["yarn_mscale"],
        yarn_mscale_all_dim=arch["yarn_mscale_all_dim"],
        yarn_correction_range_round_to_int=arch["yarn_correction_range_round_to_int"],
        **precision,
    )
    check_gpt_oss_expert_math(config)
    return Recipe(
        name=name or f"gpt-oss-{variant}",
        config=config,
        vocab_size=vocab,
        max_sequence_length=max_seq,
        position_embedding_type="yarn",
        rotary_base=arch["rotary_base"],
        share_embeddings_and_output_weights=False,
        mla_latent_norm_eps=DEEPSEEK_LATENT_NORM_EPS,
    )


# DeepSeek-V3 sizes per variant; ``deepseek_v3(sizes=...)`` takes the same keys (e.g. from a Hugging
# Face config.json, recipes/hf/tables/deepseek_v3.py). ``dense_layers``: the first k layers have a dense MLP.
DEEPSEEK_V3_SIZES: dict[str, dict] = {
    "671b": dict(num_layers=61, dense_layers=3, hidden_size=7168, ffn_hidden_size=18432, moe_ffn_hidden_size=2048,
                 num_moe_experts=256, moe_shared_expert_intermediate_size=2048, num_attention_heads=128,
                 q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                 moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk=8, vocab_size=129280,
                 max_sequence_length=163840),
    # 8 experts in 2 groups of 4, 1 group kept, top-2 inside it: 2 // 1 = 2 experts score a group,
    # as DeepSeek-V3 does (see check_deepseek_group_routing)
    "tiny": dict(num_layers=4, dense_layers=1, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=32,
                 num_moe_experts=8, moe_shared_expert_intermediate_size=32, num_attention_heads=4,
                 q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                 moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk=2, vocab_size=512,
                 max_sequence_length=512),
}

# DeepSeek-V3's values of the fields a Hugging Face config.json may also set (the published configurations)
DEEPSEEK_V3_ARCHITECTURE: dict = dict(
    layernorm_epsilon=1e-6, moe_router_topk_scaling_factor=2.5, rope_type="yarn", rotary_base=10000,
    rotary_scaling_factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
    mscale_all_dim=1.0, mtp_num_layers=1,
)


def check_deepseek_group_routing(topk: int, num_groups: Optional[int], group_topk: Optional[int],
                                 num_experts: int, names=("moe_router_topk", "moe_router_num_groups",
                                                          "moe_router_group_topk")) -> None:
    """DeepSeek-V3 scores a routing group by the sum of its top-2 (bias-corrected) expert scores;
    Megatron-Core by the sum of its top ``topk // group_topk``. The two agree only when that is 2
    (or when no group is dropped). Raises ValueError naming the fields otherwise."""
    topk_name, groups_name, group_topk_name = names
    if not num_groups or not group_topk:
        return
    if num_experts % num_groups:
        raise ValueError(f"{groups_name} = {num_groups} does not divide the {num_experts} experts")
    if not 0 < group_topk <= num_groups:
        raise ValueError(f"{group_topk_name} = {group_topk} must be in 1..{groups_name} = {num_groups}")
    if num_experts // num_groups < 2:
        raise ValueError(f"DeepSeek-V3 routing scores a group by its top-2 experts: {groups_name} = {num_groups} "
                         f"leaves {num_experts // num_groups} expert per group")
    if group_topk < num_groups and topk // group_topk != 2:
        raise ValueError(
            f"DeepSeek-V3 routing scores a group by the sum of its top-2 expert scores, Megatron-Core by its top "
            f"{topk_name} // {group_topk_name} = {topk} // {group_topk} = {topk // group_topk}: choose "
            f"{topk_name} and {group_topk_name} with {topk_name} // {group_topk_name} == 2 (DeepSeek-V3: 8 // 4)")


def deepseek_v3(
    variant: str = "671b",
    ep_size: int = 1,
    tp_size: int = 1,
    pp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    cpu: bool = False,
    sizes: Optional[dict] = None,
    architecture: Optional[dict] = None,
) -> Recipe:
    """DeepSeek-V3 (61 layers, the first 3 dense, 256 routed experts + 1 shared, MLA, MTP), or
    ``tiny`` (same architecture at CPU size: 4 layers with the first dense, 8 experts).

    ``sizes`` (every key of ``DEEPSEEK_V3_SIZES["671b"]``) and ``architecture`` (keys of
    ``DEEPSEEK_V3_ARCHITECTURE``, the rest keep DeepSeek-V3's values) build another model of the
    architecture, named ``deepseek-v3-<variant>`` (recipes/hf/tables/deepseek_v3.py: from a config.json)."""
    if sizes is not None:
        missing = sorted(set(DEEPSEEK_V3_SIZES["671b"]) - set(sizes))
        unknown = sorted(set(sizes) - set(DEEPSEEK_V3_SIZES["671b"]))
        if missing or unknown:
            raise ValueError(f"DeepSeek-V3 sizes: missing {missing}, unknown {unknown}")
        size = dict(sizes)
    elif variant in DEEPSEEK_V3_SIZES:
        size = dict(DEEPSEEK_V3_SIZES[variant])
    else:
        raise ValueError(f"DeepSeek-V3 variant must be '671b' or 'tiny', got {variant!r}")
    arch = dict(DEEPSEEK_V3_ARCHITECTURE)
    unknown = sorted(set(architecture or {}) - set(arch))
    if unknown:
        raise ValueError(f"DeepSeek-V3 architecture: unknown fields {unknown}")
    arch.update(architecture or {})
    arch["mtp_num_layers"] = arch["mtp_num_layers"] or None  # Megatron-Core: None, not 0, means no MTP
    dense_layers, vocab, seq = size.pop("dense_layers"), size.pop("vocab_size"), size.pop("max_sequence_length")
    if not 0 <= dense_layers <= size["num_layers"]:
        raise ValueError(f"dense_layers = {dense_layers} must be in 0..num_layers = {size['num_layers']}")
    check_deepseek_group_routing(size["moe_router_topk"], size["moe_router_num_groups"],
                                 size["moe_router_group_topk"], size["num_moe_experts"])
    config = MLATransformerConfig(
        **size,
        **arch,
        moe_layer_freq=[0] * dense_layers + [1] * (size["num_layers"] - dense_layers),
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        multi_latent_attention=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4,
        moe_router_dtype="fp32",
        moe_shared_expert_overlap=False,
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
        rotary_base=arch["rotary_base"],
        share_embeddings_and_output_weights=False,
        mla_latent_norm_eps=DEEPSEEK_LATENT_NORM_EPS,
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
