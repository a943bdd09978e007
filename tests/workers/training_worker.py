"""Rank-side code of the training-equivalence tests: a tiny GPTModel with MoE layers, Megatron DDP
and the distributed optimizer, trained a few steps with plain EP and with LLEP from equal weights."""

from __future__ import annotations

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.config import LLEPConfig
from megatron_llep.runtime.layer import LLEPMoELayer, with_llep
from megatron_llep.runtime.forced_routing import force_routing
from megatron_llep.planning.scenarios import imbalanced_topk
from megatron_llep.testing.moe import init_expert_parallel

VOCAB, SEQ, BATCH, EXPERTS, TOPK = 64, 8, 2, 8, 2


def _config(ep: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=12, moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep, use_cpu_initialization=True, params_dtype=torch.float32,
        moe_enable_routing_replay=True, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, add_bias_linear=False, normalization="RMSNorm",
    )


def _build(ep: int, llep: bool, overlap: bool, state=None, overlap_param_gather: bool = False):
    config = _config(ep)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    if llep:
        spec = with_llep(spec, LLEPConfig(min_chunk_tokens=1, cost_aware=False))
    torch.manual_seed(11)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if state is not None:
        model.load_state_dict(state)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, use_distributed_optimizer=True, bucket_size=2000,
        overlap_param_gather=overlap_param_gather,
    )
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        # a large epsilon keeps Adam from turning rounding noise in near-zero gradients into
        # full-size (sign) updates, so equal gradients give equal parameters to float precision
        OptimizerConfig(optimizer="adam", lr=1e-2, adam_eps=1e-4, use_distributed_optimizer=True, clip_grad=1.0, bf16=False),
        [model],
    )
    return model, optimizer


def _moe_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _train(model, optimizer, rank: int, steps: int) -> tuple[list[float], list[dict]]:
    losses, stats = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        for layer_index, layer in enumerate(_moe_layers(model)):
            # hot experts live on EP rank 0: plain EP is imbalanced, LLEP must spill
            ids = imbalanced_topk(BATCH * SEQ, EXPERTS, TOPK, 0.9, 1 + layer_index, seed=1000 * step + 10 * rank + layer_index)
            force_routing(layer.router, ids)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        losses.append(float(loss))
        stats.append({layer.layer_number: getattr(layer.token_dispatcher, "last_stats", None) for layer in _moe_layers(model)})
    return losses, stats


def train_and_compare(rank: int, world: int, overlap: bool, steps: int = 3, ep: int = 0,
                      overlap_param_gather: bool = False) -> dict:
    """``ep`` defaults to the world size; with ``ep < world`` experts are data-parallel too, so the
    distributed optimizer shards them and ``overlap_param_gather`` defers their all-gather."""
    ep = ep or world
    init_expert_parallel(ep)
    build = dict(overlap=overlap, overlap_param_gather=overlap_param_gather)
    plain_model, plain_opt = _build(ep, llep=False, **build)
    initial = {k: v.detach().clone() for k, v in plain_model.module.state_dict().items() if torch.is_tensor(v)}
    llep_model, llep_opt = _build(ep, llep=True, state=plain_model.module.state_dict(), **build)
    assert all(isinstance(m, LLEPMoELayer) for m in _moe_layers(llep_model))
    plain_losses, _ = _train(plain_model, plain_opt, rank, steps)
    llep_losses, llep_stats = _train(llep_model, llep_opt, rank, steps)
    if overlap_param_gather:  # the last step's update is all-gathered only by the next forward
        for model in (plain_model, llep_model):
            model.start_param_sync(force_sync=True)
    plain_params = dict(plain_model.module.named_parameters())
    diffs = {}
    moved = {}
    for name, param in llep_model.module.named_parameters():
        ref = plain_params[name].detach()
        diffs[name] = float((param.detach() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        moved[name] = float((param.detach() - initial[name]).abs().max())
    modes = [s.mode for step in llep_stats for s in step.values() if s is not None]
    transfers = sum(s.weight_transfers for step in llep_stats for s in step.values() if s is not None)
    return {"plain_losses": plain_losses, "llep_losses": llep_losses, "param_rel_diff": diffs,
            "param_moved": moved, "modes": modes, "weight_transfers": transfers}
