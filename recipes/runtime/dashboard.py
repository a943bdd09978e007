"""Throughput and MoE-balance dashboards: per-step metrics for stdout and wandb.

Only the last rank logs to wandb (as Megatron-LM does: it holds the last pipeline stage's loss);
every rank contributes its MoE routing loads and LLEP statistics through a gather at log time.
wandb runs offline unless ``WANDB_MODE``/``--wandb-mode`` says otherwise; offline runs can be read
back with :func:`megatron_llep.testing.wandb_offline.read_history`.

Metric names (wandb keys):

* ``throughput/tokens_per_sec``, ``throughput/tokens_per_sec_per_gpu``, ``throughput/tflops_per_gpu``
  (model FLOPs, see :func:`model_flops_per_token`), ``time/step_s``
* ``train/loss`` (per-token mean over the global batch), ``train/grad_norm``, ``train/lr``
* ``valid/loss``, ``valid/ppl``, ``valid/tokens`` (per-token mean over the evaluated validation batches,
  its exponential, the loss tokens), at each evaluation
* ``memory/peak_gib`` (max over ranks: CUDA max allocated, or the process's peak RSS on CPU)
* ``moe/layer_<n>/{max_mean_before,max_mean_after,spilled_tokens,weight_bytes,plan_time_ms,llep_active,max_kept_bytes}``
  (LLEP layers; averaged over micro-batches and EP groups), ``moe/layer_<n>/max_rank_rows`` (the most
  token-expert rows an EP rank computed, maximum over micro-batches and EP groups) with
  ``moe/layer_<n>/budget_rows`` (``--llep-max-tokens-per-rank``, only when set), and
  ``moe/layer_<n>/max_mean_load`` (routing load of every MoE layer, LLEP or not)
* ``moe/expert_load_heatmap``: image, MoE layers x experts, load / mean load, every N steps.
* ``prune/{devices_per_token,remote_devices_per_token,cross_node_devices_per_token}`` and their ``*_unpruned``,
  ``prune/dropped_pairs``, ``prune/dropped_pair_fraction``, ``prune/alltoall_bytes`` and
  ``prune/alltoall_bytes_unpruned``, ``prune/tokens``:
  only with ``LLEPConfig.pruning`` (inference); counts summed over layers, micro-batches and ranks, per-token
  figures per token and MoE layer (:func:`megatron_llep.runtime.statistics.pruning_metrics`; one phrase of them:
  :func:`pruning_summary`).
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_llep.compat import mcore
from megatron_llep.runtime.state import STATS
from megatron_llep.runtime.statistics import budget_phrase, merge_layer_statistic, pruning_metrics
from megatron_llep.writable import readable_bytes


def peak_memory_bytes() -> int:
    """This process's peak memory: CUDA max allocated on GPU, peak RSS (VmHWM) on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def model_flops_per_token(model: torch.nn.Module, config, seq_length: int) -> float:
    """Training FLOPs per token (3x forward) of the whole model, from the parameters it holds.

    Forward: 2 FLOPs per *active* matmul weight (all dense weights incl. the output layer; routed
    expert weights times top-k / num_experts; not the embedding lookup) plus attention scores and
    context, ``2 * seq * heads * (qk_head + v_head)`` per layer (full, not causal, as Megatron-LM
    counts; sliding windows are not discounted). Parameters are counted across all ranks (each is
    held once per data-parallel replica). Collective over the world group.
    """
    dense = expert = 0
    for name, param in model.named_parameters():
        if "word_embeddings" in name or "position_embeddings" in name:
            continue
        if getattr(param, "allreduce", True):
            dense += param.numel()
        else:
            expert += param.numel()
    counts = torch.tensor([dense, expert], dtype=torch.float64)
    dist.all_reduce(counts)
    world = dist.get_world_size()
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size or 1
    dense_total = counts[0].item() / (world // (tp * pp))
    expert_total = counts[1].item() / (world // (pp * ep * etp))
    active = dense_total + expert_total * config.moe_router_topk / max(config.num_moe_experts or 1, 1)
    if config.multi_latent_attention:
        head_width = config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim
    else:
        head_width = 2 * config.kv_channels
    attention = 2 * seq_length * config.num_attention_heads * head_width * config.num_layers
    return 3.0 * (2.0 * active + attention)


class MoELoadMeter:
    """Counts the tokens every MoE router sends to each expert (a forward hook on the router's
    routing map), in both LLEP and plain-EP runs, for the load metrics and the heatmap."""

    def __init__(self, model: torch.nn.Module):
        self._counts: dict[int, torch.Tensor] = {}
        self._handles = []
        for module in model.modules():
            if isinstance(module, MoELayer):
                self._handles.append(module.router.register_forward_hook(self._hook(module)))

    def _hook(self, layer: MoELayer):
        def record(_router, _inputs, outputs) -> None:
            routing_map = outputs[1]
            counts = routing_map.detach().sum(dim=0).to("cpu", torch.float64)
            key = int(mcore.moe_layer_number(layer))
            self._counts[key] = self._counts.get(key, 0) + counts

        return record

    def drain(self) -> dict[int, np.ndarray]:
        """This rank's counts since the last drain, by global layer number."""
        counts, self._counts = self._counts, {}
        return {layer: c.numpy() for layer, c in counts.items()}

    def restore(self, counts: dict[int, np.ndarray]) -> None:
        """Count again what :meth:`drain` returned (added to anything counted since)."""
        for layer, c in counts.items():
            self._counts[layer] = self._counts.get(layer, 0) + torch.from_numpy(c)


@contextlib.contextmanager
def moe_metrics_apart(load_meter: MoELoadMeter) -> Iterator[None]:
    """Keep the routing loads, LLEP and pruning statistics of the forwards in the block (an evaluation, which
    gathers its own) out of those counted before it (training steps not yet logged): this rank's
    are set aside and put back afterwards, so neither is reported as the other."""
    loads = load_meter.drain()
    try:
        with STATS.set_aside():
            yield
    finally:
        load_meter.drain()  # what the block did not gather
        load_meter.restore(loads)


def gather_moe_metrics(load_meter: MoELoadMeter) -> tuple[dict[str, float], Optional[np.ndarray], list[int]]:
    """Collective: merge every rank's routing loads (summed), LLEP statistics (averaged over the
    ranks reporting a layer) and routing-pruning totals (summed, then derived). Returns the scalar
    metrics, the [layers, experts] load matrix normalised by each layer's mean (or ``None`` without
    MoE layers) and its layer numbers."""
    local = {"loads": load_meter.drain(), "llep": STATS.drain_by_layer(), "prune": STATS.drain_pruning_totals()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    loads: dict[int, np.ndarray] = {}
    llep: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    prune: dict[str, float] = defaultdict(float)
    for entry in gathered:
        for layer, counts in entry["loads"].items():
            loads[layer] = loads.get(layer, 0) + counts
        for layer, row in entry["llep"].items():
            for key, value in row.items():
                llep[layer][key].append(value)
        for key, value in entry["prune"].items():
            prune[key] += value
    metrics: dict[str, float] = pruning_metrics(prune)
    for layer in sorted(llep):
        for key, values in llep[layer].items():
            metrics[f"moe/layer_{layer}/{key}"] = merge_layer_statistic(key, values)
    layers = sorted(loads)
    if not layers:
        return metrics, None, []
    matrix = np.stack([loads[layer] / max(loads[layer].mean(), 1e-12) for layer in layers])
    ep = parallel_state.get_expert_model_parallel_world_size()
    for layer, row in zip(layers, matrix):
        metrics[f"moe/layer_{layer}/max_mean_load"] = float(row.reshape(ep, -1).sum(axis=1).max() / (row.sum() / ep))
    return metrics, matrix, layers


def llep_summary(metrics: dict[str, float]) -> str:
    """The LLEP statistics of :func:`gather_moe_metrics`' metrics in one phrase for a log line (over
    every MoE layer: how many spilled, the worst max/mean rank load before and after, the tokens and
    weight bytes moved, the planning time; under a row budget the most rows a rank computed against
    it), or "plain EP" without LLEP layers."""
    active = [k for k in metrics if k.endswith("/llep_active")]
    if not active:
        return "plain EP"
    spilled = sum(metrics[k.replace("llep_active", "spilled_tokens")] for k in active)
    before = max(metrics[k.replace("llep_active", "max_mean_before")] for k in active)
    after = max(metrics[k.replace("llep_active", "max_mean_after")] for k in active)
    weight_kib = sum(metrics[k.replace("llep_active", "weight_bytes")] for k in active) / 1024
    plan_ms = sum(metrics[k.replace("llep_active", "plan_time_ms")] for k in active)
    spilling = sum(metrics[k] > 0 for k in active)
    budget = budget_phrase(metrics)
    return (f"LLEP {spilling}/{len(active)} layers spilled, max/mean {before:.2f} -> {after:.2f}, "
            f"{spilled:.0f} tokens spilled, {weight_kib:.0f} KiB weights, plan {plan_ms:.2f} ms"
            + (f", {budget}" if budget else ""))


def pruning_summary(metrics: dict[str, float], pruning: Optional[Any] = None,
                    ranks_per_node: Optional[int] = None) -> str:
    """The routing-pruning statistics of :func:`gather_moe_metrics`' metrics in one phrase for a log
    line, so that a lossy run says what it dropped and saved: ``pruning``'s p and method (a
    :class:`megatron_llep.config.RoutingPruning`, which the metrics do not hold), devices per token
    before -> after, devices in another node before -> after (only with ``ranks_per_node``: else one
    node), the dropped (token, expert) pairs and the all-to-all bytes before -> after. "" without
    pruning statistics."""
    if "prune/tokens" not in metrics:
        return ""
    m = metrics
    setting = f" p={pruning.p:g} ({pruning.method})" if pruning is not None else ""
    parts = [f"pruning{setting}: devices/token {m['prune/devices_per_token_unpruned']:.2f} -> "
             f"{m['prune/devices_per_token']:.2f}"]
    if ranks_per_node is not None:
        parts.append(f"other-node devices/token {m['prune/cross_node_devices_per_token_unpruned']:.2f} -> "
                     f"{m['prune/cross_node_devices_per_token']:.2f}")
    parts.append(f"{m['prune/dropped_pair_fraction']:.1%} pairs dropped ({m['prune/dropped_pairs']:.0f})")
    parts.append(f"all-to-all {readable_bytes(m['prune/alltoall_bytes_unpruned'])} -> "
                 f"{readable_bytes(m['prune/alltoall_bytes'])}")
    return ", ".join(parts)


def heatmap_rgb(matrix: np.ndarray, cell: int = 12) -> np.ndarray:
    """A [layers, experts] load matrix as an RGB image (dark = cold, yellow = hot; scale 0..max),
    without plotting libraries."""
    scaled = matrix / max(float(matrix.max()), 1e-12)
    stops = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=float)
    position = scaled * (len(stops) - 1)
    low = np.clip(np.floor(position).astype(int), 0, len(stops) - 2)
    frac = (position - low)[..., None]
    rgb = stops[low] * (1 - frac) + stops[low + 1] * frac
    return np.kron(rgb, np.ones((cell, cell, 1))).astype(np.uint8)


class WandbDashboard:
    """wandb on the last rank only; a no-op elsewhere and when ``mode == "disabled"``."""

    def __init__(self, project: Optional[str], name: str, directory: str, mode: Optional[str], config: dict[str, Any]):
        self.run = None
        if dist.get_rank() != dist.get_world_size() - 1:
            return
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        if mode == "disabled":
            return
        if not name:
            raise ValueError("--wandb-exp-name must not be empty")
        import wandb

        os.makedirs(directory, exist_ok=True)
        self._wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=directory, mode=mode, config=config)

    @property
    def run_dir(self) -> Optional[str]:
        return None if self.run is None else self.run.dir

    def log(self, step: int, metrics: dict[str, float], heatmap: Optional[np.ndarray] = None, layers=()) -> None:
        if self.run is None:
            return
        row: dict[str, Any] = dict(metrics)
        if heatmap is not None:
            caption = f"expert load / mean, rows = MoE layers {list(layers)}, step {step}"
            row["moe/expert_load_heatmap"] = self._wandb.Image(heatmap_rgb(heatmap), caption=caption)
        self.run.log(row, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
