"""LLEPConfig validation and the cost model's behaviour (no process group)."""

import math

import pytest

from megatron_llep.config import LLEPConfig
from megatron_llep.planning.cost_model import CostModel, ExpertShape

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release


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


def test_link_time_is_latency_plus_bytes_over_bandwidth_and_crossing_nodes_is_slower():
    model = CostModel()
    assert model.link_time(0, True) == 0.0 and model.link_time(1, False) == model.link_latency_s + 1 / 400e9
    assert model.link_time(10**6, True) > model.link_time(10**6, False)


def test_training_prices_backward_too():
    """Training: GEMMs count forward and backward (3x the flops), the layer's bytes count twice."""
    import numpy as np

    from megatron_llep.planning import LayerTimeModel, plan_llep

    inference, training = CostModel(), CostModel(training=True)
    a, b = inference.gemm_coefficients(GPT_OSS_120B)
    ta, tb = training.gemm_coefficients(GPT_OSS_120B)
    assert tb == pytest.approx(3 * b) and ta - training.gemm_launch_s == pytest.approx(3 * (a - inference.gemm_launch_s))
    counts = np.zeros((2, 4), np.int64)
    counts[1, 0] = 4096  # plain EP: rank 1 sends 4096 tokens to rank 0
    plan = plan_llep(counts, LLEPConfig(imbalance_threshold=1e9, cost_aware=False))
    fwd = LayerTimeModel(counts, 2, GPT_OSS_120B, inference).phases(plan)
    both = LayerTimeModel(counts, 2, GPT_OSS_120B, training).phases(plan)
    tokens = 4096 * GPT_OSS_120B.token_bytes
    assert fwd["dispatch_s"] == inference.link_time(tokens, False)
    assert both["dispatch_s"] == training.link_time(2 * tokens, False)
    assert both["compute_s"] == training.gemm_time(4096, GPT_OSS_120B)


def test_cpu_preset_describes_a_slow_host():
    cpu, h200 = CostModel.cpu(), CostModel()
    assert cpu.gemm_time(1024, GPT_OSS_120B) > 100 * h200.gemm_time(1024, GPT_OSS_120B)
    assert cpu.link_time(1e6, False) > 10 * h200.link_time(1e6, False)


def test_finetune_and_the_library_agree_on_cost_aware():
    finetune = pytest.importorskip("recipes.finetune")  # imports torch and Megatron-Core
    assert LLEPConfig().cost_aware is True
    assert finetune.parse_args([]).llep_cost_aware is True
    assert finetune.parse_args(["--no-llep-cost-aware"]).llep_cost_aware is False


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
