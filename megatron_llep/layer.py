"""LLEPMoELayer and the one-line ways to put it into a Megatron model.

``LLEPMoELayer`` is Megatron's ``MoELayer`` with the :class:`LLEPTokenDispatcher` and the borrowed
expert compute; its parameters and state dict are unchanged, so checkpoints move freely between
plain EP and LLEP.

Enable it in a layer spec::

    spec = with_llep(get_gpt_decoder_block_spec(config, use_transformer_engine=False), LLEPConfig())
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_llep.config import LLEPConfig
from megatron_llep.dispatcher import LLEPTokenDispatcher
from megatron_llep.experts import make_expert_adapter


class LLEPMoELayer(MoELayer):
    """Megatron MoELayer whose expert parallelism spills hot experts to least-loaded ranks."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        llep_config: Optional[LLEPConfig] = None,
    ) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
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

    def set_layer_number(self, layer_number: int) -> None:
        super().set_layer_number(layer_number)
        self.token_dispatcher.layer_number = layer_number

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Native experts as in MoELayer, plus this step's borrowed experts with the same math."""
        dispatcher = self.token_dispatcher
        dispatched_input, tokens_per_slot, permuted_probs = dispatcher.dispatch_postprocess(hidden_states, probs)
        if dispatcher.borrowed_weights:
            expert_output = self.expert_adapter.forward(
                dispatched_input, tokens_per_slot.tolist(), permuted_probs, dispatcher.borrowed_weights
            )
        else:
            expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_slot, permuted_probs)
            assert mlp_bias is None, "experts must fold their bias into the output for token dispatch"
        return dispatcher.combine_preprocess(expert_output), None


def with_llep(spec: Any, llep_config: Optional[LLEPConfig] = None) -> Any:
    """A copy of a Megatron layer/block spec with every ``MoELayer`` replaced by ``LLEPMoELayer``.

    Works on ModuleSpec trees (``get_gpt_layer_local_spec``, ``get_gpt_decoder_block_spec`` ...).
    Raises if the spec holds no MoE layer, since that is almost certainly a configuration mistake.
    """
    llep_config = llep_config if llep_config is not None else LLEPConfig()
    found = []
    result = _replace_moe(copy.deepcopy(spec), llep_config, found)
    if not found:
        raise ValueError("with_llep: the spec contains no MoELayer (is num_moe_experts set for these layers?)")
    return result


def _replace_moe(node: Any, llep_config: LLEPConfig, found: list) -> Any:
    if isinstance(node, ModuleSpec):
        if isinstance(node.module, type) and issubclass(node.module, MoELayer) and not issubclass(node.module, LLEPMoELayer):
            node.module = LLEPMoELayer
            node.params = {**node.params, "llep_config": llep_config}
            found.append(node)
        node.submodules = _replace_moe(node.submodules, llep_config, found)
        return node
    if isinstance(node, (list, tuple)):
        return type(node)(_replace_moe(item, llep_config, found) for item in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            setattr(node, field.name, _replace_moe(getattr(node, field.name), llep_config, found))
        return node
    return node
