"""Record routing traces from a running Megatron model.

A forward hook on each MoE layer's router (``TopKRouter``) reads the ``routing_map`` the router
returns, i.e. exactly the experts the tokens are dispatched to (after top-K, group limiting,
expert bias and any capacity dropping; router replay included). Per layer it keeps

* exact per-expert counts of every token seen, and
* a uniform sample of at most ``max_tokens_per_layer`` tokens' expert ids (reservoir sampling,
  Algorithm R, vectorised per micro-batch): memory is bounded by ``cap * K`` int16 per layer.

Each process records its own tokens (its data-parallel shard; EP ranks route different tokens);
save one file per rank (``trace.save(f"trace_rank{rank}.npz")``) and merge them when planning
(:func:`~megatron_llep.placement.trace.load_traces`, or pass all files to the CLI). Cost: one
``[T, N]`` sort per layer and step and a ``[T, K]`` host copy (a device sync) — meant for a short
profiling run. With activation recomputation of the MoE layer, recomputed forwards are recorded
again (duplicate tokens, identical routing; co-activation ratios are unaffected).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from megatron_llep.integrations.placement import Model, moe_layers
from megatron_llep.placement.trace import LayerTrace, RoutingTrace


class _Reservoir:
    """Uniform sample of at most ``capacity`` rows of a stream (``None``: keep all)."""

    def __init__(self, topk: int, num_experts: int, capacity: Optional[int], rng: np.random.Generator) -> None:
        self.capacity = capacity
        self.rng = rng
        self.rows = np.empty((0, topk), np.int16)
        self.seen = 0
        self.counts = np.zeros(num_experts, np.int64)

    def add(self, rows: np.ndarray) -> None:
        count = rows.shape[0]
        np.add.at(self.counts, rows[rows >= 0].astype(np.int64), 1)
        if self.capacity is None:
            self.rows = np.concatenate([self.rows, rows])
        else:
            fill = max(0, min(count, self.capacity - self.rows.shape[0]))
            self.rows = np.concatenate([self.rows, rows[:fill]])
            position = self.seen + np.arange(fill, count)  # stream index of each remaining row
            slot = self.rng.integers(0, position + 1) if position.size else position
            accepted = slot < self.capacity
            # Algorithm R replaces sequentially: when two rows hit one slot, the later one stays
            slot_rev, rows_rev = slot[accepted][::-1], rows[fill:][accepted][::-1]
            unique_slot, last = np.unique(slot_rev, return_index=True)
            self.rows[unique_slot] = rows_rev[last]
        self.seen += count


def routing_map_to_ids(routing_map: torch.Tensor, topk: int) -> np.ndarray:
    """``[T, N]`` boolean routing map -> ``int16 [T, K]`` ascending expert ids, ``-1`` padded."""
    chosen = routing_map.reshape(-1, routing_map.shape[-1]).to(torch.int8)
    order = torch.sort(chosen, dim=1, descending=True, stable=True)[1][:, :topk]
    valid = chosen.gather(1, order).bool()
    ids = torch.where(valid, order, torch.full_like(order, -1))
    return ids.to(device="cpu", dtype=torch.int16).numpy()


class RoutingTraceRecorder:
    """Hooks every MoE layer's router of ``model`` while active (``with recorder: ...`` or
    :meth:`start` / :meth:`stop`); :meth:`trace` returns what was recorded."""

    def __init__(self, model: Model, max_tokens_per_layer: Optional[int] = 16384, seed: int = 0) -> None:
        if max_tokens_per_layer is not None and max_tokens_per_layer <= 0:
            raise ValueError(f"max_tokens_per_layer must be positive or None, got {max_tokens_per_layer}")
        self.layers = moe_layers(model)
        configs = {(layer.config.num_moe_experts, layer.config.moe_router_topk) for layer in self.layers.values()}
        if len(configs) != 1:
            raise ValueError(f"all MoE layers must share num_experts and top-K to form one trace, got {sorted(configs)}")
        self.num_experts, self.topk = configs.pop()
        self.max_tokens_per_layer = max_tokens_per_layer
        rng = np.random.default_rng(seed)
        self._reservoirs = {
            n: _Reservoir(self.topk, self.num_experts, max_tokens_per_layer, np.random.default_rng(rng.integers(2**63)))
            for n in self.layers
        }
        self._handles: list = []

    def start(self) -> "RoutingTraceRecorder":
        if not self._handles:
            for number, layer in self.layers.items():
                self._handles.append(layer.router.register_forward_hook(self._hook(number)))
        return self

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "RoutingTraceRecorder":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _hook(self, number: int):
        reservoir = self._reservoirs[number]

        def record(module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
            _, routing_map = output
            reservoir.add(routing_map_to_ids(routing_map.detach(), self.topk))

        return record

    def trace(self) -> RoutingTrace:
        layers = {n: LayerTrace(r.rows.astype(np.int64), r.seen, r.counts.copy()) for n, r in self._reservoirs.items()}
        sampling = "all" if self.max_tokens_per_layer is None else "reservoir"
        return RoutingTrace(self.num_experts, self.topk, layers, self.max_tokens_per_layer, sampling)
