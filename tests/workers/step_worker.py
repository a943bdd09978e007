"""Rank-side code of the kept-borrowed-experts tests: a tiny GPTModel with MoE layers trained with
several micro-batches per step (routing different in each, so one hot expert is borrowed by different
helpers within a step), once with plain EP and once with LLEP from equal weights, in every kind of
training loop: Megatron's own schedules with Megatron DDP (with and without the distributed optimizer,
overlapped grad reduce, pipeline parallelism), plain ``loss.backward()`` loops in any backward order,
:func:`megatron_llep.accumulating_gradients`, torch's DDP; with and without activation recompute. The
gradients themselves are compared (``main_grad`` / ``.grad`` of every parameter just before the
optimizer step), not only the parameters after it."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Union

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

import megatron_llep
from megatron_llep.runtime import dispatcher as llep_dispatcher
from megatron_llep.runtime import kept_weights
from megatron_llep.runtime import state as llep_state
from megatron_llep.compat.torch_api import running_backward
from megatron_llep.config import LLEPConfig
from megatron_llep.runtime.layer import with_llep
from megatron_llep.runtime.forced_routing import force_routing
from megatron_llep.testing.kept_returns import counting_gradient_returns
from megatron_llep.runtime.weight_exchange import ExpertWeightExchange

VOCAB, SEQ, BATCH, EXPERTS, TOPK = 64, 8, 2, 8, 2

# Training loops. "megatron": Megatron's schedule (get_forward_backward_func) around Megatron DDP and
# its optimizer. Without Megatron DDP, with a torch optimizer: "each": forward and backward per
# micro-batch; "reverse": every forward first, then the backwards in reverse order; "sum": every forward,
# one backward of the summed losses; "accumulate": every micro-batch inside accumulating_gradients();
# "accumulate-last-outside": all but the last inside (Megatron's no_sync pattern); "torch-ddp": torch's
# DistributedDataParallel (one replica per EP rank) with no_sync for all but the last micro-batch;
# "dropped-forward": the first micro-batch's forward output is dropped without a backward, the others
# run forward and backward each.
PLAIN_LOOPS = ("each", "reverse", "sum", "accumulate", "accumulate-last-outside", "torch-ddp", "dropped-forward")
RECOMPUTE = {"": {}, "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
             "moe_act": dict(recompute_granularity="selective", recompute_modules=["moe_act"])}  # see moe_act_recompute


@dataclass(frozen=True)
class StepCase:
    name: str
    ep: int
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages per rank (Megatron's interleaved 1F1B schedule when > 1)
    microbatches: int = 4
    steps: int = 2
    loop: str = "megatron"  # or one of PLAIN_LOOPS
    finish: bool = False  # call megatron_llep.finish_borrowed_gradients(model) after the step's backwards
    recompute: str = ""  # a key of RECOMPUTE
    overlap_grad_reduce: bool = True
    distributed_optimizer: bool = True
    ranks_per_node: int = 0  # 0: one node
    grad_sync_func: bool = False  # Megatron-LM's align_grad_reduce: stages start their reduce after the last backward
    no_sync: bool = True  # config.no_sync_func set (Megatron-LM sets it only with --overlap-grad-reduce)
    max_kept_weight_bytes: Union[int, str, None] = None  # LLEPConfig's: None, no bound; "auto"
    balanced_replica: bool = False  # the second data-parallel replica routes evenly: it keeps and returns nothing
    # negative control (_break): "stale", "lost-behind", "undeferred", "scaled-return", "replan"; or
    # "unfinished": nothing patched, the loop itself leaves gradients away (the optimizer step must refuse)
    broken: str = ""


def _config(case: StepCase) -> TransformerConfig:
    return TransformerConfig(
        **RECOMPUTE[case.recompute],
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
    """The model chunks of this rank (one per virtual pipeline stage) and their optimizer: under
    Megatron's loop, Megatron DDP around each chunk, Megatron's optimizer and the schedule's step
    functions on the config; otherwise the bare model (torch's DDP around it for "torch-ddp") and
    torch's Adam."""
    config = _config(case)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    if llep:
        spec = with_llep(spec, LLEPConfig(min_chunk_tokens=1, cost_aware=False, imbalance_threshold=1.05,
                                          ranks_per_node=case.ranks_per_node or None,
                                          max_kept_weight_bytes=case.max_kept_weight_bytes))
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
        chunks.append(chunk)
    if case.loop != "megatron":
        model = chunks[0]
        if case.loop == "torch-ddp":  # one replica per EP rank: its reducer's hooks and bucket copies run all the same
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=_own_group())
        return [model], torch.optim.Adam(chunks[0].parameters(), lr=1e-2, eps=1e-4)
    for stage, chunk in enumerate(chunks):
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=case.overlap_grad_reduce,
                                                   use_distributed_optimizer=case.distributed_optimizer,
                                                   bucket_size=2000)
        chunks[stage] = DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=stage > 0)
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


_OWN_GROUPS: dict = {}


def _own_group():
    """A process group of this rank alone (built by every rank, once)."""
    if not _OWN_GROUPS:
        _OWN_GROUPS.update({r: dist.new_group([r]) for r in range(dist.get_world_size())})
    return _OWN_GROUPS[dist.get_rank()]


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


class _RecomputedRouting:
    """Forced routing that an activation recompute reproduces whatever order the backwards run in
    (Megatron's own replay of recomputed routing pops its list in forward order): a router forward
    outside a backward takes the ids set for it (:attr:`next_ids`) and records them under its
    input's sum; a recompute, inside a backward, takes the ids recorded under the nearest sum."""

    def __init__(self, router: torch.nn.Module) -> None:
        self.router, self.next_ids, self.seen = router, None, []
        router.register_forward_pre_hook(self)

    def __call__(self, router: torch.nn.Module, args: tuple) -> None:
        key = float(args[0].detach().double().sum())
        if running_backward():
            ids = min(self.seen, key=lambda seen: abs(seen[0] - key))[1]
        else:
            ids = self.next_ids
            self.seen.append((key, ids))
        force_routing(self.router, ids)


def _microbatch(case: StepCase, model_chunk, step: int, mb: int):
    """Micro-batch ``mb``'s tokens, labels and positions, with its routing forced on the chunk's MoE layers."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    replica = parallel_state.get_expert_data_parallel_rank()
    gen = torch.Generator().manual_seed(7919 * step + 101 * mb + ep_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    for layer in _moe_layers(model_chunk):
        routing = _routing if not (case.balanced_replica and replica == 1) else _balanced_routing
        if not isinstance(getattr(layer, "forced_routing", None), _RecomputedRouting):
            layer.forced_routing = _RecomputedRouting(layer.router)
        if mb == 0:
            layer.forced_routing.seen.clear()
        layer.forced_routing.next_ids = routing(step, mb, ep_rank, layer.layer_number, case.ep)
    return tokens, labels, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


def _gradients(chunks) -> dict:
    """Every parameter's gradient as the optimizer step would read it: Megatron DDP's ``main_grad``,
    else ``.grad``."""
    grads = {}
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            grads[f"{index}.{name}"] = None if grad is None else grad.detach().clone()
    return grads


def _train(case: StepCase, chunks, optimizer) -> tuple[list[float], list[dict], list[str]]:
    """The case's steps: per step the loss and every gradient just before the optimizer step; and
    the errors the optimizer steps raised."""
    losses, grads, errors = [], [], []
    for step in range(case.steps):
        if case.loop == "megatron":
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            losses.append(_megatron_step(case, chunks, step))
        else:
            optimizer.zero_grad(set_to_none=True)
            losses.append(_plain_step(case, chunks[0], step))
            if case.finish:
                megatron_llep.finish_borrowed_gradients(chunks[0])
        grads.append(_gradients(chunks))
        try:
            optimizer.step()
        except RuntimeError as err:
            errors.append(str(err))
    return losses, grads, errors


def _megatron_step(case: StepCase, chunks, step: int) -> float:
    # every chunk reads the same micro-batch sequence (the first stage's tokens, the last stage's labels)
    micro = [iter(range(case.microbatches)) for _ in chunks]

    def forward_step(data_iterator, model_chunk):
        tokens, labels, positions = _microbatch(case, model_chunk, step, next(data_iterator))
        return model_chunk(tokens, positions, None, labels=labels), _loss

    result = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=micro if case.vpp > 1 else micro[0], model=chunks,
        num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    return float(sum(float(r["lm loss"][0]) for r in result)) if result else 0.0


def _plain_step(case: StepCase, model, step: int) -> float:
    """One step of a loop without Megatron DDP (the case's ``loop``)."""
    def forward(mb: int) -> torch.Tensor:
        tokens, labels, positions = _microbatch(case, model, step, mb)
        return model(tokens, positions, None, labels=labels).float().sum()

    def accumulating(mb: int):
        inside = case.loop == "accumulate" or (case.loop == "accumulate-last-outside" and mb < case.microbatches - 1)
        if inside:
            return megatron_llep.accumulating_gradients()
        if case.loop == "torch-ddp" and mb < case.microbatches - 1:
            return model.no_sync()
        return contextlib.nullcontext()

    mbs = range(case.microbatches)
    if case.loop == "dropped-forward":
        forward(0)  # its backward never runs
        mbs = range(1, case.microbatches)
    if case.loop in ("reverse", "sum"):
        losses = [forward(mb) for mb in mbs]
        if case.loop == "sum":
            sum(losses).backward()
        else:
            for loss in reversed(losses):
                loss.backward()
        return float(sum(float(loss) for loss in losses))
    total = 0.0
    if case.loop == "accumulate":  # one block around the whole step
        with megatron_llep.accumulating_gradients():
            for mb in mbs:
                loss = forward(mb)
                loss.backward()
                total += float(loss)
        return total
    for mb in mbs:
        with accumulating(mb):
            loss = forward(mb)
            loss.backward()
        total += float(loss)
    return total


def _break(case: StepCase):
    """Negative controls, applied before the LLEP model is built; returns the undo. "stale": the
    step's return drops nothing, the optimizer step invalidates nothing, so the next step computes
    with copies of the old weights. "lost-behind": the returns that end behind a later layer's
    backward lose their sums. "undeferred": with overlapped grad reduce, expert buckets start reducing
    as their hooks fire (Megatron's way), before the helpers' gradients arrived. "scaled-return": the
    first returned gradient of each step's return of kept copies is scaled by 1.001. "replan": a
    recompute forward plans again instead of taking its forward's plan."""
    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if case.broken == "undeferred":
        patch(kept_weights.DeferredGradReady, "intercept", lambda deferred, register, param, last_microbatch: register())
    elif case.broken == "lost-behind":
        progress = kept_weights.KeptLedger.progress_returns
        patch(kept_weights.KeptLedger, "progress_returns", lambda ledger: [(layer, {}) for layer, _ in progress(ledger)])
    elif case.broken == "scaled-return":
        finish = kept_weights.GradientReturn.finish

        def scaled_finish(returning):
            sums = finish(returning)
            for parts in sums.values():
                parts[0].mul_(1.001)
                break
            return sums

        patch(kept_weights.GradientReturn, "finish", scaled_finish)
    elif case.broken == "replan":
        patch(llep_dispatcher.LLEPTokenDispatcher, "_recomputed_step", lambda dispatcher, routing: None)
    elif case.broken == "stale":
        def keep_copies(ledger, layer, copy_bytes):
            ledger.pending.discard(layer)
            layer.kept.gradients = {}

        patch(kept_weights.KeptLedger, "forget_layer", keep_copies)
        patch(kept_weights.KeptLedger, "invalidate", lambda ledger, reason: None)

    def restore():
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)

    return restore


def _relative_difference(ours: dict, reference: dict) -> float:
    """The largest difference of any gradient from plain EP's, relative to that gradient's largest entry."""
    worst = 0.0
    for name, ref in reference.items():
        got = ours[name]
        if ref is None or got is None:
            if (ref is None) != (got is None) and float((ref if got is None else got).abs().max()) > 0:
                return float("inf")
            continue
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return worst


def train_both(rank: int, world: int, cases: list[StepCase]) -> list[dict]:
    results = []
    for case in cases:
        gc.collect()  # the layers of the cases before leave their EP group's ledger (the "auto" bound counts its layers)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, case.pp, case.vpp if case.vpp > 1 else None,
                                                 expert_model_parallel_size=case.ep)
        model_parallel_cuda_manual_seed(1234)
        plain_model, plain_opt = _build(case, llep=False)
        states = [getattr(chunk, "module", chunk).state_dict() for chunk in plain_model]
        restore = _break(case)
        llep_model, llep_opt = _build(case, llep=True, states=states)
        plain_losses, plain_grads, _ = _train(case, plain_model, plain_opt)
        counts = {"copies": 0, "relayed": 0, "held": 0, "returns": 0, "behind": 0, "plans": 0, "most_kept_bytes": 0}
        local = EXPERTS // case.ep
        start, plan, record = ExpertWeightExchange.start, llep_dispatcher.plan_llep, kept_weights.KeptLedger.record

        def counting_start(exchange):
            if not exchange._posted:
                counts["copies"] += len(exchange.receives)
                counts["relayed"] += sum(source != expert // local for expert, source in exchange.receives)
                counts["held"] += len(exchange.held)
            start(exchange)

        def counting_plan(*args, **kwargs):
            counts["plans"] += 1
            return plan(*args, **kwargs)

        def recording(ledger, *args, **kwargs):  # the most bytes any rank keeps at any time
            record(ledger, *args, **kwargs)
            counts["most_kept_bytes"] = max(counts["most_kept_bytes"], int(ledger.used.max()))

        ExpertWeightExchange.start, llep_dispatcher.plan_llep = counting_start, counting_plan
        kept_weights.KeptLedger.record = recording
        try:
            with counting_gradient_returns(counts):
                llep_losses, llep_grads, errors = _train(case, llep_model, llep_opt)
        finally:
            restore()
            ExpertWeightExchange.start, llep_dispatcher.plan_llep = start, plan
            kept_weights.KeptLedger.record = record
        grad_diff = max(_relative_difference(ours, ref) for ours, ref in zip(llep_grads, plain_grads))
        worst = 0.0
        for plain_chunk, llep_chunk in zip(plain_model, llep_model):
            plain_params = dict(plain_chunk.named_parameters())
            worst = max([worst] + [float((p.detach() - plain_params[n].detach()).abs().max()
                                         / plain_params[n].abs().max().clamp_min(1e-30))
                                   for n, p in llep_chunk.named_parameters()])
        # planning runs once per forward: one plan per micro-batch, MoE layer of this rank and step
        forwards = case.steps * case.microbatches * sum(len(_moe_layers(chunk)) for chunk in llep_model)
        counts["extra_plans"] = counts.pop("plans") - forwards
        most_kept = counts.pop("most_kept_bytes")
        copy_bytes = _moe_layers(llep_model[0])[0].token_dispatcher.kept_copy_bytes
        totals = torch.tensor(list(counts.values()))
        dist.all_reduce(totals)
        results.append({"case": dataclasses.asdict(case), "plain_losses": plain_losses, "llep_losses": llep_losses,
                        "grad_rel_diff": grad_diff, "param_rel_diff": worst, "errors": errors,
                        "most_kept_bytes": most_kept, "kept_copy_bytes": copy_bytes,
                        "llep_layers": sum(len(_moe_layers(chunk)) for chunk in llep_model),
                        **dict(zip(counts, totals.tolist()))})
        for ledger in llep_state._LEDGERS.values():  # the next case builds new layers
            ledger.held.clear(), ledger.pending.clear(), ledger.returning.clear()
            ledger.used[:] = 0
            ledger.auto_bounds = None
    return results


def evaluation_keeps_copies(rank: int, world: int) -> dict:
    """Evaluation: the copies a forward received serve the next forwards (no new copy, outputs
    still stock EP's); a state-dict load drops them, so the forward after it computes with the new
    weights. Negative control ("stale"): with the load hook off, it computes with the old copies."""
    from megatron_llep.planning.scenarios import imbalanced_topk
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

