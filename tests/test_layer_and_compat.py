"""Spec helpers, Megatron-config validation, and the CPU compatibility layer's scope."""

import subprocess
import sys
import textwrap

import pytest
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.config import LLEPConfig
from megatron_llep.dispatcher import check_megatron_config
from megatron_llep.layer import LLEPMoELayer, with_llep


def test_with_llep_swaps_every_moe_layer_and_keeps_the_original_spec():
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    config = LLEPConfig(min_chunk_tokens=16)
    llep_spec = with_llep(spec, config)
    assert llep_spec.submodules.mlp.module is LLEPMoELayer
    assert llep_spec.submodules.mlp.params["llep_config"] is config
    assert spec.submodules.mlp.module is MoELayer  # the input spec is untouched


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


def test_supported_config_passes():
    check_megatron_config(_config(), 1)


def test_cpu_compat_is_inert_when_cuda_is_available():
    code = textwrap.dedent(
        """
        import torch
        torch.cuda.is_available = lambda: True
        stream_class = torch.cuda.Stream
        from megatron_llep.compat import cpu_gloo
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
        from megatron_llep.compat import cpu_gloo
        assert cpu_gloo.enable() is True
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().synchronize()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
