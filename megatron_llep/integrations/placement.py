"""Apply an expert placement to a live Megatron model, exactly, and restore the original order;
pick a placement by timing the live model (:func:`profile_spectrum`).

``apply_placement(model, placement)`` permutes every MoE layer so that physical slot ``s`` holds
what slot ``placement.slot_to_expert(layer)[s]`` held before: the routed experts' weights
(``SequentialMLP`` local experts, legacy ``GroupedMLP`` ``weight1``/``weight2``) move between EP
ranks by point-to-point copies over the layer's EP group (each rank receives only the experts it
will own, one parameter kind at a time), and the router's per-expert rows move with them:
``weight``, ``bias``, the ``expert_bias`` of sigmoid/DeepSeek-V3 routing and its token counts,
quantile balancing's ``qb_beta`` (see :func:`router_expert_tensors`). Router logits are then a permutation of the old ones, top-K
picks the same experts under their new ids, every expert computes what it computed before: the
layer is the same function (outputs equal up to the order of float summation over a token's
experts). Works for ``MoELayer`` and ``LLEPMoELayer`` alike (LLEP just sees the placed layout).

``restore_original_order(model, placement)`` applies the inverse, bit-identically. A checkpoint
saved from a placed model stores experts in physical order: record the placement next to it
(:func:`~megatron_llep.placement.placement.write_checkpoint_placement`) and restore after loading.

Call both before the optimizer is built (it keeps per-parameter state and, with the distributed
optimizer, fp32 master copies that would not move) and with no accumulated gradients.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import utils as mcore_utils
from megatron.core.transformer.moe.moe_layer import BaseMoELayer

from megatron_llep.compat import mcore
from megatron_llep.compat.mcore import GroupedMLP, SequentialMLP
from megatron_llep.placement.cap import CAPResult
from megatron_llep.placement.placement import ExpertPlacement, check_permutation, check_routing_groups
from megatron_llep.placement.profile import ProfileReport, placement_at, profile_positions
from megatron_llep.placement.trace import RoutingTrace
from megatron_llep.runtime.state import drop_kept_experts

Model = Union[torch.nn.Module, Iterable[torch.nn.Module]]


def moe_layers(model: Model) -> dict[int, BaseMoELayer]:
    """The model's MoE layers by Megatron layer number (``model`` may be a list of chunks)."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    layers: dict[int, BaseMoELayer] = {}
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, BaseMoELayer):
                continue
            number = mcore.moe_layer_number(module)
            if number is None:
                raise ValueError("an MoE layer has no layer_number; build it with layer_number=... or inside a TransformerLayer")
            if number in layers:
                raise ValueError(f"two MoE layers share layer number {number}; placements are keyed by layer number")
            layers[int(number)] = module
    if not layers:
        raise ValueError("the model has no MoE layer")
    return layers


def apply_placement(model: Model, placement: ExpertPlacement) -> None:
    """Permute the model's experts and router rows into ``placement``'s physical order (exact).

    Every EP rank must call it (it communicates). Layers of ``placement`` absent from this model
    chunk (other pipeline stages) are ignored; an MoE layer without an entry is an error.
    """
    layers = moe_layers(model)
    missing = sorted(set(layers) - set(placement.layers))
    if missing:
        raise ValueError(f"the placement has no entry for MoE layer(s) {missing} (it holds {sorted(placement.layers)})")
    drop_kept_experts("the expert placement changed")  # kept copies would carry the old expert ids
    for number, layer in sorted(layers.items()):
        _permute_layer(layer, placement, number)


def restore_original_order(model: Model, placement: ExpertPlacement) -> None:
    """Undo :func:`apply_placement` (``placement`` is the one the model is placed in)."""
    apply_placement(model, placement.inverse())


def _permute_layer(layer: BaseMoELayer, placement: ExpertPlacement, number: int) -> None:
    config = layer.config
    what = f"MoE layer {number}"
    if placement.num_experts != config.num_moe_experts:
        raise ValueError(f"{what} has {config.num_moe_experts} experts, the placement is for {placement.num_experts}")
    ep_size = mcore_utils.get_pg_size(layer.ep_group)
    if placement.ep_size != ep_size:
        raise ValueError(f"{what} runs at expert-parallel size {ep_size}, the placement is for {placement.ep_size}")
    perm = check_permutation(placement.slot_to_expert(number), config.num_moe_experts, what)
    check_routing_groups(perm, config.moe_router_num_groups or 1, what)
    tensors = _expert_tensors(layer)
    _check_no_gradients(layer, what)
    with torch.no_grad():
        for rows in router_expert_tensors(layer.router, config.num_moe_experts):
            rows.copy_(rows[torch.as_tensor(perm, device=rows.device)])
        for views in tensors:
            _exchange(views, perm, layer.num_local_experts, layer.ep_group)


def router_expert_tensors(router: torch.nn.Module, num_experts: int) -> list[torch.Tensor]:
    """The router's per-expert tensors: every parameter and buffer indexed by expert first
    (``weight``, ``bias``, ``expert_bias`` and its token counts, 0.19's quantile-balancing
    ``qb_beta``/``qb_beta_accum``, and whatever per-expert state a later release adds)."""
    tensors = list(router.named_parameters(recurse=False)) + list(router.named_buffers(recurse=False))
    return [t for _, t in tensors if t.dim() >= 1 and t.shape[0] == num_experts]


def _expert_tensors(layer: BaseMoELayer) -> list[list[torch.Tensor]]:
    """Per parameter kind, the ``M`` per-local-expert views that move as a unit."""
    experts, local = layer.experts, layer.num_local_experts
    if isinstance(experts, SequentialMLP):
        params = [dict(expert.named_parameters()) for expert in experts.local_experts]
        return [[p[name] for p in params] for name in params[0]]
    if GroupedMLP is not None and isinstance(experts, GroupedMLP):
        names = {name for name, _ in experts.named_parameters()}
        if names != {"weight1", "weight2"}:
            raise NotImplementedError(f"GroupedMLP with parameters {sorted(names)}: only weight1/weight2 are placed")
        # Megatron's own per-expert view: weight1 is [M, D, 2H] and weight2 [M, H, D] in memory
        return [list(experts.weight1.view(local, -1)), list(experts.weight2.view(local, -1))]
    raise NotImplementedError(
        f"placing {type(experts).__name__} experts is not supported (SequentialMLP and GroupedMLP are)"
    )


def _check_no_gradients(layer: BaseMoELayer, what: str) -> None:
    for name, param in layer.named_parameters():
        for grad in (param.grad, getattr(param, "main_grad", None)):
            if grad is not None and bool(grad.ne(0).any()):
                raise RuntimeError(f"{what}: {name} holds an accumulated gradient; place the model between steps after zero_grad")


def _exchange(views: list[torch.Tensor], perm: np.ndarray, local: int, group) -> None:
    """New local slot ``l`` of this rank takes old slot ``perm[rank * M + l]``: local copies stay,
    others arrive by P2P. Messages between two ranks are posted in ascending old-slot order on
    both sides, so they match in order."""
    rank = mcore_utils.get_pg_rank(group)
    new_slots = np.arange(rank * local, (rank + 1) * local)
    destination = np.argsort(perm) // local  # rank that will hold each old slot
    incoming: list[torch.Tensor] = [None] * local  # type: ignore[list-item]
    ops = []
    for l in np.argsort(perm[new_slots], kind="stable"):
        source = int(perm[new_slots[l]])
        if source // local == rank:
            incoming[l] = views[source % local].clone()
        else:
            incoming[l] = torch.empty_like(views[l])
            ops.append(dist.P2POp(dist.irecv, incoming[l], dist.get_global_rank(group, source // local), group))
    for l, old in enumerate(new_slots):
        if destination[old] != rank:
            ops.append(dist.P2POp(dist.isend, views[l].contiguous(), dist.get_global_rank(group, int(destination[old])), group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for view, value in zip(views, incoming):
        view.copy_(value)


def profile_spectrum(
    model: Union[torch.nn.Module, Iterable[torch.nn.Module]],
    results: dict[int, CAPResult],
    run_forward: Callable[[], None],
    group: Optional[dist.ProcessGroup] = None,
    candidates: int = 5,
    warmup: int = 1,
    repeats: int = 3,
    tokens: Optional[int] = None,
    trace: Optional[RoutingTrace] = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ProfileReport:
    """Time ``run_forward`` under the placement of each of ``candidates`` positions
    (:func:`profile_positions`) and return the report. After each candidate the original order is
    restored (also when ``run_forward`` raises, which is then re-raised), so the model ends bit for
    bit as it started.

    Every rank of the model must call it with the same ``results``: placements move experts
    between EP ranks. ``run_forward`` runs one forward (e.g. a fixed batch under ``torch.no_grad``)
    and must leave no accumulated gradients (placing refuses them). Each candidate gets ``warmup``
    untimed and ``repeats`` timed calls, each after a barrier and, on GPU, a synchronize; each
    repeat's time is the maximum over ``group`` (default: every rank, so data-parallel replicas
    cannot choose different layouts) and the candidate's time the median of its repeats.
    ``tokens`` (per call, over all ranks) adds tokens/s; ``trace`` adds devices per token;
    ``clock`` is replaceable for tests.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup must be >= 0 and repeats >= 1, got {warmup} and {repeats}")
    layers = moe_layers(model)
    ep_sizes = {mcore_utils.get_pg_size(layer.ep_group) for layer in layers.values()}
    if len(ep_sizes) != 1:
        raise ValueError(f"the model's MoE layers run at different expert-parallel sizes {sorted(ep_sizes)}")
    ep_size = ep_sizes.pop()
    first = next(iter(layers.values()))
    routing_groups = first.config.moe_router_num_groups or 1
    device = next(first.parameters()).device
    distributed = dist.is_available() and dist.is_initialized()

    def start_together() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if distributed:
            dist.barrier(group)

    positions = profile_positions(results, candidates)
    measured = []
    for position in positions:
        placement = placement_at(results, position, ep_size, routing_groups)
        apply_placement(model, placement)
        try:
            for _ in range(warmup):
                run_forward()
            repeat_times = []
            for _ in range(repeats):
                start_together()
                start = clock()
                run_forward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                repeat_times.append(clock() - start)
            measured.append(repeat_times)
        finally:
            restore_original_order(model, placement)
    agreed = torch.tensor(measured, dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return ProfileReport.from_times(results, ep_size, list(zip(positions, agreed.tolist())), tokens, trace,
                                    routing_groups)
