"""Model recipes carry the published configurations' exact values (typed here from them, not read back from
the recipe code), and the tiny variants keep their architecture."""

import pytest

from recipes.models import KIMI_K2_MOE_LAYER, RECIPES, deepseek_v3, gpt_oss

GPT_OSS_COMMON = dict(
    hidden_size=2880, moe_ffn_hidden_size=2880, num_attention_heads=64, num_query_groups=8, kv_channels=64,
    normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=True, add_qkv_bias=False,
    glu_linear_offset=1.0, activation_func_clamp_value=7.0, softmax_type="learnable", window_size=(127, 0),
    window_attn_skip_freq=2, moe_router_topk=4, moe_router_pre_softmax=False, moe_router_score_function="softmax",
    moe_aux_loss_coeff=0.0, moe_shared_expert_intermediate_size=None,
    yarn_rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
)


@pytest.mark.parametrize("variant, layers, experts", [("20b", 24, 32), ("120b", 36, 128)])
def test_gpt_oss_matches_the_spec(variant, layers, experts):
    recipe = gpt_oss(variant, ep_size=8)
    config = recipe.config
    for name, value in dict(GPT_OSS_COMMON, num_layers=layers, num_moe_experts=experts).items():
        assert getattr(config, name) == value, name
    assert config.activation_func.__name__ == "quick_gelu"
    assert recipe.vocab_size == 201088 and not recipe.share_embeddings_and_output_weights
    assert recipe.position_embedding_type == "yarn" and recipe.rotary_base == 150000
    assert config.moe_router_load_balancing_type == "none"


def test_deepseek_v3_matches_the_spec():
    recipe = deepseek_v3("671b", ep_size=64)
    config = recipe.config
    expected = dict(
        num_layers=61, hidden_size=7168, ffn_hidden_size=18432, moe_ffn_hidden_size=2048, num_moe_experts=256,
        moe_shared_expert_intermediate_size=2048, moe_router_topk=8, moe_router_num_groups=8, moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
        moe_router_dtype="fp32", multi_latent_attention=True, num_attention_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True,
        rotary_scaling_factor=40, original_max_position_embeddings=4096, mscale=1.0, normalization="RMSNorm",
        layernorm_epsilon=1e-6, mtp_num_layers=1, mtp_loss_scaling_factor=0.1, init_method_std=0.006,
    )
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    assert config.moe_layer_freq == [0, 0, 0] + [1] * 58
    assert recipe.vocab_size == 129280


def test_kimi_k2_layer_shape():
    assert (KIMI_K2_MOE_LAYER.num_experts, KIMI_K2_MOE_LAYER.hidden, KIMI_K2_MOE_LAYER.ffn, KIMI_K2_MOE_LAYER.topk) == (
        384, 7168, 2048, 8)


@pytest.mark.parametrize("name, full", [("gpt-oss-tiny", "gpt-oss-20b"), ("deepseek-v3-tiny", "deepseek-v3")])
def test_tiny_variants_keep_the_architecture(name, full):
    tiny, big = RECIPES[name](cpu=True).config, RECIPES[full]().config
    for field in ("normalization", "gated_linear_unit", "add_bias_linear", "softmax_type", "window_attn_skip_freq",
                  "moe_router_score_function", "moe_router_enable_expert_bias", "multi_latent_attention",
                  "mtp_num_layers", "glu_linear_offset", "activation_func_clamp_value", "qk_layernorm"):
        assert getattr(tiny, field) == getattr(big, field), field


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="variant"):
        gpt_oss("7b")
    with pytest.raises(ValueError, match="variant"):
        deepseek_v3("v2")
