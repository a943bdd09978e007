"""The timing model behind cost-aware LLEP planning.

LLEP moves tokens *and* a copy of the expert's weights to a helper. Whether a plan is worth it is
decided on the whole layer (``megatron_llep.planning.time_model.LayerTimeModel``: dispatch, slowest rank's
GEMMs, combine), from two primitives this module provides. They are deliberately simple and
calibratable: a roofline GEMM time with a small-GEMM efficiency ramp, and a latency + bandwidth
link time, separately for links inside a node and across nodes.

All times are in seconds, sizes in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Sequence


@dataclass(frozen=True)
class ExpertShape:
    """The shape of one routed expert (SwiGLU: fc1 ``D x 2H``, fc2 ``H x D``)."""

    hidden_size: int
    ffn_hidden_size: int
    gated: bool = True
    bias: bool = False
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if self.hidden_size <= 0 or self.ffn_hidden_size <= 0:
            raise ValueError(
                f"ExpertShape needs positive sizes, got hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}"
            )
        if self.dtype_bytes <= 0:
            raise ValueError(f"ExpertShape.dtype_bytes must be positive, got {self.dtype_bytes}")

    @property
    def fc1_width(self) -> int:
        return self.ffn_hidden_size * (2 if self.gated else 1)

    @cached_property
    def num_params(self) -> int:
        """Parameters of one expert (weights and, when present, biases)."""
        d, h, w1 = self.hidden_size, self.ffn_hidden_size, self.fc1_width
        params = d * w1 + h * d
        if self.bias:
            params += w1 + d
        return params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kept_copy_bytes(self) -> int:
        """Memory of one borrowed expert kept for the step: its weights and an fp32 gradient
        accumulator (``LLEPConfig.max_kept_weight_bytes`` counts these)."""
        return self.weight_bytes + 4 * self.num_params

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's hidden state (one direction of the all-to-all)."""
        return self.hidden_size * self.dtype_bytes

    @cached_property
    def _flops_per_token(self) -> float:
        return 2.0 * (self.hidden_size * self.fc1_width + self.ffn_hidden_size * self.hidden_size)

    def forward_flops(self, tokens: int) -> float:
        """FLOPs of the expert forward on ``tokens`` tokens (2 per multiply-add)."""
        return tokens * self._flops_per_token


@dataclass(frozen=True)
class CostModel:
    """Roofline-style timing model for cost-aware planning.

    ``gemm_tflops`` is the sustained dense rate of a large expert GEMM; a GEMM over ``t`` tokens runs
    at ``t / (t + gemm_half_efficiency_tokens)`` of it (small GEMMs are latency-bound), plus a
    fixed ``gemm_launch_s``. Links cost ``latency + bytes / bandwidth``.
    The defaults describe one H200 node (NVLink 4, ~400 GB/s per direction achieved) and
    InfiniBand NDR across nodes; use :meth:`calibrate` with measured timings for other hardware.
    """

    gemm_tflops: float = 700.0
    gemm_half_efficiency_tokens: float = 256.0
    gemm_launch_s: float = 10e-6
    intra_node_gbps: float = 400.0
    inter_node_gbps: float = 45.0
    link_latency_s: float = 15e-6
    training: bool = False

    def __post_init__(self) -> None:
        for name in ("gemm_tflops", "intra_node_gbps", "inter_node_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostModel.{name} must be positive, got {getattr(self, name)}")
        for name in ("gemm_half_efficiency_tokens", "gemm_launch_s", "link_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")

    def gemm_coefficients(self, shape: ExpertShape) -> tuple[float, float]:
        """``gemm_time(t) = a + b * t`` for ``t > 0``: ``flops(t) / (peak * t / (t + half))`` is
        linear in ``t``."""
        per_token = shape.forward_flops(1) * (3.0 if self.training else 1.0) / (self.gemm_tflops * 1e12)
        return self.gemm_launch_s + per_token * self.gemm_half_efficiency_tokens, per_token

    def gemm_time(self, tokens: int, shape: ExpertShape) -> float:
        """Predicted time of one expert's forward (and backward when ``training``) on ``tokens``."""
        if tokens <= 0:
            return 0.0
        a, b = self.gemm_coefficients(shape)
        return a + b * tokens

    def link_time(self, num_bytes: float, inter_node: bool) -> float:
        """Predicted time to move ``num_bytes`` over one link."""
        if num_bytes <= 0:
            return 0.0
        gbps = self.inter_node_gbps if inter_node else self.intra_node_gbps
        return self.link_latency_s + num_bytes / (gbps * 1e9)

    @classmethod
    def cpu(cls) -> "CostModel":
        """A CPU host running one EP rank per core over gloo: fp32 expert GEMMs at ~0.1 TFLOP/s
        (full speed from ~16 tokens, ~10 us per call) and ~4 GB/s, ~30 us send/recv between
        processes (measured on a 2-core AMD EPYC VM, 2026-12-03). Use :meth:`calibrate` for
        numbers of a given machine."""
        return cls(gemm_tflops=0.1, gemm_half_efficiency_tokens=16.0, gemm_launch_s=10e-6,
                   intra_node_gbps=4.0, inter_node_gbps=1.0, link_latency_s=30e-6)

    @classmethod
    def calibrate(
        cls,
        gemm_samples: Sequence[tuple[int, float]],
        shape: ExpertShape,
        link_samples: Sequence[tuple[float, float]] = (),
        inter_node_link_samples: Sequence[tuple[float, float]] = (),
        base: "CostModel | None" = None,
    ) -> "CostModel":
        """Fit the model to measurements.

        ``gemm_samples`` are ``(tokens, seconds)`` of one expert forward at ``shape``; link samples
        are ``(bytes, seconds)``. Parameters without samples keep ``base``'s values.
        """
        model = base or cls()
        if gemm_samples:
            model = replace(model, **_fit_gemm(gemm_samples, shape, model))
        if link_samples:
            latency, gbps = _fit_link(link_samples)
            model = replace(model, link_latency_s=latency, intra_node_gbps=gbps)
        if inter_node_link_samples:
            _, gbps = _fit_link(inter_node_link_samples)
            model = replace(model, inter_node_gbps=gbps)
        return model


def _fit_link(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``seconds = latency + bytes / bandwidth``; returns (latency_s, GB/s)."""
    if len(samples) == 1:
        num_bytes, seconds = samples[0]
        return 0.0, num_bytes / seconds / 1e9
    xs = [float(b) for b, _ in samples]
    ys = [float(t) for _, t in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        raise ValueError("link calibration needs samples of at least two different sizes")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    if slope <= 0:
        raise ValueError("link calibration samples do not grow with size; cannot fit a bandwidth")
    latency = max(0.0, my - slope * mx)
    return latency, 1.0 / slope / 1e9


def _fit_gemm(samples: Sequence[tuple[int, float]], shape: ExpertShape, model: CostModel) -> dict:
    """Fit peak rate and half-efficiency point by a small grid search on relative error."""
    best: tuple[float, float, float] | None = None
    launch = min(t for _, t in samples) * 0.5 if len(samples) > 2 else model.gemm_launch_s
    for half in (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        # For a fixed ramp the best peak is a closed-form weighted mean of per-sample estimates.
        estimates = []
        for tokens, seconds in samples:
            busy = seconds - launch
            if tokens <= 0 or busy <= 0:
                continue
            efficiency = tokens / (tokens + half)
            estimates.append(shape.forward_flops(tokens) / (busy * efficiency) / 1e12)
        if not estimates:
            continue
        peak = sorted(estimates)[len(estimates) // 2]
        trial = replace(model, gemm_tflops=peak, gemm_half_efficiency_tokens=float(half), gemm_launch_s=launch)
        error = sum(abs(math.log(trial.gemm_time(t, shape) / s)) for t, s in samples if s > 0)
        if best is None or error < best[0]:
            best = (error, peak, float(half))
    if best is None:
        raise ValueError("GEMM calibration needs samples with positive token counts and times")
    return {"gemm_tflops": best[1], "gemm_half_efficiency_tokens": best[2], "gemm_launch_s": launch}
