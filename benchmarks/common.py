"""Shared pieces of the benchmarks: the published layer shapes, imbalance scenarios, result output."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from megatron_llep.writable import write_text
from recipes.models import KIMI_K2_MOE_LAYER  # the recipe owns the Kimi-K2 layer shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer: experts N, hidden D, expert FFN H, top-K, tokens per GPU, gpt-oss biases."""

    name: str
    num_experts: int
    hidden: int
    ffn: int
    topk: int
    tokens_per_gpu: int
    bias: bool = False

    def scaled(self, experts: int, width_divisor: int, token_divisor: int) -> "LayerShape":
        return LayerShape(
            name=f"{self.name}/cpu",
            num_experts=experts,
            hidden=self.hidden // width_divisor,
            ffn=self.ffn // width_divisor,
            topk=self.topk,
            tokens_per_gpu=self.tokens_per_gpu // token_divisor,
            bias=self.bias,
        )


# gpt-oss-120b, DeepSeek-V3 and Kimi-K2 MoE layer shapes, and the LLEP paper's tokens per GPU.
GPT_OSS_120B = LayerShape("gpt-oss-120b", 128, 2880, 2880, 4, 32768, bias=True)
DEEPSEEK_V3 = LayerShape("deepseek-v3", 256, 7168, 2048, 8, 16384)
KIMI_K2 = LayerShape(
    KIMI_K2_MOE_LAYER.name, KIMI_K2_MOE_LAYER.num_experts, KIMI_K2_MOE_LAYER.hidden, KIMI_K2_MOE_LAYER.ffn,
    KIMI_K2_MOE_LAYER.topk, 16384,
)
FULL_SHAPES = (GPT_OSS_120B, DEEPSEEK_V3, KIMI_K2)

# Paper figures (8x H200): MoE layer forward speedup over EP at 95% into 16/4/1 experts, balanced.
PAPER_SPEEDUP = {
    "gpt-oss-120b": {"0.95:16": 5.19, "0.95:4": 5.22, "0.95:1": 6.11, "balanced": 1.07},
    "deepseek-v3": {"0.95:16": 4.59, "0.95:4": 4.64, "0.95:1": 5.13, "balanced": 0.92},
    "kimi-k2": {"0.95:16": 4.83, "0.95:4": 4.67, "0.95:1": 5.03, "balanced": 1.03},
}


@dataclass(frozen=True)
class Scenario:
    """"f into h experts"; ``hot_fraction == 0`` is balanced."""

    hot_fraction: float
    num_hot: int

    @property
    def label(self) -> str:
        return "balanced" if self.hot_fraction == 0 else f"{self.hot_fraction:g}:{self.num_hot}"


BALANCED = Scenario(0.0, 0)
SCENARIOS = (BALANCED,) + tuple(Scenario(f, h) for h in (1, 4, 16) for f in (0.3, 0.5, 0.8, 0.95))


def sample_counts(
    shape: LayerShape, ep_size: int, scenario: Scenario, seed: int, tokens_per_gpu: Optional[int] = None
) -> np.ndarray:
    """``[P, N]`` routed-token counts of the scenario, drawn per rank by multinomials.

    Same expectation as :func:`megatron_llep.planning.scenarios.imbalanced_topk` (a hot token puts
    ``min(h, K)`` assignments uniformly on the hot experts and the rest uniformly on the others; a
    cold token spreads ``K`` over the non-hot experts) without materialising ``tokens x K`` ids,
    so full-size shapes at P = 64 take milliseconds. Distinctness within a token is not modelled.
    """
    rng = np.random.default_rng(seed)
    tokens = shape.tokens_per_gpu if tokens_per_gpu is None else tokens_per_gpu
    n, k, h = shape.num_experts, shape.topk, scenario.num_hot
    counts = np.zeros((ep_size, n), np.int64)
    for rank in range(ep_size):
        if scenario.hot_fraction == 0 or h == 0:
            counts[rank] = rng.multinomial(tokens * k, np.full(n, 1.0 / n))
            continue
        hot_tokens = rng.binomial(tokens, scenario.hot_fraction)
        on_hot = hot_tokens * min(h, k)
        counts[rank, :h] = rng.multinomial(on_hot, np.full(h, 1.0 / h))
        counts[rank, h:] = rng.multinomial(tokens * k - on_hot, np.full(n - h, 1.0 / (n - h)))
    return counts


def machine_info() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def write_results(path: str, benchmark: str, rows: list[dict], settings: dict, complete: bool = True) -> None:
    """One JSON file per run: what ran, where, when, and every row. Written atomically (a temporary
    file in the same directory, renamed over ``path``), so a run killed mid-write leaves the last
    whole file; ``complete=False`` rewrites it, quietly, while a run is still adding rows."""
    payload = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine_info(),
        "settings": settings,
        "complete": complete,
        "rows": rows,
    }
    write_text(path, json.dumps(payload, indent=1, default=_json_default))  # whole, or the previous file kept
    if complete:
        print(f"\nwrote {path}")


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def print_table(rows: Sequence[dict], columns: Iterable[tuple[str, str, str]]) -> None:
    """``columns``: (key, header, format spec)."""
    columns = list(columns)
    cells = [[format(r[k], fmt) if isinstance(r.get(k), (int, float, np.number)) else str(r.get(k, "")) for k, _, fmt in columns] for r in rows]
    headers = [h for _, h, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
