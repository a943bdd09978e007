"""LLEPConfig validation and the cost model's behaviour (no process group)."""

import math

import pytest

from megatron_llep.config import LLEPConfig
from megatron_llep.cost_model import CostModel, ExpertShape


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=-1.0), "alpha"),
        (dict(alpha=math.inf), "alpha"),
        (dict(min_chunk_tokens=-1), "min_chunk_tokens"),
        (dict(min_chunk_tokens=1.5), "min_chunk_tokens"),
        (dict(imbalance_threshold=0.9), "imbalance_threshold"),
        (dict(ranks_per_node=0), "ranks_per_node"),
        (dict(cost_model="h200"), "cost_model"),
    ],
)
def test_bad_knobs_are_rejected_with_the_knob_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LLEPConfig(**kwargs)


def test_layout_validation():
    config = LLEPConfig()
    assert config.validate_layout(num_experts=128, ep_size=8) == 16
    with pytest.raises(ValueError, match="not divisible"):
        config.validate_layout(num_experts=10, ep_size=4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        LLEPConfig(ranks_per_node=3).validate_layout(num_experts=16, ep_size=8)


def test_defaults_match_the_paper():
    config = LLEPConfig()
    assert (config.alpha, config.min_chunk_tokens, config.imbalance_threshold) == (1.0, 1024, 1.3)


GPT_OSS_120B = ExpertShape(hidden_size=2880, ffn_hidden_size=2880, gated=True, bias=True, dtype_bytes=2)


def test_expert_shape_sizes():
    # fc1 2880 x 5760 + fc2 2880 x 2880 + biases 5760 + 2880, in bf16
    assert GPT_OSS_120B.num_params == 2880 * 5760 + 2880 * 2880 + 5760 + 2880
    assert GPT_OSS_120B.weight_bytes == 2 * GPT_OSS_120B.num_params
    assert GPT_OSS_120B.forward_flops(10) == 2 * 10 * (2880 * 5760 + 2880 * 2880)
    with pytest.raises(ValueError):
        ExpertShape(hidden_size=0, ffn_hidden_size=4)


def test_gemm_time_grows_and_small_gemms_are_less_efficient():
    model = CostModel()
    times = [model.gemm_time(t, GPT_OSS_120B) for t in (1, 64, 1024, 16384)]
    assert times == sorted(times)
    per_token = [t / n for t, n in zip(times, (1, 64, 1024, 16384))]
    assert per_token == sorted(per_token, reverse=True)
    assert model.gemm_time(0, GPT_OSS_120B) == 0.0


def test_spill_pays_only_for_enough_tokens():
    model = CostModel()
    assert not model.spill_pays(16, 16, GPT_OSS_120B, inter_node=False, needs_weights=True)
    assert model.spill_pays(32768, 0, GPT_OSS_120B, inter_node=False, needs_weights=True)
    # weights already there (second chunk to the same helper): cheaper
    assert model.spill_time(100, GPT_OSS_120B, False, False) < model.spill_time(100, GPT_OSS_120B, False, True)
    # crossing nodes is slower
    assert model.spill_time(100, GPT_OSS_120B, True, True) > model.spill_time(100, GPT_OSS_120B, False, True)


def test_calibration_recovers_a_known_model():
    truth = CostModel(gemm_tflops=321.0, gemm_half_efficiency_tokens=128.0, gemm_launch_s=8e-6,
                      intra_node_gbps=123.0, link_latency_s=5e-6)
    gemm = [(t, truth.gemm_time(t, GPT_OSS_120B)) for t in (64, 256, 1024, 4096, 16384)]
    links = [(b, truth.link_time(b, False)) for b in (1e6, 1e7, 1e8)]
    fitted = CostModel.calibrate(gemm, GPT_OSS_120B, link_samples=links)
    assert fitted.intra_node_gbps == pytest.approx(123.0, rel=1e-6)
    assert fitted.link_latency_s == pytest.approx(5e-6, rel=1e-3)
    for tokens, seconds in gemm:
        assert fitted.gemm_time(tokens, GPT_OSS_120B) == pytest.approx(seconds, rel=0.15)
    with pytest.raises(ValueError):
        CostModel.calibrate([], GPT_OSS_120B, link_samples=[(1e6, 1e-3), (1e6, 2e-3)])


def test_spill_oracle_agrees_with_spill_pays():
    for model in (CostModel(), CostModel(training=True, inter_node_gbps=10.0)):
        oracle = model.spill_oracle(GPT_OSS_120B)
        for tokens in (0, 1, 100, 1000, 5000, 50000):
            for moved in (0, tokens // 2, tokens):
                for inter in (False, True):
                    for weights in (False, True):
                        expected = model.spill_pays(tokens, moved, GPT_OSS_120B, inter, weights) if tokens else False
                        assert oracle(tokens, moved, inter, weights) == expected
