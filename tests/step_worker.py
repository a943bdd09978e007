"""Rank-side code of the kept-borrowed-experts tests: a tiny GPTModel with MoE layers trained through
Megatron's own schedule (several micro-batches per step, routing different in each), Megatron DDP
and the distributed optimizer, once with plain EP and once with LLEP from equal weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep import kept_weights
from megatron_llep.config import LLEPConfig
from megatron_llep.layer import with_llep
from megatron_llep.scenarios import force_routing
from megatron_llep.testing.kept_returns import counting_gradient_returns
from megatron_llep.weight_exchange import ExpertWeightExchange

VOCAB, SEQ, BATCH, EXPERTS, TOPK = 64, 8, 2, 8, 2


@dataclass(frozen=True)
class StepCase:
    name: str
    ep: int
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages per rank (Megatron's interleaved 1F1B schedule when > 1)
    microbatches: int = 4
    steps: int = 2
    overlap_grad_reduce: bool = True
    distributed_optimizer: bool = True
    ranks_per_node: int = 0  # 0: one node
    grad_sync_func: bool = False  # Megatron-LM's align_grad_reduce: stages start their reduce after the last backward
    no_sync: bool = True  # config.no_sync_func set (Megatron-LM sets it only with --overlap-grad-reduce)
    max_kept_weight_bytes: int = -1  # -1: no bound
    balanced_replica: bool = False  # the second data-parallel replica routes evenly: it keeps and returns nothing
    broken: str = ""  # negative control (_break): "stale", "lost-behind" or "undeferred"


def _config(case: StepCase) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2 * case.pp * case.vpp, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=12, moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=case.ep, pipeline_model_parallel_size=case.pp, use_cpu_initialization=True,
        virtual_pipeline_model_parallel_size=case.vpp if case.vpp > 1 else None,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, moe_enable_routing_replay=True,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False, add_bias_linear=False,
        normalization="RMSNorm",
    )


def _build(case: StepCase, llep: bool, states=None):
    """The model chunks of this rank (one per virtual pipeline stage), Megatron DDP around each, one
    optimizer, and the schedule's step functions on the config."""
    config = _config(case)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    if llep:
        bound = None if case.max_kept_weight_bytes < 0 else case.max_kept_weight_bytes
        spec = with_llep(spec, LLEPConfig(min_chunk_tokens=1, cost_aware=False, imbalance_threshold=1.05,
                                          ranks_per_node=case.ranks_per_node or None, max_kept_weight_bytes=bound))
    torch.manual_seed(11)
    chunks = []
    for stage in range(case.vpp):
        vp = stage if case.vpp > 1 else None
        chunk = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                         vp_stage=vp)
        if states is not None:
            chunk.load_state_dict(states[stage])
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=case.overlap_grad_reduce,
                                                   use_distributed_optimizer=case.distributed_optimizer,
                                                   bucket_size=2000)
        chunks.append(DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=stage > 0))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, adam_eps=1e-4, use_distributed_optimizer=case.distributed_optimizer,
                        clip_grad=1.0, bf16=False),
        chunks,
    )
    if case.no_sync:
        config.no_sync_func = [c.no_sync for c in chunks] if case.vpp > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if case.grad_sync_func:
        config.grad_sync_func = [c.start_grad_sync for c in chunks] if case.vpp > 1 else chunks[0].start_grad_sync
    return chunks, optimizer


def _moe_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _routing(step: int, microbatch: int, rank: int, layer: int, ep: int) -> np.ndarray:
    """Half of each rank's tokens into expert 0 (EP rank 0), the rest piled on the experts of one
    other EP rank that changes with the micro-batch: the least-loaded helpers differ between
    micro-batches, so the same hot expert is borrowed by different helpers within a step."""
    rng = np.random.default_rng(100_000 * step + 1000 * microbatch + 10 * rank + layer)
    local = EXPERTS // ep
    busy = 1 + (microbatch + layer) % (ep - 1)
    pool = np.arange(busy * local, (busy + 1) * local)
    ids = np.empty((BATCH * SEQ, TOPK), np.int64)
    for row in range(ids.shape[0]):
        first = 0 if rng.random() < 0.5 else int(rng.integers(1, EXPERTS))
        second = int(rng.choice(pool)) if rng.random() < 0.7 else int(rng.integers(0, EXPERTS))
        while second == first:
            second = int(rng.integers(0, EXPERTS))
        ids[row] = (first, second)
    return ids


def _balanced_routing(step: int, microbatch: int, rank: int, layer: int, ep: int) -> np.ndarray:
    """Each token to one expert of each half of the experts: every EP rank gets as many rows as
    every other (EP = 2), so LLEP plans plain EP."""
    rng = np.random.default_rng(100_000 * step + 1000 * microbatch + 10 * rank + layer)
    half = EXPERTS // 2
    return np.stack([rng.integers(0, half, BATCH * SEQ), rng.integers(half, EXPERTS, BATCH * SEQ)], axis=1)


def _loss(output: torch.Tensor):
    loss = output.float().sum()
    return loss, torch.tensor(output.numel(), dtype=torch.int), {"lm loss": torch.stack([loss.detach(),
                                                                                      torch.tensor(float(output.numel()))])}


def _train(case: StepCase, chunks, optimizer, rank: int) -> list[float]:
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    replica = parallel_state.get_expert_data_parallel_rank()
    forward_backward = get_forward_backward_func()
    losses = []
    for step in range(case.steps):
        # every chunk reads the same micro-batch sequence (the first stage's tokens, the last stage's labels)
        micro = [iter(range(case.microbatches)) for _ in chunks]

        def forward_step(data_iterator, model_chunk):
            mb = next(data_iterator)
            gen = torch.Generator().manual_seed(7919 * step + 101 * mb + ep_rank)
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            for layer in _moe_layers(model_chunk):
                routing = _routing if not (case.balanced_replica and replica == 1) else _balanced_routing
                force_routing(layer.router, routing(step, mb, ep_rank, layer.layer_number, case.ep))
            position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
            return model_chunk(tokens, position_ids, None, labels=labels), _loss

        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        result = forward_backward(forward_step_func=forward_step, data_iterator=micro if case.vpp > 1 else micro[0],
                                  model=chunks, num_microbatches=case.microbatches, seq_length=SEQ,
                                  micro_batch_size=BATCH, forward_only=False)
        optimizer.step()
        losses.append(float(sum(float(r["lm loss"][0]) for r in result)) if result else 0.0)
    return losses


def _break(case: StepCase):
    """Negative controls. "stale": the step's return drops nothing, the optimizer step invalidates
    nothing, so the next step computes with copies of the old weights. "lost-behind": the returns
    that end behind a later layer's backward lose their sums. "undeferred": with overlapped grad
    reduce, expert buckets start reducing as their hooks fire (Megatron's way), before the helpers'
    gradients arrived. Applied before the LLEP model is built."""
    if case.broken == "undeferred":
        intercept = kept_weights.DeferredGradReady.intercept
        kept_weights.DeferredGradReady.intercept = lambda deferred, register, param, last_microbatch: register()

        def restore_intercept():
            kept_weights.DeferredGradReady.intercept = intercept

        return restore_intercept
    if case.broken == "lost-behind":
        progress = kept_weights.KeptLedger.progress_returns
        kept_weights.KeptLedger.progress_returns = lambda ledger: [(layer, {}) for layer, _ in progress(ledger)]

        def restore_progress():
            kept_weights.KeptLedger.progress_returns = progress

        return restore_progress
    if case.broken != "stale":
        return lambda: None
    forget, invalidate = kept_weights.KeptLedger.forget_layer, kept_weights.KeptLedger.invalidate

    def keep_copies(ledger, layer, copy_bytes):
        ledger.pending.discard(layer)
        layer.kept.gradients = {}

    kept_weights.KeptLedger.forget_layer = keep_copies
    kept_weights.KeptLedger.invalidate = lambda ledger, reason: None

    def restore():
        kept_weights.KeptLedger.forget_layer, kept_weights.KeptLedger.invalidate = forget, invalidate

    return restore


def train_both(rank: int, world: int, cases: list[StepCase]) -> list[dict]:
    results = []
    for case in cases:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, case.pp, case.vpp if case.vpp > 1 else None,
                                                 expert_model_parallel_size=case.ep)
        model_parallel_cuda_manual_seed(1234)
        plain_model, plain_opt = _build(case, llep=False)
        restore = _break(case)
        llep_model, llep_opt = _build(case, llep=True, states=[chunk.module.state_dict() for chunk in plain_model])
        plain_losses = _train(case, plain_model, plain_opt, rank)
        counts = {"copies": 0, "relayed": 0, "held": 0, "returns": 0, "behind": 0}
        local = EXPERTS // case.ep
        start = ExpertWeightExchange.start

        def counting_start(exchange):
            if not exchange._posted:
                counts["copies"] += len(exchange.receives)
                counts["relayed"] += sum(source != expert // local for expert, source in exchange.receives)
                counts["held"] += len(exchange.held)
            start(exchange)

        ExpertWeightExchange.start = counting_start
        try:
            with counting_gradient_returns(counts):
                llep_losses = _train(case, llep_model, llep_opt, rank)
        finally:
            restore()
            ExpertWeightExchange.start = start
        worst = 0.0
        for plain_chunk, llep_chunk in zip(plain_model, llep_model):
            plain_params = dict(plain_chunk.module.named_parameters())
            worst = max([worst] + [float((p.detach() - plain_params[n].detach()).abs().max()
                                         / plain_params[n].abs().max().clamp_min(1e-30))
                                   for n, p in llep_chunk.module.named_parameters()])
        totals = torch.tensor(list(counts.values()))
        dist.all_reduce(totals)
        results.append({"case": dataclasses.asdict(case), "plain_losses": plain_losses, "llep_losses": llep_losses,
                        "param_rel_diff": worst, **dict(zip(counts, totals.tolist()))})
        for ledger in kept_weights._LEDGERS.values():  # the next case builds new layers
            ledger.held.clear(), ledger.pending.clear(), ledger.returning.clear()
            ledger.used[:] = 0
    return results


def accumulate_without_ddp(rank: int, world: int, microbatches: int = 3) -> dict:
    """One MoE layer without DDP, ``microbatches`` forward+backward passes inside
    :func:`~megatron_llep.kept_weights.accumulating_gradients`, then
    :func:`~megatron_llep.kept_weights.finish_borrowed_gradients`: the native experts' gradients
    equal stock EP's. Negative control: measured before the finish call, they lack the helpers' part."""
    from megatron_llep.scenarios import imbalanced_topk
    from megatron_llep.testing.moe import build_moe_layer, init_expert_parallel, moe_config

    parallel_state.destroy_model_parallel()
    init_expert_parallel(world)
    cfg = moe_config(EXPERTS, 16, 12, TOPK, world, moe_enable_routing_replay=True)
    stock = build_moe_layer(cfg, None, seed=3)
    llep = build_moe_layer(cfg, LLEPConfig(min_chunk_tokens=1, cost_aware=False, imbalance_threshold=1.05), seed=3)

    def accumulate(layer) -> None:
        layer.zero_grad(set_to_none=True)
        with kept_weights.accumulating_gradients():
            for mb in range(microbatches):
                force_routing(layer.router, imbalanced_topk(24, EXPERTS, TOPK, 0.9, 1 + mb % 2, seed=10 * mb + rank))
                x = torch.randn(24, 1, 16, generator=torch.Generator().manual_seed(100 * mb + rank))
                layer(x)[0].square().sum().backward()

    def error() -> float:
        reference = dict(stock.experts.named_parameters())
        return max(float((p.grad - reference[n].grad).abs().max() / reference[n].grad.abs().max())
                   for n, p in llep.experts.named_parameters())

    accumulate(stock)
    accumulate(llep)
    before_finish = error()
    kept_weights.finish_borrowed_gradients(llep)
    return {"before_finish": before_finish, "after_finish": error()}


def evaluation_keeps_copies(rank: int, world: int) -> dict:
    """Evaluation: the copies a forward received serve the next forwards (no new copy, outputs
    still stock EP's); a state-dict load drops them, so the forward after it computes with the new
    weights. Negative control ("stale"): with the load hook off, it computes with the old copies."""
    from megatron_llep.scenarios import imbalanced_topk
    from megatron_llep.testing.moe import build_moe_layer, init_expert_parallel, moe_config

    parallel_state.destroy_model_parallel()
    init_expert_parallel(world)
    cfg = moe_config(EXPERTS, 16, 12, TOPK, world, moe_enable_routing_replay=True)
    stock = build_moe_layer(cfg, None, seed=3).eval()
    llep = build_moe_layer(cfg, LLEPConfig(min_chunk_tokens=1, cost_aware=False, imbalance_threshold=1.05), seed=3).eval()
    ids = imbalanced_topk(24, EXPERTS, TOPK, 0.9, 1, seed=rank)
    x = torch.randn(24, 1, 16, generator=torch.Generator().manual_seed(rank))
    copies = []
    start = ExpertWeightExchange.start

    def counting_start(exchange):
        if not exchange._posted:
            copies.append(len(exchange.receives))
        start(exchange)

    per_forward = []

    def error() -> float:
        before = sum(copies)
        with torch.no_grad():
            for layer in (stock, llep):
                force_routing(layer.router, ids)
            ours, ref = llep(x)[0], stock(x)[0]
        per_forward.append(sum(copies) - before)
        return float((ours - ref).abs().max() / ref.abs().max())

    result = {}
    ExpertWeightExchange.start = counting_start
    invalidate = kept_weights.KeptLedger.invalidate
    try:
        result["first"], result["second"] = error(), error()
        result["copies"] = list(per_forward)
        for broken in (False, True):
            if broken:
                kept_weights.KeptLedger.invalidate = lambda ledger, reason: None
                error()  # the copies of the current weights are kept again
            state = {k: v * 1.5 if "experts" in k and torch.is_tensor(v) and v.is_floating_point() else v
                     for k, v in stock.state_dict().items()}
            stock.load_state_dict(state)
            llep.load_state_dict(state)
            result["after_load_stale" if broken else "after_load"] = error()
    finally:
        ExpertWeightExchange.start = start
        kept_weights.KeptLedger.invalidate = invalidate
    dist.barrier()
    return result


def mixed_expert_buckets(rank: int, world: int) -> dict:
    """Megatron DDP around an LLEP MoE layer and a plain one, whose experts share one gradient
    bucket: with overlapped grad reduce the bucket's start order cannot be kept (one error when DDP
    is built); without it nothing is refused."""
    from megatron_llep.testing.moe import build_moe_layer, init_expert_parallel, moe_config

    parallel_state.destroy_model_parallel()
    init_expert_parallel(world)
    cfg = moe_config(EXPERTS, 16, 12, TOPK, world)
    llep_config = LLEPConfig(min_chunk_tokens=1, cost_aware=False)
    result = {}
    for overlap in (True, False):
        module = torch.nn.ModuleList([build_moe_layer(cfg, llep_config), build_moe_layer(cfg, None)])
        try:
            DistributedDataParallel(cfg, DistributedDataParallelConfig(overlap_grad_reduce=overlap), module)
            result[overlap] = None
        except ValueError as err:
            result[overlap] = str(err)
    return result
