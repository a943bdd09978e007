"""The Megatron settings LLEP refuses, checked once per layer with one message that says what to change."""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.compat import mcore


# Per-layer CUDA-graph regions that leave the MoE dispatch, experts and combine out of the graph.
_GRAPHABLE_WITH_LLEP = {"attn", "mlp", "mamba"}


def check_megatron_config(config: TransformerConfig, expert_tp_size: int) -> None:
    """Reject Megatron settings LLEP does not implement, saying what to change."""
    problems = []

    def setting(name: str, default: Any = None) -> Any:  # fields that only some releases have
        return getattr(config, name, default)

    if config.moe_token_dispatcher_type != "alltoall":
        problems.append(
            f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: LLEP extends the 'alltoall' dispatcher"
        )
    if expert_tp_size != 1:
        problems.append(f"expert_tensor_parallel_size={expert_tp_size}: LLEP needs expert tensor parallel size 1")
    if config.moe_pad_expert_input_to_capacity:
        problems.append("moe_pad_expert_input_to_capacity=True: LLEP is dropless and does not pad experts")
    if config.moe_router_padding_for_quantization:
        problems.append("moe_router_padding_for_quantization=True is not supported by LLEP")
    if setting("delay_wgrad_compute", False):
        problems.append("delay_wgrad_compute=True: borrowed experts' weight gradients must be returned in backward")
    if setting("overlap_dispatch_backward_with_experts_wgrad", False):
        problems.append(
            "overlap_dispatch_backward_with_experts_wgrad=True: borrowed experts' weight gradients must be "
            "returned in backward, not deferred to a side stream"
        )
    if setting("use_transformer_engine_op_fuser", False):
        problems.append(
            "use_transformer_engine_op_fuser=True: the fused TEGroupedMLP keeps its weights where borrowed "
            "experts cannot be substituted; set it to False"
        )
    if setting("overlap_moe_expert_parallel_comm", False):
        problems.append(
            "overlap_moe_expert_parallel_comm=True: the combined 1F1B schedule splits the layer into nodes whose "
            "inputs it detaches, so borrowed weights would not reach every rank's backward (collectives would hang)"
        )
    if setting("fp8") or setting("fp4"):
        problems.append(
            f"fp8={setting('fp8')!r} / fp4={setting('fp4')!r}: Transformer Engine caches each expert slot's "
            "quantized weight per micro-batch and shares its scaling state, so borrowed experts in those slots "
            "would silently run with the native experts' weights; train MoE layers in bf16 with LLEP"
        )
    if setting("moe_single_grouped_weight", False):
        problems.append("moe_single_grouped_weight=True: LLEP sends experts one by one; set it to False")
    if setting("moe_paged_stash", False):
        problems.append("moe_paged_stash=True: LLEP's per-step expert layout is not paged; set it to False")
    if setting("moe_latent_size"):
        problems.append("moe_latent_size is set: LLEP's cost model and weight exchange assume experts of width hidden_size")
    if setting("transformer_impl") == "inference_optimized":
        problems.append(
            "transformer_impl='inference_optimized' swaps in an inference dispatcher at forward time; "
            "use 'local' or 'transformer_engine' with LLEP"
        )
    if config.cuda_graph_impl != "none":
        modules = mcore.cuda_graph_modules(config)
        if not modules or not set(modules) <= _GRAPHABLE_WITH_LLEP:
            problems.append(
                f"cuda_graph_impl={config.cuda_graph_impl!r} with capture regions {modules or 'whole layer'}: "
                "LLEP's per-step plan changes shapes inside MoE layers; capture attention (and dense MLP) only"
            )
    if problems:
        raise ValueError("LLEP cannot run with this Megatron config:\n  - " + "\n  - ".join(problems))
