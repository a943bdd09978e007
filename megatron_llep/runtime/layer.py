"""LLEPMoELayer and the one-line ways to put it into a Megatron model.

``LLEPMoELayer`` is Megatron's ``MoELayer`` with the :class:`LLEPTokenDispatcher` and the borrowed
expert compute; its parameters and state dict are unchanged, so checkpoints move freely between
plain EP and LLEP. With ``LLEPConfig.pruning`` (inference only) it also prunes each token's routing
before dispatch (CAP's device-level pruning or the naive expert-level baseline).

Enable it in a layer spec::

    spec = with_llep(get_gpt_decoder_block_spec(config, use_transformer_engine=False), LLEPConfig())
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import numpy as np
import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.compat import mcore
from megatron_llep.config import LLEPConfig
from megatron_llep.runtime.dispatcher import LLEPTokenDispatcher
from megatron_llep.runtime.experts import make_expert_adapter
from megatron_llep.runtime.pruning import device_costs, prune_routing_map
from megatron_llep.runtime.state import STATS
from megatron_llep.runtime.statistics import PruningStepStats


class LLEPMoELayer(MoELayer):
    """Megatron MoELayer whose expert parallelism spills hot experts to least-loaded ranks."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        llep_config: Optional[LLEPConfig] = None,
        **kwargs: Any,
    ) -> None:
        # kwargs: what the installed MoELayer also takes (0.17+: is_mtp_layer; 0.18+: name)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(
            config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs
        )
        self.llep_config = llep_config if llep_config is not None else LLEPConfig()
        self.expert_adapter = make_expert_adapter(self.experts, self.num_local_experts)
        shared_experts = self.token_dispatcher.shared_experts
        self.token_dispatcher = LLEPTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
            llep_config=self.llep_config,
            expert_adapter=self.expert_adapter,
            layer_number=layer_number,
        )
        if shared_experts is not None:
            self.token_dispatcher.set_shared_experts(shared_experts)
        self.last_pruning_stats: Optional[PruningStepStats] = None
        self._device_costs: dict[tuple, torch.Tensor] = {}  # c_d seen from this EP rank
        # pruning rewrites the router's output, first among its hooks: whatever observes the router
        # (routing-trace recorder, load meters) sees the routing that is actually dispatched
        self.router.register_forward_hook(self._prune_routing, prepend=True)
        self._register_load_state_dict_pre_hook(self._drop_kept_before_load)

    def train(self, mode: bool = True) -> "LLEPMoELayer":
        if mode != self.token_dispatcher.training:  # kept borrowed experts serve one mode only
            self.token_dispatcher.ledger.invalidate("the model switched between training and evaluation")
        super().train(mode)
        self.token_dispatcher.training = mode
        return self

    def _drop_kept_before_load(self, *args: Any) -> None:
        self.token_dispatcher.ledger.invalidate("a state dict was loaded into an LLEP layer")

    def set_layer_number(self, layer_number: int) -> None:
        super().set_layer_number(layer_number)
        self.token_dispatcher.layer_number = mcore.moe_layer_number(self)  # MTP layers after the decoder's

    def _prune_routing(self, router: torch.nn.Module, inputs: tuple, output: tuple) -> Optional[tuple]:
        """Forward hook on the router: ``LLEPConfig.pruning`` applied to its ``(probs, routing_map)``
        (device of expert ``e``: EP rank ``e // M``; costs seen from this EP rank), statistics
        recorded; ``None`` (output unchanged) without pruning."""
        pruning = self.llep_config.pruning
        if pruning is None:
            return None
        if self.training:
            raise ValueError("LLEPConfig.pruning is lossy and inference-only: call model.eval() or set "
                             "LLEPConfig.pruning=None")
        probs, routing_map = output
        dispatcher = self.token_dispatcher
        key = (probs.device, self.llep_config.ranks_per_node, pruning.cross_node_cost)  # configs may be swapped
        cost = self._device_costs.get(key)
        if cost is None:
            cost = self._device_costs[key] = device_costs(
                dispatcher.ep_rank, dispatcher.ep_size, key[1], key[2]).to(probs.device)
        pruned_map, pruned_probs = prune_routing_map(routing_map, probs, self.num_local_experts, cost, pruning.p,
                                                     pruning.method)
        if self.llep_config.record_stats:
            hidden = inputs[0]
            bytes_per_pair = 2 * hidden.shape[-1] * hidden.element_size() + pruned_probs.element_size()
            self.last_pruning_stats = PruningStepStats.from_routing(
                dispatcher.layer_number, routing_map, pruned_map, dispatcher.ep_rank, self.num_local_experts,
                bytes_per_pair, self.llep_config.ranks_per_node)
            STATS.record_pruning(self.last_pruning_stats)
        return pruned_probs, pruned_map

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """MoELayer's own compute on plain-EP steps; on spilling steps the native experts, the
        borrowed experts this rank keeps, then each wave of copies as it arrives, with the same math."""
        dispatcher = self.token_dispatcher
        if not dispatcher.llep_active:
            # the step's return of kept experts' gradients may fall in this backward
            return super().routed_experts_compute(dispatcher.attach_gradient_return(hidden_states), probs)
        hidden, tokens_per_slot, slot_probs = dispatcher.dispatch_postprocess(hidden_states, probs)
        counts = tokens_per_slot.tolist()
        hidden = dispatcher.attach_gradient_return(hidden)
        local = self.num_local_experts
        # the experts' calls, in slot order: native experts first, while the borrowed weights may
        # still be in flight; then the kept copies; then each wave as soon as its weights are in
        calls = dispatcher.borrowed_weight_calls()
        bounds = np.cumsum([0, local] + [n for _, n in calls])
        # one split of the rows for all calls: in backward a slice per call would each allocate a
        # zero-filled gradient of the whole input
        sizes = [sum(counts[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        pieces, piece_probs = (hidden.split(sizes), slot_probs.split(sizes)) if calls else ([hidden], [slot_probs])
        output = self.expert_adapter.forward_native(pieces[0], counts[:local], piece_probs[0])
        borrowed_outputs = []
        for (finish, _), a, b, piece, piece_prob in zip(calls, bounds[1:-1], bounds[2:], pieces[1:], piece_probs[1:]):
            output, borrowed = finish(output)
            if borrowed:
                borrowed_outputs += self.expert_adapter.forward_borrowed_part(piece, counts[a:b], piece_prob, borrowed)
        dispatcher.end_forward()
        if borrowed_outputs:
            # the slots' outputs in one tensor for the combine permutation; the parts are not needed
            # by autograd (cat saves none), so drop them before the permutation's copy exists
            output = torch.cat([output, *borrowed_outputs], dim=0)
            del borrowed_outputs
        return dispatcher.combine_preprocess(output), None


def with_llep(spec: Any, llep_config: Optional[LLEPConfig] = None) -> Any:
    """A copy of a Megatron layer/block spec with every ``MoELayer`` replaced by ``LLEPMoELayer``.

    Works on the spec trees of every supported release (``get_gpt_layer_local_spec``,
    ``get_gpt_decoder_block_spec`` ...; ModuleSpec or, from 0.18, ``functools.partial`` MoE specs).
    Raises if the spec holds no MoE layer, since that is almost certainly a configuration mistake.
    """
    llep_config = llep_config if llep_config is not None else LLEPConfig()
    found = []

    def to_llep(cls: type, params: dict) -> Optional[tuple[type, dict]]:
        if issubclass(cls, LLEPMoELayer):
            return None
        found.append(cls)
        return LLEPMoELayer, {**params, "llep_config": llep_config}

    result = mcore.replace_moe_layers(copy.deepcopy(spec), to_llep)
    if not found:
        raise ValueError("with_llep: the spec contains no MoELayer (is num_moe_experts set for these layers?)")
    return result
