"""LLEPTokenDispatcher: Megatron's alltoall dispatcher plus a per-step least-loaded spill.

Per step it all-gathers the ``[P, N]`` routed-token counts, plans (every rank gets the same plan),
and then either

* runs Megatron's own alltoall code unchanged (plan is plain EP: balanced below ``lambda`` or no
  spill worthwhile), or
* sends each token-expert pair to the rank the plan chose, with the borrowed experts' weights
  travelling by P2P alongside the token all-to-all, and restores the original order on combine.

Both paths share Megatron's ``permute``/``unpermute`` around them, so the layer's inputs and
outputs are laid out exactly as plain EP's.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
import functools
from typing import Any, Callable, List, Optional

import numpy as np
import torch

from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.compat import mcore
from megatron_llep.compat.torch_api import all_gather_single, running_backward
from megatron_llep.config import LLEPConfig
from megatron_llep.planning.plan import LLEPPlan, RankPlan
from megatron_llep.planning.planner import plan_llep
from megatron_llep.runtime.experts import ExpertAdapter
from megatron_llep.runtime.kept_weights import (DeferredGradReady, KeptExperts, add_returned_gradients,
                                                add_returned_outside_autograd, add_to_param_grads)
from megatron_llep.runtime.megatron_checks import check_megatron_config
from megatron_llep.runtime.permutation import RowPermutation, SendColumns
from megatron_llep.runtime.state import (STATS, gradient_sync_on, last_backward_of_step, ledger_for,
                                         weight_exchange_group)
from megatron_llep.runtime.statistics import LLEPStepStats
from megatron_llep.runtime.weight_exchange import ExpertWeightExchange


def _routing_fingerprint(routing_map: torch.Tensor) -> torch.Tensor:
    """One int64 that tells apart two routings with equal per-expert counts: per expert, the sum of
    its tokens' positions, mixed over the experts (int64 wrap-around is a fine hash). A recompute
    reproduces it exactly; another micro-batch almost never does."""
    tokens, experts = routing_map.shape
    positions = torch.arange(1, tokens + 1, dtype=torch.int32, device=routing_map.device).unsqueeze(1)
    per_expert = (routing_map * positions).sum(dim=0, dtype=torch.int64)
    mix = torch.arange(experts, dtype=torch.int64, device=routing_map.device) * 2654435761 + 1
    return (per_expert * mix).sum()


@dataclass
class _StepPlan:
    """One forward's plan and what this rank derived from it (kept for its recompute)."""

    routing: np.ndarray  # [P, N + 1]: every rank's counts and routing fingerprint, as gathered
    plan: LLEPPlan
    awaits_recompute: bool = False  # a no-grad forward whose recompute in backward reuses this step
    rank_plan: Optional[RankPlan] = None
    send_columns: Optional[SendColumns] = None
    recv_perm: Optional[RowPermutation] = None
    exchange: Optional[ExpertWeightExchange] = None


class LLEPTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Alltoall dispatcher that balances expert load across EP ranks each step (LLEP)."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config: TransformerConfig,
        pg_collection: ProcessGroupCollection,
        llep_config: LLEPConfig,
        expert_adapter: ExpertAdapter,
        layer_number: Optional[int] = None,
    ) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        check_megatron_config(config, self.tp_size)
        llep_config.validate_layout(self.num_experts, self.ep_size)
        self.llep_config = llep_config
        self.adapter = expert_adapter
        self.layer_number = layer_number
        self.ep_rank = self.ep_group.rank()
        self.expert_shape = expert_adapter.expert_shape(config)
        self.plan: Optional[LLEPPlan] = None
        self.rank_plan: Optional[RankPlan] = None
        self.last_stats: Optional[LLEPStepStats] = None
        self._llep_active = False
        self._exchange: Optional[ExpertWeightExchange] = None
        self._step: Optional[_StepPlan] = None
        self._tokens_per_expert: Optional[torch.Tensor] = None
        self.training = True
        # the steps of no-grad forwards inside Megatron's activation checkpointing (selective "moe"
        # or full recompute), oldest first: each recompute in backward takes its own forward's
        self._awaiting_recompute: list[_StepPlan] = []
        # borrowed weights travel on a communicator of their own, so that under NCCL they do not
        # queue behind (or in front of) the token all-to-all on the EP group's communicator
        self.weight_group = weight_exchange_group(self.ep_group)
        # borrowed experts kept for the step (kept_weights): this rank's copies, and the EP group's
        # ledger of who keeps what; forwards whose backward (with its gradient return) is to come
        self.kept = KeptExperts()
        self.kept_copy_bytes = self.expert_shape.kept_copy_bytes
        self.ledger = ledger_for(self.weight_group)
        self.ledger.register(self)
        # forwards of this layer in this step whose backward is still to come (the same count on
        # every EP rank: the step's return of kept gradients waits until it is 0)
        self._in_flight = 0
        # set when Megatron DDP wraps the layer (state._after_ddp_built): the step's return runs
        # behind the backward, and with overlapped grad reduce the native experts' buckets wait for it
        self.return_behind_backward = False
        self.deferred_grad_ready: Optional[DeferredGradReady] = None
        # Megatron sets this only in its own preprocess; its D2H helper reads it on every step.
        self.num_global_tokens_per_local_expert = None

    # ------------------------------------------------------------------ planning
    @property
    def llep_active(self) -> bool:
        """True in a step whose plan moves tokens off their native ranks."""
        return self._llep_active

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Plan from the global counts, then Megatron's own preprocess and permute: unchanged on
        plain-EP steps; with the plan folded into the routing map on spilling steps."""
        if self.ep_size == 1 or not self.llep_config.enabled:
            self._llep_active = False
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self._plan_from_counts(routing_map)
        if self._llep_active:
            routing_map, probs = self._send_columns.apply(routing_map, probs)
            if self.config.moe_permute_fusion:  # TE's fused permute: token-major, as the router returns them
                routing_map, probs = routing_map.contiguous(), probs.contiguous()
        return super().dispatch_preprocess(hidden_states, routing_map, probs)

    def preprocess(self, routing_map: torch.Tensor) -> Optional[torch.Tensor]:
        """Megatron's metadata: its own on steps LLEP leaves alone, else set by the plan."""
        if self.ep_size == 1 or not self.llep_config.enabled:
            tokens_per_expert = super().preprocess(routing_map)
            if self.llep_config.pruning is not None:
                # pruned tokens have fewer than top-K experts, so the permute's row count is not
                # Megatron's dropless tokens * K: count it, as Megatron does when it drops tokens
                self.num_out_tokens = routing_map.sum()
                self._maybe_update_cuda_sync_point("before_permutation_1")
            return tokens_per_expert
        return self._tokens_per_expert

    def _plan_from_counts(self, routing_map: torch.Tensor) -> None:
        """Gather the ``[P, N]`` counts, plan (or, in a recompute, take the plan of the forward it
        recomputes), and set the metadata of the chosen path."""
        device = routing_map.device
        # per rank: its counts, a fingerprint of its routing (a recompute finds its own forward's
        # step by both), and the epoch of its kept experts, so that a rank that dropped its copies
        # on its own (kept_weights) makes every rank drop theirs before planning with them
        local = torch.cat([routing_map.sum(dim=0).long(), _routing_fingerprint(routing_map).view(1),
                           torch.tensor([self.ledger.epoch], device=device)])
        gathered = torch.empty(self.ep_size * (self.num_experts + 2), dtype=torch.long, device=device)
        all_gather_single(gathered, local, group=self.ep_group)
        gathered = gathered.cpu().numpy().reshape(self.ep_size, self.num_experts + 2)
        routing, epochs = gathered[:, :-1], gathered[:, -1]
        counts = routing[:, :-1]
        if epochs.min() != epochs.max():
            self.ledger.drop_all("a rank dropped its kept borrowed experts")
            self.ledger.epoch = int(epochs.max())
        self.num_out_tokens = int(counts[self.ep_rank].sum())  # the permute's rows, dropped tokens excluded

        # a forward with grad inside a backward is an activation recompute: its backward was counted
        # with the forward it recomputes, and its plan is that forward's
        recompute = self.training and torch.is_grad_enabled() and running_backward()
        step = self._recomputed_step(routing) if recompute else None
        if step is None:
            step = self._plan_step(counts, routing, device)
            if self.training and not recompute:
                step.awaits_recompute = not torch.is_grad_enabled() and mcore.in_checkpointed_forward()
                if step.awaits_recompute:
                    self._awaiting_recompute.append(step)
                if torch.is_grad_enabled() or step.awaits_recompute:  # a backward will follow
                    self._in_flight += 1
                    self.ledger.mark_pending(self)
        self._step = step
        self.plan, self.rank_plan, self._exchange = step.plan, step.rank_plan, step.exchange
        if step.plan.is_plain_ep:
            self._llep_active = False
            self._tokens_per_expert = self._plain_ep_metadata(counts)
            return
        self._llep_active = True
        self._tokens_per_expert = None
        self._send_columns, self._recv_perm = step.send_columns, step.recv_perm
        self._input_split_list = step.rank_plan.input_splits.tolist()
        self._output_split_list = step.rank_plan.output_splits.tolist()

    def _plan_step(self, counts: np.ndarray, routing: np.ndarray, device: torch.device) -> "_StepPlan":
        start = time.perf_counter()
        config = self.llep_config
        plan = plan_llep(counts, config, self.expert_shape, self.layer_number, held=self.ledger.held_for(self),
                         keep_room=self.ledger.room(self, self.kept_copy_bytes, config.max_kept_weight_bytes, device))
        # training drops its copies at the step's end; evaluation keeps them while plans use them
        self.ledger.record(self, plan, self.kept_copy_bytes, drop_unused=not self.training)
        plan_time = time.perf_counter() - start
        if self.llep_config.record_stats:
            self.last_stats = LLEPStepStats.from_plan(plan, self.layer_number, self.expert_shape.weight_bytes, plan_time,
                                                      self.ledger.used.copy())
            STATS.record(self.last_stats)
        step = _StepPlan(routing, plan)
        if plan.is_plain_ep:
            return step
        step.rank_plan = plan.rank_view(self.ep_rank)
        step.send_columns = SendColumns(step.rank_plan, device)
        step.recv_perm = RowPermutation.recv_order(step.rank_plan, device)
        kept = plan.transfer_kept
        kept_pairs = frozenset(zip(plan.transfer_expert[kept].tolist(), plan.transfer_helper[kept].tolist()))
        exchange = ExpertWeightExchange(self.weight_group, self.adapter, self.local_expert_indices[0], step.rank_plan,
                                        device, self.kept, kept_pairs)
        step.exchange = exchange if exchange.active else None
        return step

    # ------------------------------------------------------------------ borrowed experts, for the layer
    def borrowed_weight_calls(self) -> list[tuple[Callable[[torch.Tensor], tuple[torch.Tensor, list]], int]]:
        """This step's borrowed experts on this rank, in slot order after the native ones, as calls
        that hand out their weights with the number of experts each holds: the kept copies, then each
        wave of copies once it has arrived. A call takes the native experts' output, chains it through
        (its backward posts the borrowed weights' gradients) and returns it with the weights per expert."""
        exchange = self.weight_exchange
        if exchange is None:
            return []
        calls = [(exchange.finish_held, len(exchange.held))] if exchange.held else []
        return calls + [(functools.partial(exchange.finish_wave, wave), len(exchange.wave_receives[wave]))
                        for wave in exchange.waves]

    def end_forward(self) -> None:
        """The experts have run: drop the received weights when no backward and no recompute will use them."""
        exchange = self.weight_exchange
        if exchange is not None and not torch.is_grad_enabled() and not self.forward_awaits_recompute:
            exchange.release_received()

    # ------------------------------------------------------------------ gradient return
    def attach_gradient_return(self, expert_input: torch.Tensor) -> torch.Tensor:
        """Pass the experts' input through the node that ends this micro-batch's gradient returns.

        Its backward runs once every expert on this rank, native and borrowed, has produced its input
        gradient, and before the dispatch all-to-all's backward (which needs that gradient): it
        completes the per-micro-batch returns of the weight exchange (copies that are not kept), then
        the step's return of the kept ones when this backward ends the step (:meth:`_finish_kept_in_backward`).
        The native parameters of the lent experts (sent or kept elsewhere) are inputs of the node, so
        Megatron DDP's gradient hooks on them fire only after the returned gradients are in, and
        without DDP their gradients come back through autograd. Made on every EP rank alike whenever
        any LLEP layer keeps borrowed experts (any rank's, by the ledger: the step's return may happen
        in, or move on at, this backward) or Megatron DDP overlaps grad reduce (its expert buckets are
        let through here: kept_weights.DeferredGradReady), and wherever this rank lends or borrows now."""
        exchange = self.weight_exchange
        if not (torch.is_grad_enabled() and self.training):
            return expert_input  # no backward, or (activation recompute) the node comes with the recompute
        held = self.ledger.held_for(self)
        # any layer's kept copies: every layer's backward, on every EP rank, is a point where returns
        # under way move on (kept_weights.GradientReturn), so the node is made alike everywhere
        if (exchange is None and not any(h.any() for h in self.ledger.held.values()) and not self.ledger.returning
                and self.deferred_grad_ready is None):
            self._in_flight = max(self._in_flight - 1, 0)  # this forward's backward returns nothing
            return expert_input
        local = self.num_local_experts
        first = self.local_expert_indices[0]
        lent = set(exchange.sent_experts) if exchange is not None else set()
        if held is not None:
            lent |= {first + int(e) for e in np.nonzero(held[first : first + local].any(axis=1))[0]}
        lent_experts = sorted(lent)
        tensors = [t for expert in lent_experts for t in self.adapter.expert_tensors(expert - first)]
        return _ReturnBorrowedGradients.apply(expert_input, (self, exchange, lent_experts), *tensors)

    def _returned_gradients(self, exchange: Optional[ExpertWeightExchange],
                            lent_experts: list[int]) -> list[Optional[torch.Tensor]]:
        """The gradient return node's backward: the gradient each lent expert's tensors get back
        through autograd (``None`` where it went straight into ``main_grad``)."""
        adapter, first = self.adapter, self.local_expert_indices[0]
        per_expert = len(adapter.tensor_specs())
        now = dict(zip(exchange.sent_experts, _chunks(exchange.return_gradients(), per_expert))) if exchange else {}
        kept = self._finish_kept_in_backward()
        grads: list[Optional[torch.Tensor]] = []
        for expert in lent_experts:
            params = adapter.expert_tensors(expert - first)
            parts = now.get(expert, [None] * per_expert)
            sums = kept.pop(expert - first, None)
            for param, part, total in zip(params, parts, sums or [None] * per_expert):
                if total is not None:
                    part = total.to(param.dtype) if part is None else (part.float() + total).to(param.dtype)
                grads.append(part)
        for local_expert, sums in kept.items():  # kept elsewhere by a forward after this one: no autograd slot
            add_to_param_grads(adapter, local_expert, sums)
        return grads

    def _finish_kept_in_backward(self) -> dict[int, list[torch.Tensor]]:
        """At the end of a micro-batch's backward (on every EP rank alike): move the returns under
        way on by a phase, then start or make the step's return of this layer's kept experts'
        gradients when this is the reducing backward (gradient sync on) and no forward of the
        layer still awaits its backward: here, or, under Megatron DDP (``return_behind_backward``),
        behind the layers below from the step's known last backward and otherwise at
        ``finish_grad_sync``; with overlapped grad reduce, the expert buckets of the layers above
        whose gradients are home start reducing (kept_weights.DeferredGradReady). Returns the fp32
        sums of lent experts without ``main_grad``."""
        self._in_flight = max(self._in_flight - 1, 0)
        for layer, returned in self.ledger.progress_returns():
            add_returned_outside_autograd(layer.adapter, returned)
        if self.deferred_grad_ready is not None and gradient_sync_on():
            self.deferred_grad_ready.release(below=self)  # the layers above are complete
        if not gradient_sync_on() or self._in_flight:
            return {}
        if self.return_behind_backward:  # the return waits for finish_grad_sync, behind the layers below if it can
            if last_backward_of_step():
                config = self.llep_config
                self.ledger.start_return(self, self.adapter, self.local_expert_indices[0], config.ranks_per_node,
                                         config.relay_within_node)
            return {}
        return dict(add_returned_gradients(self.adapter, self._flush_kept()))

    def _flush_kept(self) -> dict[int, list[torch.Tensor]]:
        config = self.llep_config
        returned = self.ledger.flush_layer(self, self.adapter, self.local_expert_indices[0], config.ranks_per_node,
                                           config.relay_within_node)
        self._in_flight = 0
        return returned

    def flush_kept_gradients(self) -> None:
        """Return this layer's kept experts' gradients now, outside autograd (every EP rank calls
        it at the same point: :func:`megatron_llep.runtime.state.finish_borrowed_gradients`)."""
        add_returned_outside_autograd(self.adapter, self._flush_kept())

    @property
    def forward_awaits_recompute(self) -> bool:
        """Whether the forward running now is a no-grad forward that backward will recompute (its
        received weights must outlive it)."""
        return self._step is not None and self._step.awaits_recompute

    def _recomputed_step(self, routing: np.ndarray) -> Optional["_StepPlan"]:
        """The saved step (plan and received weights) of the forward that backward is recomputing
        now: the oldest waiting one whose gathered counts and routing fingerprints equal the
        recompute's, whatever order the backwards run in. All EP ranks decide alike: they gathered
        the same routing. A recompute that matches none (it did not reproduce its forward's
        routing) is planned again and takes the place of the oldest, so every forward is counted
        once; ``None`` then."""
        for index, step in enumerate(self._awaiting_recompute):
            if np.array_equal(step.routing, routing):
                step.awaits_recompute = False
                return self._awaiting_recompute.pop(index)
        if self._awaiting_recompute:
            self._awaiting_recompute.pop(0)
            warnings.warn(f"LLEP: the activation recompute of MoE layer {self.layer_number} routed its tokens "
                          "differently from its forward; it was planned again (is the recompute deterministic?)")
        return None

    @property
    def backwards_to_come(self) -> int:
        """Forwards of this layer in this step whose backward has not run yet."""
        return self._in_flight

    def end_step(self) -> None:
        """The step's backwards are over: no forward of it awaits a backward or a recompute (one that
        never ran its backward must not hold the next step's return back)."""
        self._awaiting_recompute.clear()
        self._in_flight = 0

    def _plain_ep_metadata(self, counts: np.ndarray) -> torch.Tensor:
        """Megatron's preprocess outputs (expert TP size 1), derived from the gathered counts."""
        local = counts[:, self.local_expert_indices[0] : self.local_expert_indices[-1] + 1]
        self.input_splits = counts[self.ep_rank].reshape(self.ep_size, self.num_local_experts).sum(axis=1)
        self.output_splits = local.sum(axis=1)
        self.output_splits_tp = np.array([local.sum()])
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = torch.from_numpy(local.copy()).to(self.permute_idx_device)
        return torch.from_numpy(local.sum(axis=0))

    @property
    def weight_exchange(self) -> Optional[ExpertWeightExchange]:
        """This step's weight transfers, posted in ``token_dispatch``; ``None`` when this rank
        neither lends nor borrows an expert (the layer finishes it after the native experts)."""
        return self._exchange if self._llep_active else None

    # ------------------------------------------------------------------ dispatch
    def token_dispatch(self, permutated_local_input_tokens: torch.Tensor, permuted_probs: torch.Tensor):
        if not self._llep_active:
            return super().token_dispatch(permutated_local_input_tokens, permuted_probs)
        if self._exchange is not None:
            if self._exchange.sends:  # the weights must be this step's (overlapped param all-gather)
                mcore.finish_param_sync(self.adapter.experts)
            self._exchange.start()
        if self.shared_experts is not None:
            mcore.shared_experts_wait_current_stream(self.shared_experts)
        global_tokens = self._all_to_all(permutated_local_input_tokens, self._output_split_list, self._input_split_list)
        if self.shared_experts is not None:
            # the overlapped shared expert's fc1 runs behind the token a2a (Megatron 0.18+'s order)
            self.shared_experts.linear_fc1_forward_and_act(global_tokens)
        global_probs = self._all_to_all(permuted_probs, self._output_split_list, self._input_split_list)
        return global_tokens, global_probs

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        if not self._llep_active:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        tokens = self._recv_perm.apply(global_input_tokens)
        probs = self._recv_perm.apply(global_probs)
        return tokens, torch.from_numpy(self.rank_plan.tokens_per_slot.copy()), probs

    # ------------------------------------------------------------------ combine
    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._llep_active:
            return super().combine_preprocess(hidden_states)
        return self._recv_perm.undo(hidden_states)

    def token_combine(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self._llep_active:
            return super().token_combine(hidden_states, *args, **kwargs)
        if self.shared_experts is not None:
            mcore.shared_experts_wait_current_stream(self.shared_experts)
        tokens = self._all_to_all(hidden_states, self._input_split_list, self._output_split_list)
        if self.shared_experts is not None and mcore.SHARED_EXPERT_FC2_IN_TOKEN_COMBINE:
            # where the base class runs it; before 0.18 its combine_postprocess does, for both paths
            self.shared_experts.linear_fc2_forward(tokens)
            self.shared_experts.post_forward_comm()
        return tokens  # destination-major, as Megatron's unpermute with the send columns expects

    def _all_to_all(self, tokens: torch.Tensor, output_splits: list, input_splits: list) -> torch.Tensor:
        return mcore.all_to_all(
            self.ep_group, tokens, output_splits, input_splits, getattr(self, "use_nccl_stream", False)
        )


class _ReturnBorrowedGradients(torch.autograd.Function):
    """Identity on the experts' input; backward completes the gradient returns to the lent experts
    (:meth:`LLEPTokenDispatcher.attach_gradient_return`)."""

    @staticmethod
    def forward(ctx, expert_input, state, *lent):
        ctx.state = state
        return expert_input.view_as(expert_input)

    @staticmethod
    def backward(ctx, grad_expert_input):
        dispatcher, exchange, lent_experts = ctx.state
        return (grad_expert_input, None, *dispatcher._returned_gradients(exchange, lent_experts))


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]

