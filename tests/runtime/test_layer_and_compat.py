"""Spec helpers, Megatron-config validation, and the CPU compatibility layer's scope."""

import subprocess
import sys
import textwrap

import pytest
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.compat import mcore
from megatron_llep.config import LLEPConfig
from megatron_llep.runtime.megatron_checks import check_megatron_config
from megatron_llep.runtime.layer import LLEPMoELayer, with_llep


def _constructor_keywords(node):
    # an MoE spec is a ModuleSpec before Megatron-Core 0.18 and a functools.partial from 0.18 on
    return node.params if isinstance(node, ModuleSpec) else node.keywords


def test_with_llep_swaps_every_moe_layer_and_keeps_the_original_spec():
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    config = LLEPConfig(min_chunk_tokens=16)
    llep_spec = with_llep(spec, config)
    mlp = llep_spec.submodules.mlp
    assert mcore.moe_layer_class(mlp) is LLEPMoELayer
    assert _constructor_keywords(mlp)["llep_config"] is config
    assert mcore.moe_submodules(mlp) is not mcore.moe_submodules(spec.submodules.mlp)  # a copy
    assert mcore.moe_layer_class(spec.submodules.mlp) is MoELayer  # the input spec is untouched
    assert "llep_config" not in _constructor_keywords(spec.submodules.mlp)


def test_with_llep_leaves_dense_layers_of_a_block_spec_alone():
    dense, moe = get_gpt_layer_local_spec(num_experts=None), get_gpt_layer_local_spec(num_experts=8)
    block = with_llep([dense, moe])
    assert mcore.moe_layer_class(block[0].submodules.mlp) is None
    assert mcore.moe_layer_class(block[1].submodules.mlp) is LLEPMoELayer


def test_with_llep_rejects_a_dense_spec():
    with pytest.raises(ValueError, match="no MoELayer"):
        with_llep(get_gpt_layer_local_spec(num_experts=None))


def _config(**overrides):
    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=8, moe_ffn_hidden_size=8,
                  moe_router_topk=2, moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False)
    fields.update(overrides)
    return TransformerConfig(**fields)


@pytest.mark.parametrize(
    "overrides, expert_tp, message",
    [
        (dict(moe_token_dispatcher_type="allgather"), 1, "alltoall"),
        (dict(), 2, "expert tensor parallel"),
        (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), 1, "pad"),
    ],
)
def test_unsupported_megatron_settings_are_named(overrides, expert_tp, message):
    with pytest.raises(ValueError, match=message):
        check_megatron_config(_config(**overrides), expert_tp)


# Settings of newer releases (0.18/0.19) are set after construction: their own validation needs
# Transformer Engine or CUDA, and on older releases the fields do not exist at all.
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("delay_wgrad_compute", True, "delay_wgrad_compute"),
        ("overlap_dispatch_backward_with_experts_wgrad", True, "overlap_dispatch_backward_with_experts_wgrad"),
        ("use_transformer_engine_op_fuser", True, "use_transformer_engine_op_fuser"),
        ("moe_single_grouped_weight", True, "moe_single_grouped_weight"),
        ("moe_paged_stash", True, "moe_paged_stash"),
        ("moe_latent_size", 8, "moe_latent_size"),
        ("transformer_impl", "inference_optimized", "inference_optimized"),
        ("overlap_moe_expert_parallel_comm", True, "overlap_moe_expert_parallel_comm"),
        ("fp8", "hybrid", "fp8='hybrid'"),
        ("fp4", "e2m1", "fp4='e2m1'"),
    ],
)
def test_unsupported_newer_settings_are_named(field, value, message):
    config = _config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        check_megatron_config(config, 1)


def _graphed(modules):
    config = _config()
    config.cuda_graph_impl = "transformer_engine"
    setattr(config, "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope", modules)
    return config


@pytest.mark.parametrize("modules", [[], "full", ["moe"], ["attn", "moe_router"], ["moe_preprocess"]])
def test_cuda_graphs_over_moe_layers_are_rejected(modules):
    with pytest.raises(ValueError, match="CUDA-graph|capture"):
        check_megatron_config(_graphed(modules), 1)


def test_cuda_graphs_of_attention_only_are_allowed():
    check_megatron_config(_graphed(["attn"]), 1)
    from megatron.core.transformer import enums

    members = getattr(enums, "CudaGraphModule", None) or enums.CudaGraphScope
    check_megatron_config(_graphed([members.attn, members.mlp]), 1)


def test_supported_config_passes():
    check_megatron_config(_config(), 1)


def test_cpu_compat_is_inert_when_cuda_is_available():
    code = textwrap.dedent(
        """
        import torch
        torch.cuda.is_available = lambda: True
        stream_class = torch.cuda.Stream
        from megatron_llep.testing import cpu_gloo
        assert cpu_gloo.enable() is False
        assert not cpu_gloo.is_enabled()
        assert torch.cuda.Stream is stream_class
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_compat_maps_cuda_placements_to_cpu():
    code = textwrap.dedent(
        """
        import torch
        from megatron_llep.testing import cpu_gloo
        assert cpu_gloo.enable() is True
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.to("cuda").device.type == "cpu" and t.to(device="cuda:0").device.type == "cpu"
        assert torch.ones(2, device=0).device.type == "cpu" and t.pin_memory() is t
        assert not torch.empty(2, pin_memory=True).is_pinned()
        assert torch.full((2,), 3.0, dtype=torch.float64).dtype == torch.float64  # other keywords pass through
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().synchronize()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_borrowed_calls_switch_weight_gradient_fusion_off_and_back():
    import torch

    from megatron_llep.runtime.experts import _fusion_flag_holders, _unfused_weight_grads

    experts = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.ReLU())
    experts[0].gradient_accumulation_fusion = True  # Megatron's linear
    experts[1].fuse_wgrad_accumulation = False  # TE's, already off
    holders = _fusion_flag_holders(experts)
    assert holders == [(experts[0], "gradient_accumulation_fusion"), (experts[1], "fuse_wgrad_accumulation")]
    with _unfused_weight_grads(holders):
        assert experts[0].gradient_accumulation_fusion is False and experts[1].fuse_wgrad_accumulation is False
    assert experts[0].gradient_accumulation_fusion is True and experts[1].fuse_wgrad_accumulation is False
    with pytest.raises(RuntimeError), _unfused_weight_grads(holders):
        raise RuntimeError("a failing borrowed call")
    assert experts[0].gradient_accumulation_fusion is True
