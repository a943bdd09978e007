"""The LLEP runtime: what runs inside a training or inference step of a Megatron MoE layer.

:class:`~megatron_llep.runtime.layer.LLEPMoELayer` (with :func:`~megatron_llep.runtime.layer.with_llep`)
and its :class:`~megatron_llep.runtime.dispatcher.LLEPTokenDispatcher`, which plans each step and
moves tokens (:mod:`.permutation`) and borrowed experts' weights (:mod:`.weight_exchange`); the
borrowed experts computed with the native experts' own code (:mod:`.experts`); copies kept for the
optimizer step and the one return of their gradients (:mod:`.kept_weights`); the process-wide state
and the step boundaries watched (:mod:`.state`); per-layer statistics (:mod:`.statistics`); routing
pruning for inference (:mod:`.pruning`); the Megatron settings refused (:mod:`.megatron_checks`);
forcing a routing onto a router, a test tool (:mod:`.forced_routing`).
"""
