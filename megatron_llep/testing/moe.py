"""Build real Megatron-Core MoE layers (plain EP and LLEP) with identical, distinct weights."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.compat import mcore
from megatron_llep.config import LLEPConfig
from megatron_llep.runtime.layer import LLEPMoELayer
from megatron_llep.runtime.weight_exchange import ExpertWeightExchange


def init_expert_parallel(ep_size: int, seed: int = 1234) -> None:
    """Megatron parallel state for a pure expert-parallel group over all ranks (TP = PP = 1)."""
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep_size)
    model_parallel_cuda_manual_seed(seed)


def moe_config(
    num_experts: int,
    hidden_size: int,
    ffn_hidden_size: int,
    topk: int,
    ep_size: int,
    gpt_oss_experts: bool = False,
    bias_activation_fusion: bool = False,
    params_dtype: torch.dtype = torch.float32,
    **overrides,
) -> TransformerConfig:
    """A TransformerConfig for one MoE layer on CPU; ``gpt_oss_experts`` gives gpt-oss's expert
    math (biases, quick-GELU GLU with linear offset 1.0 and clamp 7.0), else SwiGLU without bias."""
    expert_math = (
        dict(
            add_bias_linear=True,
            gated_linear_unit=True,
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=7.0,
            bias_activation_fusion=bias_activation_fusion,
        )
        if gpt_oss_experts
        else dict(add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    )
    fields = dict(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=2,
        ffn_hidden_size=ffn_hidden_size,
        moe_ffn_hidden_size=ffn_hidden_size,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_pre_softmax=topk == 1,  # Megatron requires pre-softmax for top-1
        expert_model_parallel_size=ep_size,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        gradient_accumulation_fusion=False,
        moe_enable_routing_replay=True,
        **expert_math,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_moe_layer(
    config: TransformerConfig,
    llep_config: Optional[LLEPConfig] = None,
    seed: int = 0,
    weight_scale: float = 0.2,
    grouped_gemm: bool = False,
    te_grouped_gemm: bool = False,
) -> MoELayer:
    """A Megatron MoELayer (plain EP) or LLEPMoELayer (routing can be forced with
    :func:`megatron_llep.runtime.forced_routing.force_routing`).

    Weights are set from ``seed`` and each expert's *global* id, so every expert differs from every
    other and both layer kinds built with the same seed hold identical weights. ``grouped_gemm``
    selects Megatron's legacy GroupedMLP experts (Megatron-Core < 0.17) instead of SequentialMLP,
    ``te_grouped_gemm`` Transformer Engine's TEGroupedMLP (GPU; ``config.moe_grouped_gemm`` on).
    """
    spec = mcore.moe_module_spec(config.num_moe_experts, use_te=te_grouped_gemm, legacy_grouped_gemm=grouped_gemm)
    submodules = mcore.moe_submodules(spec)
    if llep_config is None:
        layer = MoELayer(config, submodules, layer_number=1)
    else:
        layer = LLEPMoELayer(config, submodules, layer_number=1, llep_config=llep_config)
    set_distinct_weights(layer, seed, weight_scale)
    return layer


@torch.no_grad()
def set_distinct_weights(layer: MoELayer, seed: int, scale: float = 0.2) -> None:
    """Router and shared-expert weights from ``seed`` (identical on every rank); routed expert
    ``g``'s from ``(seed, g)``. Drawn on the parameters' device (the same values wherever a
    layer's parameters are on the same kind of device)."""
    replicated = list(layer.router.parameters())
    if layer.shared_experts is not None:
        replicated += list(layer.shared_experts.parameters())
    gen = torch.Generator(replicated[0].device).manual_seed(seed)
    for param in replicated:
        param.copy_(torch.randn(param.shape, generator=gen, device=param.device) * scale)
    for local, tensors in enumerate(expert_weights(layer)):
        device = next(iter(tensors.values())).device
        gen = torch.Generator(device).manual_seed(seed * 100003 + layer.local_expert_indices[local] + 1)
        for tensor in tensors.values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen, device=device) * scale)


def expert_weights(layer: MoELayer, grads: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per native expert, its tensors in Megatron's per-expert layout (``fc1_weight [2H, D]``,
    ``fc1_bias``, ``fc2_weight [D, H]``, ``fc2_bias``) as views of the layer's parameters (of
    their ``.grad`` with ``grads=True``)."""
    experts = layer.experts
    pick = (lambda p: p.grad) if grads else (lambda p: p)
    names = {"linear_fc1.weight": "fc1_weight", "linear_fc1.bias": "fc1_bias",
             "linear_fc2.weight": "fc2_weight", "linear_fc2.bias": "fc2_bias"}
    if isinstance(experts, mcore.TEGroupedMLP):  # expert i owns linear_fc1.weight{i} [2H, D], linear_fc1.bias{i}, ...
        params = dict(experts.named_parameters())
        return [{key: pick(params[f"{name}{i}"]) for name, key in names.items() if f"{name}{i}" in params}
                for i in range(layer.num_local_experts)]
    if mcore.GroupedMLP is not None and isinstance(experts, mcore.GroupedMLP):  # weight1 [D, M*2H] and weight2 [M*H, D], viewed per expert
        local, hidden = layer.num_local_experts, layer.config.hidden_size
        w1 = pick(experts.weight1).view(local, hidden, -1)
        w2 = pick(experts.weight2).view(local, -1, hidden)
        return [{"fc1_weight": w1[i].t(), "fc2_weight": w2[i].t()} for i in range(local)]
    return [{names[n]: pick(p) for n, p in e.named_parameters()} for e in experts.local_experts]


def gathered_expert_weights(layer: MoELayer, grads: bool = False) -> list[dict[str, torch.Tensor]]:
    """:func:`expert_weights` of every physical slot (copies), gathered from their native ranks over
    the default process group (the tests' EP group)."""
    import torch.distributed as dist

    local = expert_weights(layer, grads=grads)
    slots: list[dict[str, torch.Tensor]] = [dict() for _ in range(layer.config.num_moe_experts)]
    for key in local[0]:
        mine = torch.stack([weights[key].detach().contiguous() for weights in local])
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine)
        for slot, tensor in enumerate(t for block in out for t in block):
            slots[slot][key] = tensor.clone()
    return slots


@contextlib.contextmanager
def send_a_neighbouring_expert() -> Iterator[None]:
    """Negative control for parity tests: every native rank sends the weights of the expert next to
    the one borrowed, so borrowed slots compute with the wrong expert."""
    original = ExpertWeightExchange._source_tensors

    def shifted(self, expert):
        if not self._is_native(expert):
            return original(self, expert)
        neighbour = (expert - self.first_local_expert + 1) % self.adapter.num_local_experts
        return [t.detach().contiguous() for t in self.adapter.expert_tensors(neighbour)]

    ExpertWeightExchange._source_tensors = shifted
    try:
        yield
    finally:
        ExpertWeightExchange._source_tensors = original
