"""Routing traces: per MoE layer, the experts each sampled token was routed to.

File format (``.npz``, written by :meth:`RoutingTrace.save`, read by :meth:`RoutingTrace.load`):

* ``metadata``: a 0-d string array holding JSON ``{"format": "megatron-llep-routing-trace",
  "version": 1, "num_experts": N, "topk": K, "layers": [layer numbers], "tokens_seen": {layer: n},
  "max_tokens_per_layer": cap or null, "sampling": "reservoir" | "all" | "synthetic", "sources": [...]}``;
* ``layer{n}_expert_ids``: ``int16 [T, K]`` expert ids of the sampled tokens of MoE layer ``n``
  (Megatron's global, 1-based layer number); ``-1`` fills a slot whose assignment was dropped (token
  dropping with a capacity factor leaves a token fewer than K experts);
* ``layer{n}_expert_counts``: ``int64 [N]`` tokens routed to each expert over *all* tokens seen,
  not only the sampled ones (exact loads even when the sample is capped).

One file holds one process's tokens; :func:`merge_traces` concatenates the files of several ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from megatron_llep.writable import StagedOutputs

TRACE_FORMAT = "megatron-llep-routing-trace"
TRACE_VERSION = 1
_MAX_INT16_EXPERTS = np.iinfo(np.int16).max


@dataclass
class LayerTrace:
    """The sampled routing of one MoE layer and the exact per-expert counts of all its tokens."""

    expert_ids: np.ndarray
    tokens_seen: int
    expert_counts: np.ndarray

    @property
    def num_sampled(self) -> int:
        return int(self.expert_ids.shape[0])


@dataclass
class RoutingTrace:
    """Routing traces of the MoE layers of one model (see the module docstring for the file)."""

    num_experts: int
    topk: int
    layers: dict[int, LayerTrace] = field(default_factory=dict)
    max_tokens_per_layer: Optional[int] = None
    sampling: str = "all"
    sources: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.num_experts <= _MAX_INT16_EXPERTS:
            raise ValueError(f"num_experts must be in 1..{_MAX_INT16_EXPERTS}, got {self.num_experts}")
        if not 0 < self.topk <= self.num_experts:
            raise ValueError(f"topk must be in 1..num_experts={self.num_experts}, got {self.topk}")
        for number, layer in self.layers.items():
            ids = np.asarray(layer.expert_ids)
            if ids.ndim != 2 or ids.shape[1] != self.topk:
                raise ValueError(f"layer {number}: expert ids must be [tokens, topk={self.topk}], got {ids.shape}")
            if ids.size and (ids.min() < -1 or ids.max() >= self.num_experts):
                raise ValueError(f"layer {number}: expert ids outside -1..{self.num_experts - 1}")
            counts = np.asarray(layer.expert_counts)
            if counts.shape != (self.num_experts,):
                raise ValueError(f"layer {number}: expert counts must have {self.num_experts} entries, got {counts.shape}")
            if layer.tokens_seen < ids.shape[0]:
                raise ValueError(f"layer {number}: tokens_seen {layer.tokens_seen} < sampled tokens {ids.shape[0]}")
            layer.expert_ids = ids.astype(np.int64, copy=False)
            layer.expert_counts = counts.astype(np.int64, copy=False)

    @classmethod
    def from_expert_ids(cls, num_experts: int, ids_by_layer: dict[int, np.ndarray], sampling: str = "all") -> "RoutingTrace":
        """A trace holding every token of ``ids_by_layer`` (``{layer: [T, K]}``)."""
        if not ids_by_layer:
            raise ValueError("a routing trace needs at least one layer")
        topk = {np.asarray(ids).shape[-1] for ids in ids_by_layer.values()}
        if len(topk) != 1:
            raise ValueError(f"all layers must have the same top-K, got {sorted(topk)}")
        layers = {
            int(n): LayerTrace(np.asarray(ids), int(np.asarray(ids).shape[0]), expert_counts(ids, num_experts))
            for n, ids in ids_by_layer.items()
        }
        return cls(num_experts, topk.pop(), layers, sampling=sampling)

    def layer(self, number: int) -> LayerTrace:
        if number not in self.layers:
            raise KeyError(f"the trace has no MoE layer {number}; it holds layers {sorted(self.layers)}")
        return self.layers[number]

    def split(self, fit_fraction: float = 0.5) -> tuple["RoutingTrace", "RoutingTrace"]:
        """Two traces of the same layers: the first ``fit_fraction`` of every layer's sampled tokens
        and the rest (fit a placement on one, evaluate it on the other). Counts are recomputed."""
        if not 0.0 < fit_fraction < 1.0:
            raise ValueError(f"fit_fraction must be within (0, 1), got {fit_fraction}")
        halves = ({}, {})
        for number, layer in self.layers.items():
            cut = int(round(layer.num_sampled * fit_fraction))
            halves[0][number] = layer.expert_ids[:cut]
            halves[1][number] = layer.expert_ids[cut:]
        return tuple(RoutingTrace.from_expert_ids(self.num_experts, h, self.sampling) for h in halves)

    def save(self, path: str, flag: Optional[str] = None) -> None:
        """Write the trace file whole, or leave what was at ``path`` (an :class:`OutputError` names
        the file, and ``flag`` if the command line chose it)."""
        arrays = {}
        for number, layer in self.layers.items():
            arrays[f"layer{number}_expert_ids"] = layer.expert_ids.astype(np.int16)
            arrays[f"layer{number}_expert_counts"] = layer.expert_counts.astype(np.int64)
        metadata = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "num_experts": self.num_experts,
            "topk": self.topk,
            "layers": sorted(self.layers),
            "tokens_seen": {str(n): int(layer.tokens_seen) for n, layer in self.layers.items()},
            "max_tokens_per_layer": self.max_tokens_per_layer,
            "sampling": self.sampling,
            "sources": self.sources,
        }
        needed = sum(array.nbytes for array in arrays.values())  # at most: the arrays are compressed
        # a file object keeps numpy from appending ".npz" to the name
        with StagedOutputs(flag) as outputs, outputs.open(path, "wb", needed=needed) as f:
            np.savez_compressed(f, metadata=np.array(json.dumps(metadata)), **arrays)

    @classmethod
    def load(cls, path: str) -> "RoutingTrace":
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a routing trace file (expected a .npz written by RoutingTrace.save)") from err
        with data:
            if "metadata" not in data.files:
                raise ValueError(f"{path}: not a routing trace file (no 'metadata' entry)")
            meta = json.loads(str(data["metadata"]))
            if meta.get("format") != TRACE_FORMAT:
                raise ValueError(f"{path}: format is {meta.get('format')!r}, expected {TRACE_FORMAT!r}")
            if meta.get("version") != TRACE_VERSION:
                raise ValueError(f"{path}: trace version {meta.get('version')} is not supported (expected {TRACE_VERSION})")
            layers = {}
            for number in meta["layers"]:
                for key in (f"layer{number}_expert_ids", f"layer{number}_expert_counts"):
                    if key not in data.files:
                        raise ValueError(f"{path}: metadata lists layer {number} but the file has no {key!r}")
                layers[int(number)] = LayerTrace(
                    data[f"layer{number}_expert_ids"].astype(np.int64),
                    int(meta["tokens_seen"][str(number)]),
                    data[f"layer{number}_expert_counts"],
                )
        return cls(int(meta["num_experts"]), int(meta["topk"]), layers, meta.get("max_tokens_per_layer"),
                   meta.get("sampling", "all"), list(meta.get("sources", [])) or [os.path.abspath(path)])


def expert_counts(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Tokens routed to each expert (``-1`` entries are not counted)."""
    ids = np.asarray(expert_ids).ravel()
    return np.bincount(ids[ids >= 0], minlength=num_experts).astype(np.int64)


def merge_traces(traces: Sequence[RoutingTrace]) -> RoutingTrace:
    """One trace from several (e.g. one file per data/expert-parallel rank): per layer the samples
    are concatenated and the counts and tokens seen summed. Each rank's reservoir is uniform over
    that rank's tokens, so the union is uniform when the ranks saw equally many tokens."""
    if not traces:
        raise ValueError("merge_traces needs at least one trace")
    first = traces[0]
    for trace in traces[1:]:
        if (trace.num_experts, trace.topk) != (first.num_experts, first.topk):
            raise ValueError(
                f"cannot merge traces with different shapes: {first.num_experts} experts top-{first.topk} vs "
                f"{trace.num_experts} experts top-{trace.topk}"
            )
    layers: dict[int, LayerTrace] = {}
    for number in sorted(set().union(*(t.layers for t in traces))):
        parts = [t.layers[number] for t in traces if number in t.layers]
        layers[number] = LayerTrace(
            np.concatenate([p.expert_ids for p in parts]),
            sum(p.tokens_seen for p in parts),
            np.sum([p.expert_counts for p in parts], axis=0),
        )
    caps = [t.max_tokens_per_layer for t in traces]
    cap = None if any(c is None for c in caps) else int(sum(caps))
    return RoutingTrace(first.num_experts, first.topk, layers, cap, first.sampling,
                        [s for t in traces for s in t.sources])


def load_megatron_router_trace(path: str, num_experts: int, first_layer_number: int = 1) -> RoutingTrace:
    """A trace from Megatron-Core 0.19's router tracer (``--moe-routing-trace-path``: one JSONL file
    per rank, a record ``{"block": "decoder", "layer": i, "top_indices": [[...], ...]}`` per layer
    and step). Its ``layer`` is the index in the rank's decoder stack; layer numbers here are
    ``first_layer_number + layer`` (1 without pipeline parallelism, like Megatron's own numbering).
    MTP records are skipped: their layers have no decoder layer number."""
    if num_experts <= 0:
        raise ValueError(f"{path}: a Megatron router trace does not record the number of experts; pass it (got {num_experts})")
    ids: dict[int, list[np.ndarray]] = {}
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if record.get("block", "decoder") != "decoder":
                    continue
                top = np.asarray(record["top_indices"], dtype=np.int64)
                layer = int(record["layer"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{line_number}: not a Megatron router trace record ({err})") from err
            if top.ndim != 2:
                raise ValueError(f"{path}:{line_number}: top_indices must be [tokens, topk], got shape {top.shape}")
            ids.setdefault(first_layer_number + layer, []).append(top)
    if not ids:
        raise ValueError(f"{path}: no decoder routing records")
    trace = RoutingTrace.from_expert_ids(num_experts, {n: np.concatenate(parts) for n, parts in ids.items()})
    trace.sources = [os.path.abspath(path)]
    return trace


def load_traces(paths: Iterable[str], num_experts: Optional[int] = None) -> RoutingTrace:
    """Load and merge trace files (one per rank, or several runs): our ``.npz`` traces, and
    Megatron-Core's router-trace ``.jsonl`` files (these need ``num_experts``)."""
    traces = []
    for path in paths:
        if path.endswith(".jsonl"):
            if num_experts is None:
                raise ValueError(f"{path}: Megatron router traces do not record the number of experts; pass --num-experts")
            traces.append(load_megatron_router_trace(path, num_experts))
        else:
            traces.append(RoutingTrace.load(path))
    return merge_traces(traces)


def planted_clusters(num_experts: int, num_clusters: int, seed: int = 0) -> np.ndarray:
    """Cluster id of every expert: equal-sized clusters over a random permutation of the ids (so
    that contiguous ids, i.e. sequential placement, do not line up with the clusters)."""
    if num_clusters <= 0 or num_experts % num_clusters:
        raise ValueError(f"num_clusters={num_clusters} must divide num_experts={num_experts}")
    rng = np.random.default_rng(seed)
    clusters = np.empty(num_experts, np.int64)
    clusters[rng.permutation(num_experts)] = np.arange(num_experts) % num_clusters
    return clusters


def clustered_topk(
    num_tokens: int,
    clusters: np.ndarray,
    topk: int,
    affinity: float,
    load_skew: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """Synthetic routing ``[num_tokens, topk]`` with planted co-activation and load skew.

    Every token belongs to a cluster (uniformly); each of its K picks is, with probability
    ``affinity`` (``q``), forced inside that cluster (capped by the cluster size), the others are
    drawn from all remaining experts: ``q = 1`` keeps a token inside its cluster, ``q = 0``
    ignores the clusters. Draws are without replacement with popularity ``(1 + r_e) ** -load_skew``
    for a random popularity rank ``r_e`` (``load_skew = 0``: uniform loads), by Gumbel-top-k.
    """
    clusters = np.asarray(clusters, np.int64)
    num_experts = clusters.size
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk must be in 1..{num_experts}, got {topk}")
    if not 0.0 <= affinity <= 1.0:
        raise ValueError(f"affinity (q) must be within [0, 1], got {affinity}")
    if load_skew < 0:
        raise ValueError(f"load_skew must be >= 0, got {load_skew}")
    rng = np.random.default_rng(seed)
    num_clusters = int(clusters.max()) + 1
    log_popularity = -load_skew * np.log1p(rng.permutation(num_experts))
    token_cluster = rng.integers(0, num_clusters, num_tokens)
    inside = clusters[None, :] == token_cluster[:, None]
    num_inside = np.minimum(rng.binomial(topk, affinity, num_tokens), np.bincount(clusters)[token_cluster])
    rank = np.arange(topk)[None, :]
    keys = np.where(inside, log_popularity + rng.gumbel(size=inside.shape), -np.inf)
    best_inside = np.argsort(-keys, axis=1)[:, :topk]
    forced = rank < num_inside[:, None]
    keys = log_popularity + rng.gumbel(size=inside.shape)
    np.put_along_axis(keys, best_inside, np.where(forced, -np.inf, np.take_along_axis(keys, best_inside, 1)), axis=1)
    best_rest = np.argsort(-keys, axis=1)[:, :topk]
    take = np.concatenate([forced, rank < (topk - num_inside)[:, None]], axis=1)
    return np.concatenate([best_inside, best_rest], axis=1)[take].reshape(num_tokens, topk)


def synthetic_trace(
    num_tokens: int,
    num_experts: int,
    topk: int,
    num_clusters: int,
    affinity: float,
    load_skew: float = 0.0,
    layers: Sequence[int] = (1,),
    seed: int = 0,
) -> tuple[RoutingTrace, dict[int, np.ndarray]]:
    """A trace with planted clusters per layer (see :func:`clustered_topk`) and those clusters."""
    clusters = {n: planted_clusters(num_experts, num_clusters, seed + 7919 * i) for i, n in enumerate(layers)}
    ids = {n: clustered_topk(num_tokens, clusters[n], topk, affinity, load_skew, seed + 7919 * i + 1)
           for i, n in enumerate(layers)}
    trace = RoutingTrace.from_expert_ids(num_experts, ids, sampling="synthetic")
    return trace, clusters
