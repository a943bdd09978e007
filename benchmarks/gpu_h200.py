"""One H200: LLEP against plain EP at the SPEC's full layer shapes, in one run of under 8 minutes.

Run on the H200, from the repository root (about 3 minutes by the estimates below; no new row
starts after ``--time-budget`` seconds, 450 by default, and the rows left are recorded as skipped):

    PYTHONUNBUFFERED=1 timeout 480 python3 benchmarks/gpu_h200.py --out results/gpu_h200.json

(docs/benchmarks.md, "Mode 3", has the lines that bring megatron-core to a machine without it.)
Check it anywhere in seconds (tiny shapes on CPU; what needs Transformer Engine or a GPU is
recorded as skipped, with the reason; this is what tests/test_benchmarks.py runs):

    python benchmarks/gpu_h200.py --dry-run --cpu --out /tmp/gpu_h200.json

Sections, in the order they run, with estimated H200 times at ``--repeats 5`` (before them: imports,
CUDA and process-group start, ~20 s):

1. ``grid`` (~90 s): balanced and 95 % into 1 / 4 / 16 experts for gpt-oss-120b, DeepSeek-V3 and
   Kimi-K2 (benchmarks/common.py), P = ``--ep`` emulated ranks, forward+backward. Every emulated
   rank's expert GEMMs (SwiGLU, bf16, one weight set per expert slot) run on the GPU, timed with
   CUDA events, for plain EP, for LLEP and for the force-balanced ideal; the LLEP plan is made by
   the library's planner with a cost model calibrated on this GPU's GEMMs (training mode) at each
   link bandwidth. Communication is priced (one GPU cannot measure NVLink) at 200, 300 and
   400 GB/s per direction (``--links``): layer = dispatch + slowest rank's GEMMs + combine + the
   predicted wait for borrowed weights beyond the GEMMs (they arrive in waves), twice the
   communication for forward+backward. Peak memory per rank is ``max_memory_allocated`` over
   its tokens, activations and gradients, plus its borrowed weights.
2. ``correctness``, bf16 (~15 s): a borrowed slot against the same expert run natively, through
   the library's own ExpertAdapter substitution (megatron_llep/experts.py): outputs, input
   gradients and weight gradients, for Megatron's SequentialMLP and TEGroupedMLP, gpt-oss-120b and
   DeepSeek-V3 expert math at full width; bit for bit, or within the stated tolerance.
3. ``pipeline`` (~40 s): one rank of a real LLEP layer at full shape (``--pipeline-scenario``,
   the busiest helper rank), piece by piece with CUDA events: the host path (planner, rank view,
   the send columns folded into Megatron's permute, the device-built receive permutation), the token gathers, and Megatron's experts module
   (TEGroupedMLP when Transformer Engine is there, and SequentialMLP) on the native slots, on the
   borrowed slots through ExpertAdapter, and on the same tokens as native experts; plain EP's
   hottest rank on the same module for comparison; communication priced at each link.
4. ``correctness``, fp8 (~10 s; Transformer Engine and an fp8 GPU only): the same comparison
   under fp8 for micro-batches 1 and 2, in the layer's order (native experts, then borrowed), and
   with TE's weight cache off. LLEP *rejects* fp8 because Transformer Engine caches each slot's fp8
   weight across micro-batches; these entries show that hazard (status ``hazard_demonstrated``),
   they are not a pass.

The JSON (``--out``) is rewritten, atomically, after every row, so a run that is killed keeps
every finished row; ``status`` says ``running`` until the end. Each row prints one progress line.
Imports are lazy: the script runs where only torch (and Transformer Engine) are installed; rows
that need megatron-core (Megatron's experts modules, the library's dispatcher permutations) are
then recorded as skipped with the reason (``--without-megatron`` simulates that).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict, replace
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from megatron_llep.config import LLEPConfig  # noqa: E402  (pure: numpy only)
from megatron_llep.cost_model import CostModel  # noqa: E402
from megatron_llep.planner import LLEPPlan, plan_llep  # noqa: E402
from megatron_llep.writable import write_text  # noqa: E402

SECTIONS = ("grid", "correctness", "pipeline")
GRID_SCENARIOS = ((0.0, 0), (0.95, 1), (0.95, 4), (0.95, 16))
BF16_TOLERANCE = 1e-2  # max |borrowed - native| <= 1e-2 * max |native|, per tensor
FP8_TOLERANCE = 0.25  # ||borrowed - native|| / ||native||: another expert's weights give ~1.4
CORRECTNESS_EXPERTS = 4  # native experts in the correctness modules; the borrowed copy is of expert 2


class Skip(Exception):
    """A row that cannot run here; the message is the recorded reason."""


# ----------------------------------------------------------------------------------- environment
class _WithoutMegatron(importlib.abc.MetaPathFinder):
    """``--without-megatron``: ``import megatron...`` fails as if megatron-core were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r} (--without-megatron)", name=name)
        return None


def _import_common():
    """benchmarks/common.py, and where Kimi-K2's layer shape came from. common.py takes it from
    recipes.models, which needs megatron-core: where that import fails, the SPEC's values
    (section 1) stand in."""
    try:
        import common

        return common, "recipes.models"
    except Exception as exc:  # noqa: BLE001  (whatever recipes.models needs that is not here)
        reason = _reason(exc)
    stub = types.ModuleType("recipes.models")
    stub.KIMI_K2_MOE_LAYER = types.SimpleNamespace(name="kimi-k2", num_experts=384, hidden=7168, ffn=2048, topk=8)
    sys.modules["recipes.models"] = stub
    import common

    return common, f"SPEC section 1 (recipes.models not importable: {reason})"


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def probe_environment(device: torch.device) -> tuple[dict, dict]:
    """What is installed; and, per capability, ``None`` (usable) or the reason it is not."""
    env: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": str(device)}
    reasons: dict[str, Optional[str]] = {}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["compute_capability"] = list(torch.cuda.get_device_capability(device))
    try:
        import megatron.core

        env["megatron_core"] = megatron.core.__version__
        reasons["megatron"] = None
    except Exception as exc:  # noqa: BLE001  (any import failure means: not usable here)
        env["megatron_core"] = None
        reasons["megatron"] = f"megatron-core not importable ({_reason(exc)})"
    reasons["dispatcher"] = reasons["megatron"] and f"megatron_llep.dispatcher imports megatron-core: {reasons['megatron']}"
    if device.type != "cuda":
        reasons["te"] = "CPU run: Transformer Engine needs a CUDA GPU"
        env["transformer_engine"] = None
    else:
        try:
            import transformer_engine
            import transformer_engine.pytorch  # noqa: F401

            env["transformer_engine"] = getattr(transformer_engine, "__version__", "unknown")
            reasons["te"] = None
        except Exception as exc:  # noqa: BLE001
            env["transformer_engine"] = None
            reasons["te"] = f"Transformer Engine not importable ({_reason(exc)})"
    if reasons["te"] is None and reasons["megatron"] is None:
        try:
            from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear

            reasons["te_grouped"] = None if TEColumnParallelGroupedLinear is not None else "Megatron sees no TE grouped linear"
        except Exception as exc:  # noqa: BLE001
            reasons["te_grouped"] = f"Megatron's TE extension not importable ({_reason(exc)})"
    else:
        reasons["te_grouped"] = reasons["te"] or reasons["megatron"]
    if reasons["te_grouped"] is None:
        ok, why = _fp8_support(device)
        reasons["fp8"] = None if ok else f"fp8 not supported here ({why})"
    else:
        reasons["fp8"] = reasons["te_grouped"]
    env["fp8"] = reasons["fp8"] is None
    return env, reasons


def _fp8_support(device: torch.device) -> tuple[bool, str]:
    for name in ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"):
        try:
            check = getattr(importlib.import_module(name), "check_fp8_support")
            ok, why = check()
            return bool(ok), str(why)
        except Exception:  # noqa: BLE001  (moved between TE releases: try the next place)
            continue
    capability = torch.cuda.get_device_capability(device)
    return capability >= (8, 9), f"compute capability {capability}"


# ----------------------------------------------------------------------------------- recording
def _json_default(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, torch.dtype):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


class Recorder:
    """Runs rows, keeps the time budget, rewrites the JSON after every row, prints one line each."""

    def __init__(self, path: str, budget_s: float, header: dict) -> None:
        self.path, self.budget_s, self.header = path, budget_s, header
        self.rows: list[dict] = []
        self.writes = 0
        self.status = "running"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.write()

    @staticmethod
    def elapsed() -> float:
        return time.perf_counter() - START

    def out_of_time(self) -> bool:
        return self.elapsed() >= self.budget_s

    def row(self, section: str, name: str, fn: Callable[[], dict], **keys: Any) -> dict:
        row = {"section": section, "name": name, **keys}
        if self.out_of_time():
            row.update(status="skipped", reason=f"time budget of {self.budget_s:g} s spent (at {self.elapsed():.0f} s)")
        else:
            start = time.perf_counter()
            try:
                result = fn()
                row.update({"status": "ok", **result})
            except Skip as exc:
                row.update(status="skipped", reason=str(exc))
            except Exception as exc:  # noqa: BLE001  (a failed row is recorded; the run goes on)
                row.update(status="error", error=_reason(exc), traceback=traceback.format_exc()[-2500:])
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            row["seconds"] = round(time.perf_counter() - start, 3)
        self.rows.append(row)
        self.write()
        detail = row.get("summary") or row.get("reason") or row.get("error") or ""
        print(f"[{self.elapsed():6.1f}s] {section:11s} {name:44s} {row['status']:20s} {detail}", flush=True)
        return row

    def finish(self) -> None:
        skipped_for_time = any(r["status"] == "skipped" and "time budget" in r.get("reason", "") for r in self.rows)
        self.status = "budget_exhausted" if skipped_for_time else "complete"
        self.write()

    def sections(self) -> dict[str, dict[str, int]]:
        """Rows per section and status."""
        sections: dict[str, dict[str, int]] = {}
        for r in self.rows:
            counts = sections.setdefault(r["section"], {})
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        return sections

    def write(self) -> None:
        self.writes += 1
        payload = {
            **self.header,
            "status": self.status,
            "elapsed_s": round(self.elapsed(), 2),
            "writes": self.writes,
            "sections": self.sections(),
            "rows": self.rows,
        }
        write_text(self.path, json.dumps(payload, indent=1, default=_json_default))


# ----------------------------------------------------------------------------------- timing
class Timer:
    """CUDA events (synchronised) on GPU, perf_counter on CPU.

    ``run(step, repeats)`` calls ``step(mark)``; each ``mark()`` inside the step ends a phase.
    Returns the median time from the step's start to each mark and to its end (``phases_s``), and
    the median host time to issue the step (``host_s``: the host path's own cost).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _between(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def run(self, step: Callable[[Callable[[], None]], Any], repeats: int, warmup: int = 1) -> dict:
        for _ in range(warmup):
            step(lambda: None)
        self.sync()
        samples, hosts = [], []
        for _ in range(max(repeats, 1)):
            marks = [self._mark()]
            host_start = time.perf_counter()
            step(lambda: marks.append(self._mark()))
            hosts.append(time.perf_counter() - host_start)
            marks.append(self._mark())
            self.sync()
            samples.append([self._between(marks[0], m) for m in marks[1:]])
        phases = [statistics.median(s[i] for s in samples) for i in range(len(samples[0]))]
        return {"phases_s": phases, "host_s": statistics.median(hosts)}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


# ----------------------------------------------------------------------------------- context
class Context:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        self.dtype = torch.bfloat16
        self.timer = Timer(self.device)
        self.env, self.reasons = probe_environment(self.device)
        self.common, self.env["kimi_k2_shape_from"] = _import_common()
        from plan_model import balanced_counts, expert_shape, predict

        self.balanced_counts, self.expert_shape, self.predict = balanced_counts, expert_shape, predict
        shapes = self.common.FULL_SHAPES
        if args.dry_run:
            # tiny widths and tokens, experts per rank as at P = 8 (so at --ep 4 half the experts)
            shapes = tuple(
                replace(s, num_experts=(s.num_experts // 8) * args.ep // 2 or args.ep, hidden=64, ffn=32, tokens_per_gpu=256)
                for s in shapes
            )
        self.shapes = shapes
        self.links = tuple(args.links)
        self.min_chunk = 16 if args.dry_run else args.min_chunk_tokens
        self._megatron_ready = False

    def scenario(self, fraction: float, hot: int):
        return self.common.BALANCED if fraction == 0 else self.common.Scenario(fraction, hot)

    def empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # Megatron's parallel state (one process, EP = TP = 1) for its experts modules
    def megatron(self) -> None:
        if self.reasons["megatron"]:
            raise Skip(self.reasons["megatron"])
        if self._megatron_ready:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if self.device.type == "cpu":
            from megatron_llep.compat import cpu_gloo

            cpu_gloo.enable()
        if not dist.is_initialized():  # one process; nothing is communicated, the groups only exist
            errors = []
            for backend in (("nccl", "gloo") if self.device.type == "cuda" else ("gloo",)):
                store = tempfile.NamedTemporaryFile(prefix="gpu_h200_pg_", delete=False)
                store.close()
                os.unlink(store.name)
                try:
                    dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
                    self.env["process_group"] = backend
                    break
                except Exception as exc:  # noqa: BLE001  (NCCL refused: the experts need no collectives)
                    errors.append(f"{backend}: {_reason(exc)}")
            else:
                raise RuntimeError("no process group could be started: " + "; ".join(errors))
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234)
        self._megatron_ready = True

    def build_experts(self, backend: str, shape, num_local: int, fp8: bool = False, seed: int = 0):
        """Megatron's experts module (``SequentialMLP`` or ``TEGroupedMLP``) with ``num_local``
        distinct bf16 experts of ``shape``'s expert math, and its library ExpertAdapter."""
        if backend == "TEGroupedMLP" and self.reasons["te_grouped"]:
            raise Skip(self.reasons["te_grouped"])
        self.megatron()
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        from megatron.core.transformer.spec_utils import ModuleSpec, build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron_llep.compat import mcore
        from megatron_llep.experts import make_expert_adapter

        grouped = backend == "TEGroupedMLP"
        if shape.bias:  # gpt-oss: biases, quick-GELU GLU with linear offset 1 and clamp 7
            math = dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0)
        else:
            math = dict(add_bias_linear=False, activation_func=F.silu)
        extra = dict(fp8="hybrid") if fp8 else {}
        config = TransformerConfig(
            num_layers=1, hidden_size=shape.hidden, num_attention_heads=2, ffn_hidden_size=shape.ffn,
            moe_ffn_hidden_size=shape.ffn, num_moe_experts=shape.num_experts, moe_router_topk=shape.topk,
            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=grouped, gated_linear_unit=True, bias_activation_fusion=True,
            # the modules as on one rank of an EP group (experts' GEMMs without tensor-parallel
            # collectives); this process's parallel state itself is EP = 1
            expert_model_parallel_size=max(self.args.ep, 2),
            params_dtype=self.dtype, bf16=True, use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=False, gradient_accumulation_fusion=False, **math, **extra,
        )
        spec = get_moe_module_spec(use_te=grouped, num_experts=shape.num_experts, moe_grouped_gemm=grouped)
        experts_spec = mcore.moe_submodules(spec).experts
        pg = get_default_pg_collection()
        if isinstance(experts_spec, ModuleSpec):  # Megatron-Core < 0.18
            module = build_module(experts_spec, num_local, config, pg_collection=pg)
        else:  # 0.18+: a callable builder
            module = experts_spec(num_local, config, pg_collection=pg)
        if type(module).__name__ != backend:
            raise RuntimeError(f"Megatron built {type(module).__name__}, not {backend}")
        module = module.to(self.device)
        adapter = make_expert_adapter(module, num_local)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for i in range(num_local):
                for tensor in adapter.expert_tensors(i):
                    tensor.normal_(0.0, 0.02, generator=gen)
        return module, adapter


# ----------------------------------------------------------------------------------- 1. grid
class RankEmulator:
    """Expert weights for ``slots`` expert slots and the SwiGLU GEMMs of one emulated rank."""

    def __init__(self, shape, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = shape
        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, device=device, dtype=dtype) * 0.02).requires_grad_()

        self.w1 = [weight(2 * shape.ffn, shape.hidden) for _ in range(slots)]
        self.w2 = [weight(shape.hidden, shape.ffn) for _ in range(slots)]

    def run(self, tokens_per_slot: list[int], x: torch.Tensor) -> torch.Tensor:
        # torch.split as Megatron's experts do: its backward is one concatenation (slicing x per
        # slot would make every slot's backward zero-fill and add an x-sized gradient)
        out = []
        for slot, rows in enumerate(torch.split(x, tokens_per_slot)):
            if rows.shape[0] == 0:
                continue
            gate, up = (rows @ self.w1[slot].t()).chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ self.w2[slot].t())
        return torch.cat(out)


def _mode(plan: LLEPPlan) -> str:
    return "fallback" if plan.fallback else ("plain" if plan.is_plain_ep else "llep")


def _slots(plan: LLEPPlan, rank: int) -> list[int]:
    return [int(t) for t in plan.rank_view(rank).tokens_per_slot]


def _signature(plan: LLEPPlan) -> tuple:
    return tuple(tuple(_slots(plan, r)) for r in range(plan.ep_size))


def _calibrate(ctx: Context, shape, emulator: RankEmulator) -> tuple[CostModel, list]:
    """Forward GEMM times of one expert at a few sizes -> the cost model's GEMM terms."""
    sizes = (16, 64, 256) if ctx.args.dry_run else (256, 1024, 4096, 16384)
    samples = []
    with torch.no_grad():
        for tokens in sizes:
            x = torch.randn(tokens, shape.hidden, device=ctx.device, dtype=ctx.dtype)
            timing = ctx.timer.run(lambda mark: emulator.run([tokens], x), 3)
            samples.append((tokens, timing["phases_s"][-1]))
    return CostModel.calibrate(samples, ctx.expert_shape(shape)), samples


def _measure_rank(ctx: Context, emulator: RankEmulator, slots: list[int], num_local: int) -> dict:
    total = sum(slots)
    if total == 0:
        return {"fwd_s": 0.0, "fwd_bwd_s": 0.0, "peak_bytes": 0}
    shape = emulator.shape
    borrowed = len(slots) - num_local
    es = ctx.expert_shape(shape)
    used = [w for s, t in enumerate(slots) if t > 0 for w in (emulator.w1[s], emulator.w2[s])]
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    x = torch.randn(total, shape.hidden, device=ctx.device, dtype=ctx.dtype).requires_grad_()
    grad = torch.randn(total, shape.hidden, device=ctx.device, dtype=ctx.dtype)

    def step(mark):
        out = emulator.run(slots, x)
        mark()
        torch.autograd.grad(out, [x, *used], grad)

    timing = ctx.timer.run(step, ctx.args.repeats)
    if cuda:  # tokens, activations, gradients; the emulator keeps every slot's weights resident
        peak = torch.cuda.max_memory_allocated() - base + borrowed * es.weight_bytes
    else:  # no allocator statistics: the same quantities, counted
        peak = total * (3 * shape.hidden + 3 * shape.ffn) * 2 * es.dtype_bytes + borrowed * es.weight_bytes
    return {"fwd_s": timing["phases_s"][0], "fwd_bwd_s": timing["phases_s"][1], "peak_bytes": int(peak)}


def _measure_plan(ctx: Context, state: dict, plan: LLEPPlan) -> dict:
    key = _signature(plan)
    if key not in state["measured"]:
        ranks = [_measure_rank(ctx, state["emulator"], _slots(plan, r), plan.num_local_experts) for r in range(plan.ep_size)]
        state["measured"][key] = {
            "fwd_s": max(r["fwd_s"] for r in ranks),
            "fwd_bwd_s": max(r["fwd_bwd_s"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks),
            "rank_fwd_bwd_ms": [_ms(r["fwd_bwd_s"]) for r in ranks],
        }
    return state["measured"][key]


def _link_model(gbps: float) -> CostModel:
    return CostModel(intra_node_gbps=gbps)  # only its link terms price the plans' traffic


def _comm_s(predicted: dict) -> float:
    """A plan's priced communication: the two token all-to-alls and the time a helper waits for
    borrowed weights beyond its GEMMs (plan_model.predict: weights arrive in waves while the native
    and earlier borrowed experts run)."""
    return predicted["dispatch_s"] + predicted["weights_wait_s"] + predicted["combine_s"]


def grid_setup(ctx: Context, shape, state: dict) -> dict:
    """Calibrate, plan every scenario at every link, size the emulator, measure the ideal."""
    ep = ctx.args.ep
    es = ctx.expert_shape(shape)
    probe = RankEmulator(shape, 1, ctx.device, ctx.dtype)
    try:
        calibrated, samples = _calibrate(ctx, shape, probe)
        calibration = {"samples_ms": [(t, _ms(s)) for t, s in samples], "gemm_tflops": calibrated.gemm_tflops,
                       "gemm_half_efficiency_tokens": calibrated.gemm_half_efficiency_tokens,
                       "gemm_launch_s": calibrated.gemm_launch_s}
    except Exception as exc:  # noqa: BLE001  (a fit that fails leaves the default H200 model)
        calibrated, calibration = CostModel(), {"error": _reason(exc), "used": "default CostModel"}
    del probe
    plans = {}
    for fraction, hot in GRID_SCENARIOS:
        scenario = ctx.scenario(fraction, hot)
        counts = ctx.common.sample_counts(shape, ep, scenario, ctx.args.seed)
        entry = {"ep": plan_llep(counts, LLEPConfig(cost_aware=False, imbalance_threshold=1e9))}
        for gbps in ctx.links:
            model = replace(calibrated, training=True, intra_node_gbps=gbps)
            config = LLEPConfig(cost_model=model, ranks_per_node=ep, min_chunk_tokens=ctx.min_chunk)
            entry[gbps] = plan_llep(counts, config, es)
        plans[scenario.label] = entry
    ideal = plan_llep(ctx.balanced_counts(shape, ep), LLEPConfig(cost_aware=False, imbalance_threshold=1e9))
    all_plans = [ideal] + [p for entry in plans.values() for p in entry.values()]
    slots = max(len(_slots(p, r)) for p in all_plans for r in range(ep))
    state.update(plans=plans, ideal=ideal, measured={}, emulator=RankEmulator(shape, slots, ctx.device, ctx.dtype))
    measured = _measure_plan(ctx, state, ideal)
    links = []
    for gbps in ctx.links:
        comm = ctx.predict(ideal, shape, _link_model(gbps))
        comm_s = _comm_s(comm)
        links.append({"gbps": gbps, "ideal_fwd_ms": _ms(comm_s + measured["fwd_s"]),
                      "ideal_fwd_bwd_ms": _ms(2 * comm_s + measured["fwd_bwd_s"])})
    state["ideal_links"] = {link["gbps"]: link for link in links}
    return {
        "calibration": calibration, "emulator_slots": slots,
        "emulator_weights_gb": round(slots * 3 * shape.hidden * shape.ffn * es.dtype_bytes / 1e9, 3),
        "ideal_gemm_fwd_ms": _ms(measured["fwd_s"]), "ideal_gemm_fwd_bwd_ms": _ms(measured["fwd_bwd_s"]),
        "ideal_peak_gb": round(measured["peak_bytes"] / 1e9, 3), "links": links,
        "summary": f"ideal GEMMs {measured['fwd_bwd_s'] * 1e3:.1f} ms fwd+bwd; calibrated {calibrated.gemm_tflops:.3g} TFLOP/s",
    }


def grid_row(ctx: Context, shape, scenario, state: dict) -> dict:
    if "emulator" not in state:
        raise RuntimeError("this shape's setup (ideal) row failed")
    entry = state["plans"][scenario.label]
    ep_plan = entry["ep"]
    ep_m = _measure_plan(ctx, state, ep_plan)
    links = []
    for gbps in ctx.links:
        llep = entry[gbps]
        llep_m = _measure_plan(ctx, state, llep)
        model = _link_model(gbps)
        p_ep, p_llep = ctx.predict(ep_plan, shape, model), ctx.predict(llep, shape, model)
        comm_ep, comm_llep = _comm_s(p_ep), _comm_s(p_llep)
        ideal = state["ideal_links"][gbps]
        ep_fwd, llep_fwd = comm_ep + ep_m["fwd_s"], comm_llep + llep_m["fwd_s"]
        ep_fb, llep_fb = 2 * comm_ep + ep_m["fwd_bwd_s"], 2 * comm_llep + llep_m["fwd_bwd_s"]
        links.append({
            "gbps": gbps, "llep_mode": _mode(llep), "llep_max_mean": round(p_llep["max_mean"], 4),
            "weight_copies": llep.num_weight_transfers, "weight_gb": round(p_llep["weight_bytes"] / 1e9, 3),
            "ep_comm_fwd_ms": _ms(comm_ep), "llep_comm_fwd_ms": _ms(comm_llep),
            "llep_gemm_fwd_ms": _ms(llep_m["fwd_s"]), "llep_gemm_fwd_bwd_ms": _ms(llep_m["fwd_bwd_s"]),
            "llep_rank_fwd_bwd_ms": llep_m["rank_fwd_bwd_ms"], "llep_peak_gb": round(llep_m["peak_bytes"] / 1e9, 3),
            "ep_fwd_ms": _ms(ep_fwd), "llep_fwd_ms": _ms(llep_fwd), "ideal_fwd_ms": ideal["ideal_fwd_ms"],
            "ep_fwd_bwd_ms": _ms(ep_fb), "llep_fwd_bwd_ms": _ms(llep_fb), "ideal_fwd_bwd_ms": ideal["ideal_fwd_bwd_ms"],
            "speedup_fwd": round(ep_fwd / llep_fwd, 4), "speedup_fwd_bwd": round(ep_fb / llep_fb, 4),
            "llep_vs_ideal_fwd_bwd": round(llep_fb * 1e3 / ideal["ideal_fwd_bwd_ms"], 4),
        })
    head = links[-1]  # flat keys: the forward layer at the last (highest) link, as the paper reports
    p_ep = ctx.predict(ep_plan, shape, _link_model(head["gbps"]))
    return {
        "ep_max_mean": round(p_ep["max_mean"], 4), "ep_gemm_fwd_ms": _ms(ep_m["fwd_s"]),
        "ep_gemm_fwd_bwd_ms": _ms(ep_m["fwd_bwd_s"]), "ep_rank_fwd_bwd_ms": ep_m["rank_fwd_bwd_ms"],
        "ep_peak_gb": round(ep_m["peak_bytes"] / 1e9, 3), "links": links,
        "headline_gbps": head["gbps"], "ep_ms": head["ep_fwd_ms"], "llep_ms": head["llep_fwd_ms"],
        "ideal_ms": head["ideal_fwd_ms"], "speedup": head["speedup_fwd"], "speedup_fwd_bwd": head["speedup_fwd_bwd"],
        "llep_vs_ideal": round(head["llep_fwd_ms"] / head["ideal_fwd_ms"], 4), "llep_max_mean": head["llep_max_mean"],
        "llep_peak_gb": head["llep_peak_gb"],
        "paper_speedup": ctx.common.PAPER_SPEEDUP.get(shape.name, {}).get(scenario.label),
        "summary": (f"fwd+bwd EP {head['ep_fwd_bwd_ms']:.1f} ms, LLEP "
                    + "/".join(f"{link['llep_fwd_bwd_ms']:.1f}" for link in links)
                    + f" ms at {'/'.join(f'{g:g}' for g in ctx.links)} GB/s, x"
                    + "/".join(f"{link['speedup_fwd_bwd']:.2f}" for link in links)),
    }


def grid_section(ctx: Context, rec: Recorder) -> None:
    for shape in ctx.shapes:
        state: dict = {}
        keys = {"model": shape.name, "ep_size": ctx.args.ep}
        rec.row("grid", f"{shape.name} ideal + setup", lambda: grid_setup(ctx, shape, state), scenario="ideal", **keys)
        for fraction, hot in GRID_SCENARIOS:
            scenario = ctx.scenario(fraction, hot)
            rec.row("grid", f"{shape.name} {scenario.label}", lambda: grid_row(ctx, shape, scenario, state),
                    scenario=scenario.label, **keys)
        state.clear()
        ctx.empty_cache()


# ----------------------------------------------------------------------------------- 2. correctness
def _compare(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict:
    tensors, bitwise, worst = {}, True, 0.0
    for name, native, borrowed in pairs:
        same = bool(torch.equal(native, borrowed))
        diff = (native.float() - borrowed.float()).abs().max().item() if native.numel() else 0.0
        scale = native.float().abs().max().item() if native.numel() else 0.0
        rel = diff / scale if scale > 0 else float(diff > 0)
        tensors[name] = {"bitwise": same, "max_abs": diff, "max_rel": rel}
        bitwise &= same
        worst = max(worst, rel)
    status = "pass" if bitwise else ("pass_within_tolerance" if worst <= BF16_TOLERANCE else "fail")
    return {"status": status, "bitwise": bitwise, "max_rel": worst, "tensors": tensors}


def _correctness_inputs(ctx: Context, shape, gen: torch.Generator):
    other = 16 if ctx.args.dry_run else 64
    tokens = 32 if ctx.args.dry_run else 512  # multiples of 16 (fp8 GEMMs need them)
    counts = [other] * CORRECTNESS_EXPERTS
    counts[2] = tokens
    rows = sum(counts)
    hidden = torch.randn(rows, shape.hidden, device=ctx.device, generator=gen).to(ctx.dtype)
    probs = torch.rand(rows, device=ctx.device, generator=gen) + 0.5
    grad = torch.randn(tokens, shape.hidden, device=ctx.device, generator=gen).to(ctx.dtype)
    start = 2 * other
    return counts, hidden, probs, grad, slice(start, start + tokens)


def _borrowed_vs_native(adapter, counts, hidden, probs, grad, rows, grads: bool = True):
    """Expert 2 natively (slot 2) and as a borrowed copy in the first borrowed slot (after the
    native rows, as the layer lays them out): outputs, input gradients, weight gradients."""
    tokens = rows.stop - rows.start
    if torch.equal(adapter.expert_tensors(0)[0], adapter.expert_tensors(2)[0]):
        raise RuntimeError("experts 0 and 2 hold the same weights: the comparison would not see a wrong slot")
    native_in = hidden.clone().requires_grad_(grads)
    out_native = adapter.forward_native(native_in, counts, probs)[rows]
    borrowed = [[t.detach().clone().requires_grad_(grads) for t in adapter.expert_tensors(2)]]
    borrowed_in = torch.cat([hidden, hidden[rows]]).requires_grad_(grads)
    borrowed_probs = torch.cat([probs, probs[rows]])
    out_borrowed = adapter.forward_borrowed(borrowed_in, counts + [tokens], borrowed_probs, borrowed)[0]
    pairs = [("output", out_native.detach(), out_borrowed.detach())]
    if grads:
        weights = adapter.expert_tensors(2)
        g_native = torch.autograd.grad(out_native, [native_in, *weights], grad)
        g_borrowed = torch.autograd.grad(out_borrowed, [borrowed_in, *borrowed[0]], grad)
        pairs.append(("input_grad", g_native[0][rows], g_borrowed[0][-tokens:]))
        for i, (a, b) in enumerate(zip(g_native[1:], g_borrowed[1:])):
            pairs.append((f"weight_grad_{i}", a, b))
    return pairs


def correctness_bf16(ctx: Context, backend: str, shape) -> dict:
    module, adapter = ctx.build_experts(backend, shape, CORRECTNESS_EXPERTS, seed=11)
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    counts, hidden, probs, grad, rows = _correctness_inputs(ctx, shape, gen)
    result = _compare(_borrowed_vs_native(adapter, counts, hidden, probs, grad, rows))
    del module, adapter
    ctx.empty_cache()
    result.update(
        dtype="bf16", tokens=rows.stop - rows.start,
        tolerance=f"max|borrowed - native| <= {BF16_TOLERANCE:g} * max|native| per tensor",
        summary=f"{'bit for bit' if result['bitwise'] else 'max rel %.2e' % result['max_rel']} "
                f"({len(result['tensors'])} tensors: output, input grad, weight grads)",
    )
    return result


def _fp8_autocast():
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    recipe = DelayedScaling()
    if hasattr(te, "fp8_autocast"):
        return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe), "DelayedScaling"
    return lambda: te.autocast(enabled=True, recipe=recipe), "DelayedScaling"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def fp8_checks(ctx: Context, shape, rec: Recorder) -> None:
    """Expert 2 natively and borrowed (ExpertAdapter substitution into slot 0) under fp8, in the
    layer's order (native experts, then borrowed ones) for two micro-batches, and the same with TE's
    per-micro-batch weight cache switched off. Status: what was observed, never a pass."""
    note = ("LLEP rejects fp8 (megatron_llep.dispatcher.check_megatron_config): Transformer Engine caches each "
            "slot's fp8 weight from the first micro-batch and keeps per-slot scaling state, so a borrowed expert "
            "in that slot would compute with the native expert's weight; this entry documents the hazard")
    state: dict = {}

    def run(disable_cache: bool) -> dict:
        if ctx.reasons["fp8"]:
            raise Skip(ctx.reasons["fp8"])
        if "module" not in state:
            module, adapter = ctx.build_experts("TEGroupedMLP", shape, CORRECTNESS_EXPERTS, fp8=True, seed=13)
            gen = torch.Generator(device=ctx.device).manual_seed(7)
            counts, hidden, probs, grad, rows = _correctness_inputs(ctx, shape, gen)
            # bf16 reference of expert 2 (config.fp8 only pads, which is a no-op at these counts)
            with torch.no_grad():
                reference = adapter.forward_native(hidden, counts, probs)[rows].float()
            autocast, recipe = _fp8_autocast()
            state.update(module=module, adapter=adapter, inputs=(counts, hidden, probs, grad, rows),
                         reference=reference, autocast=autocast, recipe=recipe)
        module, adapter = state["module"], state["adapter"]
        counts, hidden, probs, grad, rows = state["inputs"]
        linears = [module.linear_fc1, module.linear_fc2]
        for lin in linears:
            lin.disable_parameter_transpose_cache = disable_cache
        module.set_is_first_microbatch()  # a new global batch: TE refreshes its fp8 weight cache once
        micro = []
        for _ in range(2):
            with state["autocast"]():
                pairs = _borrowed_vs_native(adapter, counts, hidden, probs, grad, rows, grads=False)
            (_, native, borrowed), = pairs
            micro.append({
                "borrowed_vs_native_rel": _rel(borrowed, native), "bitwise": bool(torch.equal(borrowed, native)),
                "native_fp8_vs_bf16_rel": _rel(native, state["reference"]),
            })
        for lin in linears:
            lin.disable_parameter_transpose_cache = False
        return {"recipe": state["recipe"], "micro_batches": micro, "tolerance": f"relative Frobenius error <= {FP8_TOLERANCE:g}",
                "note": note}

    def entry(disable_cache: bool, micro_batch: int) -> Callable[[], dict]:
        def fn() -> dict:
            key = "off" if disable_cache else "on"
            if key not in state:
                try:
                    state[key] = run(disable_cache)
                except Exception as exc:  # noqa: BLE001  (the other entries of this run report it too)
                    state[key] = exc
            if isinstance(state[key], Exception):
                raise state[key]
            result = dict(state[key])
            observed = result["micro_batches"][micro_batch - 1]
            differs = observed["borrowed_vs_native_rel"] > FP8_TOLERANCE
            if disable_cache:
                status = "differs_from_native" if differs else "matches_native"
            elif micro_batch == 1:
                status = "differs_from_native" if differs else "matches_native"
            else:
                status = "hazard_demonstrated" if differs else "hazard_not_reproduced"
            result.update(
                status=status, micro_batch=micro_batch, weight_cache=key, observed=observed,
                summary=f"borrowed vs native rel {observed['borrowed_vs_native_rel']:.3g} "
                        f"(fp8 vs bf16 noise {observed['native_fp8_vs_bf16_rel']:.3g})",
            )
            return result
        return fn

    keys = {"model": shape.name, "experts": "TEGroupedMLP", "dtype": "fp8"}
    rec.row("correctness", "fp8 borrowed vs native, micro-batch 1", entry(False, 1), **keys)
    rec.row("correctness", "fp8 borrowed vs native, micro-batch 2", entry(False, 2), **keys)
    rec.row("correctness", "fp8 control: TE weight cache off, mb 2", entry(True, 2), **keys)
    state.clear()
    ctx.empty_cache()


def correctness_section(ctx: Context, rec: Recorder, fp8: bool) -> None:
    shapes = [s for s in ctx.shapes if s.name in ("gpt-oss-120b", "deepseek-v3")] or list(ctx.shapes[:2])
    if not fp8:  # Kimi-K2's experts have DeepSeek-V3's shape and math
        for backend in ("TEGroupedMLP", "SequentialMLP"):
            for shape in shapes:
                rec.row("correctness", f"bf16 {backend} {shape.name}", lambda: correctness_bf16(ctx, backend, shape),
                        model=shape.name, experts=backend, dtype="bf16")
    else:
        fp8_checks(ctx, shapes[-1], rec)


# ----------------------------------------------------------------------------------- 3. pipeline
class _HostIndexPermutation:
    """Without the dispatcher (no megatron-core): the planner's host-built gather index."""

    def __init__(self, index: np.ndarray, device: torch.device) -> None:
        self.forward = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(device)
        self.inverse = torch.empty_like(self.forward).scatter_(0, self.forward, torch.arange(self.forward.numel(), device=device))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.forward)

    def undo(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.inverse)


def _link_time(bytes_out: float, bytes_in: float, gbps: float) -> float:
    return _link_model(gbps).link_time(float(max(bytes_out, bytes_in)), False)


class Pipeline:
    """One rank of a real LLEP layer step at full shape, piece by piece."""

    def __init__(self, ctx: Context, shape, scenario) -> None:
        self.ctx, self.shape, self.scenario = ctx, shape, scenario
        self.es = ctx.expert_shape(shape)
        self.st: dict[str, Any] = {}

    def _need(self, *keys: str) -> None:
        for key in keys:
            if key not in self.st:
                raise Skip(f"needs the {key} piece, which did not run")

    # host path
    def plan(self) -> dict:
        ctx, ep = self.ctx, self.ctx.args.ep
        counts = ctx.common.sample_counts(self.shape, ep, self.scenario, ctx.args.seed)
        # the library's defaults (cost-aware, H200 cost model); the dry run's tiny shapes spill regardless
        config = LLEPConfig(ranks_per_node=ep, min_chunk_tokens=ctx.min_chunk, cost_aware=not ctx.args.dry_run)
        times = []
        for _ in range(3 if ctx.args.dry_run else 20):
            start = time.perf_counter()
            plan = plan_llep(counts, config, self.es)
            times.append(time.perf_counter() - start)
        views = [plan.rank_view(r) for r in range(ep)]
        helpers = [r for r in range(ep) if views[r].weights_to_receive]
        loads = plan.rank_loads_after
        rank = max(helpers or range(ep), key=lambda r: (int(loads[r]), -r))
        hot = int(np.argmax(plan.rank_loads_before))
        local = plan.num_local_experts
        self.st.update(counts=counts, plan=plan, rank=rank, hot=hot,
                       hot_slots=[int(c) for c in counts[:, hot * local : (hot + 1) * local].sum(axis=0)])
        view = views[rank]
        return {
            "ms": _ms(statistics.median(times)), "mode": _mode(plan), "rank": rank,
            "borrowed_experts": [int(e) for e in view.borrowed_experts], "native_experts": local,
            "rank_rows": int(view.tokens_per_slot.sum()), "ep_hot_rank": hot, "ep_hot_rank_rows": int(sum(self.st["hot_slots"])),
            "max_mean_before": round(float(plan.rank_loads_before.max() / plan.rank_loads_before.mean()), 4),
            "max_mean_after": round(float(loads.max() / loads.mean()), 4), "weight_copies": plan.num_weight_transfers,
            "summary": f"{_mode(plan)}: planner {statistics.median(times) * 1e3:.3f} ms, rank {rank} computes "
                       f"{len(view.borrowed_experts)} borrowed experts",
        }

    def rank_view(self) -> dict:
        self._need("plan")
        plan, rank = self.st["plan"], self.st["rank"]
        times = []
        for _ in range(3 if self.ctx.args.dry_run else 20):
            start = time.perf_counter()
            view = plan.rank_view(rank)
            times.append(time.perf_counter() - start)
        self.st["view"] = view
        return {"ms": _ms(statistics.median(times)), "summary": f"{statistics.median(times) * 1e3:.3f} ms (host)"}

    def permutations(self) -> dict:
        self._need("view")
        view, ctx = self.st["view"], self.ctx
        if ctx.reasons["dispatcher"]:
            self.st["recv_perm"] = _HostIndexPermutation(view.recv_order(), ctx.device)
            self.st["perm_source"] = "planner host index (dispatcher unavailable)"
            raise Skip(ctx.reasons["dispatcher"])
        from megatron_llep.dispatcher import _RowPermutation

        built = {}

        def step(mark):
            built["recv"] = _RowPermutation.recv_order(view, ctx.device)

        timing = ctx.timer.run(step, ctx.args.repeats)
        self.st.update(recv_perm=built["recv"], perm_source="megatron_llep.dispatcher._RowPermutation")
        return {"ms": _ms(timing["phases_s"][-1]), "host_ms": _ms(timing["host_s"]), "device_ms": _ms(timing["phases_s"][-1]),
                "recv_rows": int(view.recv_counts.sum()),
                "summary": f"host {timing['host_s'] * 1e3:.3f} ms, until done {timing['phases_s'][-1] * 1e3:.3f} ms"}

    def send_columns(self) -> dict:
        """The plan folded into the routing map (the dispatcher's _SendColumns): Megatron's own permute
        then emits the send order, so LLEP gathers no token row beyond stock EP's permute."""
        self._need("view")
        view, ctx = self.st["view"], self.ctx
        if ctx.reasons["dispatcher"]:
            raise Skip(ctx.reasons["dispatcher"])
        from megatron_llep.dispatcher import _SendColumns

        per_expert = view.send_counts.sum(axis=1)
        tokens = self.shape.tokens_per_gpu
        routing = torch.zeros(tokens, per_expert.size, dtype=torch.bool, device=ctx.device)
        first = 0
        for expert, count in enumerate(per_expert.tolist()):  # column by column, wrapping over the tokens
            routing[(torch.arange(count, device=ctx.device) + first) % tokens, expert] = True
            first = (first + count) % tokens
        probs = torch.rand(routing.shape, device=ctx.device) * routing

        def step(mark):
            _SendColumns(view, ctx.device).apply(routing, probs)

        timing = ctx.timer.run(step, ctx.args.repeats)
        return {"ms": _ms(timing["phases_s"][-1]), "host_ms": _ms(timing["host_s"]),
                "columns": int(np.count_nonzero(view.send_counts)),
                "summary": f"host {timing['host_s'] * 1e3:.3f} ms, until done {timing['phases_s'][-1] * 1e3:.3f} ms"}

    def _gather(self, perm_key: str, rows: int, undo: bool) -> dict:
        self._need(perm_key)
        ctx, perm = self.ctx, self.st[perm_key]
        tokens = torch.randn(rows, self.shape.hidden, device=ctx.device, dtype=ctx.dtype)
        probs = torch.rand(rows, device=ctx.device)
        if undo:
            timing = ctx.timer.run(lambda mark: perm.undo(tokens), ctx.args.repeats)
            moved = rows * self.es.token_bytes
        else:  # what the layer gathers: tokens and their probabilities; then the backward's inverse gather
            def step(mark):
                perm.apply(tokens)
                perm.apply(probs)
                mark()
                perm.undo(tokens)

            timing = ctx.timer.run(step, ctx.args.repeats)
            moved = rows * (self.es.token_bytes + 4)
        seconds = timing["phases_s"][0]
        return {"ms": _ms(seconds), "bwd_ms": _ms(timing["phases_s"][-1] - seconds) if not undo else None, "rows": rows,
                "index_source": self.st.get("perm_source"), "gb_per_s": round(2 * moved / max(seconds, 1e-12) / 1e9, 2),
                "summary": f"{rows} rows: {seconds * 1e3:.3f} ms"}

    def recv_gather(self) -> dict:
        self._need("view")
        return self._gather("recv_perm", int(self.st["view"].recv_counts.sum()), undo=False)

    def combine_gather(self) -> dict:
        self._need("view")
        return self._gather("recv_perm", int(self.st["view"].recv_counts.sum()), undo=True)

    # experts
    def build(self, backend: str) -> dict:
        self._need("view")
        ctx = self.ctx
        start = time.perf_counter()
        module, adapter = ctx.build_experts(backend, self.shape, self.st["plan"].num_local_experts, seed=21)
        borrowed = [[torch.randn_like(t).mul_(0.02).requires_grad_() for t in adapter.expert_tensors(0)]
                    for _ in self.st["view"].borrowed_experts]
        ctx.timer.sync()
        self.st[f"{backend} build"] = (module, adapter, borrowed)
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        return {"ms": _ms(time.perf_counter() - start), "native_weights_gb": round(weights / 1e9, 3),
                "borrowed_weights_gb": round(len(borrowed) * self.es.weight_bytes / 1e9, 3),
                "summary": f"{type(module).__name__}: {len(borrowed)} borrowed expert(s)"}

    def _fwd_bwd(self, forward: Callable[[torch.Tensor, torch.Tensor], list], rows: int, params: list) -> dict:
        ctx = self.ctx
        hidden = torch.randn(rows, self.shape.hidden, device=ctx.device, dtype=ctx.dtype).requires_grad_()
        probs = torch.rand(rows, device=ctx.device) + 0.5
        with torch.no_grad():
            grads = [torch.randn_like(o) for o in forward(hidden, probs)]

        def step(mark):
            outs = forward(hidden, probs)
            mark()
            torch.autograd.backward(outs, grads)
            hidden.grad = None
            for p in params:
                p.grad = None

        timing = ctx.timer.run(step, ctx.args.repeats)
        fwd, total = timing["phases_s"]
        flops = 3 * self.es.forward_flops(rows)
        rate = flops / max(total, 1e-12) / 1e12
        return {"ms": _ms(total), "fwd_ms": _ms(fwd), "fwd_bwd_ms": _ms(total), "rows": rows,
                "tflops_fwd_bwd": round(rate, 2), "host_ms": _ms(timing["host_s"]),
                "summary": f"{rows} rows: fwd {fwd * 1e3:.2f} ms, fwd+bwd {total * 1e3:.2f} ms ({rate:.0f} TFLOP/s)"}

    def experts(self, backend: str, which: str) -> dict:
        self._need("view", f"{backend} build")
        module, adapter, borrowed = self.st[f"{backend} build"]
        view = self.st["view"]
        local = self.st["plan"].num_local_experts
        counts = [int(c) for c in view.tokens_per_slot]
        native_rows, borrowed_counts = sum(counts[:local]), counts[local:]
        params = list(module.parameters())
        if which == "native":
            return self._fwd_bwd(lambda h, p: [adapter.forward_native(h, counts, p)], native_rows, params)
        if not borrowed_counts:
            raise Skip("this rank computes no borrowed expert in this plan")
        if which == "borrowed":  # the borrowed slots alone (native slots given no rows), wave by wave as the layer runs them
            only_borrowed = [0] * local + borrowed_counts
            waves = view.receive_waves

            def by_wave(h, p):
                outs, first = [], 0
                for wave in sorted(set(waves)):
                    size = waves.count(wave)
                    outs += adapter.forward_borrowed(h, only_borrowed, p, borrowed[first : first + size], local + first)
                    first += size
                return outs

            result = self._fwd_bwd(by_wave, sum(borrowed_counts), params + [t for ts in borrowed for t in ts])
            result["waves"] = len(set(waves))
            return result
        # the same borrowed tokens through the native module's own weights (no substitution)
        def as_native(h, p):
            outs, offset = [], 0
            for start in range(0, len(borrowed_counts), local):
                group = borrowed_counts[start : start + local]
                rows = sum(group)
                padded = torch.tensor(group + [0] * (local - len(group)))
                outs.append(module(h[offset : offset + rows], padded, p[offset : offset + rows])[0])
                offset += rows
            return outs

        return self._fwd_bwd(as_native, sum(borrowed_counts), params)

    def ep_hot_rank(self, backend: str) -> dict:
        self._need("plan", f"{backend} build")
        module, adapter, _ = self.st[f"{backend} build"]
        slots = self.st["hot_slots"]
        result = self._fwd_bwd(lambda h, p: [adapter.forward_native(h, slots, p)], sum(slots), list(module.parameters()))
        result["rank"] = self.st["hot"]
        return result

    def free(self, backend: str) -> None:
        self.st.pop(f"{backend} build", None)
        self.ctx.empty_cache()

    # communication and totals
    def comm(self) -> dict:
        self._need("plan", "view")
        ctx, plan, view, es = self.ctx, self.st["plan"], self.st["view"], self.es
        ep_plan = plan_llep(self.st["counts"], LLEPConfig(cost_aware=False, imbalance_threshold=1e9))
        rank = view.rank
        out_rows = int(view.send_counts.sum() - view.send_counts[:, rank].sum())
        in_rows = int(view.recv_counts.sum() - view.recv_counts[rank].sum())
        bytes_out = out_rows * es.token_bytes + len(view.weights_to_send) * es.weight_bytes
        bytes_in = in_rows * es.token_bytes + len(view.weights_to_receive) * es.weight_bytes
        links = []
        for gbps in ctx.links:
            model = _link_model(gbps)
            p_ep, p_llep = ctx.predict(ep_plan, self.shape, model), ctx.predict(plan, self.shape, model)
            links.append({
                "gbps": gbps, "ep_layer_comm_fwd_ms": _ms(_comm_s(p_ep)),
                "llep_layer_comm_fwd_ms": _ms(_comm_s(p_llep)),
                "rank_dispatch_ms": _ms(_link_time(bytes_out, bytes_in, gbps)),
                "rank_combine_ms": _ms(_link_time(in_rows * es.token_bytes, out_rows * es.token_bytes, gbps)),
            })
        self.st["comm"] = {link["gbps"]: link for link in links}
        return {"ms": links[-1]["llep_layer_comm_fwd_ms"], "rank_rows_out": out_rows, "rank_rows_in": in_rows,
                "weights_out": len(view.weights_to_send), "weights_in": len(view.weights_to_receive), "links": links,
                "summary": "layer comm fwd EP/LLEP " + ", ".join(
                    f"{l['ep_layer_comm_fwd_ms']:.2f}/{l['llep_layer_comm_fwd_ms']:.2f} ms @{l['gbps']:g}" for l in links)}

    def total(self, backend: str, pieces: dict) -> dict:
        """The rank's forward+backward, summed from the pieces, with the layer's communication."""
        def ms(name, key="ms"):
            row = pieces.get(name)
            if not row or row["status"] != "ok" or row.get(key) is None:
                raise Skip(f"needs the {name} piece, which did not run")
            return row[key]

        llep_compute = ms(f"{backend} native") + ms(f"{backend} borrowed")
        ep_compute = ms(f"{backend} ep_hot_rank")
        host = ms("plan") + ms("rank_view") + ms("permutations", "host_ms") + ms("send_columns", "host_ms")
        # the receive gather replaces stock's chunk sort, which the EP side does not count (conservative)
        gathers = ms("send_columns") + ms("recv_gather") + ms("recv_gather", "bwd_ms") + 2 * ms("combine_gather")
        self._need("comm")
        links = []
        for gbps, comm in self.st["comm"].items():
            llep = host + gathers + llep_compute + 2 * comm["llep_layer_comm_fwd_ms"]
            ep = ep_compute + 2 * comm["ep_layer_comm_fwd_ms"]
            links.append({"gbps": gbps, "llep_rank_fwd_bwd_ms": round(llep, 4), "ep_hot_rank_fwd_bwd_ms": round(ep, 4),
                          "speedup": round(ep / llep, 4)})
        head = links[-1]
        return {"ms": head["llep_rank_fwd_bwd_ms"], "host_ms": round(host, 4), "gathers_ms": round(gathers, 4),
                "llep_experts_ms": round(llep_compute, 4), "ep_experts_ms": round(ep_compute, 4), "links": links,
                "summary": f"LLEP rank {head['llep_rank_fwd_bwd_ms']:.1f} ms vs EP hot rank "
                           f"{head['ep_hot_rank_fwd_bwd_ms']:.1f} ms "
                           f"fwd+bwd @{head['gbps']:g} GB/s (host {host:.2f}, gathers {gathers:.2f} ms)"}


def pipeline_section(ctx: Context, rec: Recorder) -> None:
    fraction, hot = (float(x) for x in ctx.args.pipeline_scenario.split(":"))
    scenario = ctx.scenario(fraction, int(hot))
    for shape in ctx.shapes:
        pipe = Pipeline(ctx, shape, scenario)
        pieces: dict[str, dict] = {}
        keys = {"model": shape.name, "scenario": scenario.label}

        def piece(name: str, fn: Callable[[], dict]) -> None:
            pieces[name] = rec.row("pipeline", f"{shape.name} {name}", fn, piece=name, **keys)

        piece("plan", pipe.plan)
        piece("rank_view", pipe.rank_view)
        piece("permutations", pipe.permutations)
        piece("send_columns", pipe.send_columns)
        piece("recv_gather", pipe.recv_gather)
        piece("combine_gather", pipe.combine_gather)
        piece("comm", pipe.comm)
        for backend in ("TEGroupedMLP", "SequentialMLP"):
            piece(f"{backend} build", lambda: pipe.build(backend))
            piece(f"{backend} native", lambda: pipe.experts(backend, "native"))
            piece(f"{backend} borrowed", lambda: pipe.experts(backend, "borrowed"))
            piece(f"{backend} borrowed_as_native", lambda: pipe.experts(backend, "as_native"))
            piece(f"{backend} ep_hot_rank", lambda: pipe.ep_hot_rank(backend))
            pipe.free(backend)
            piece(f"{backend} total", lambda: pipe.total(backend, pieces))
        pipe.st.clear()
        ctx.empty_cache()


# ----------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=8, help="emulated EP ranks")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median), after one warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--links", type=float, nargs="+", default=[200.0, 300.0, 400.0],
                        help="per-direction NVLink bandwidths (GB/s) the communication is priced at")
    parser.add_argument("--min-chunk-tokens", type=int, default=1024, help="LLEP's m in the grid (dry run: 16)")
    parser.add_argument("--pipeline-scenario", default="0.95:4", help="f:h of the pipeline section")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--time-budget", type=float, default=450.0,
                        help="seconds after which no new row starts; the rest are recorded as skipped")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, to check every code path in seconds")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    parser.add_argument("--without-megatron", action="store_true",
                        help="testing: behave as if megatron-core were not installed")
    parser.add_argument("--out", default="results/gpu_h200.json")
    args = parser.parse_args()
    if args.without_megatron:
        sys.meta_path.insert(0, _WithoutMegatron())

    ctx = Context(args)
    header = {
        "benchmark": "gpu_h200",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": ctx.common.machine_info(),
        "environment": ctx.env,
        "unavailable": {k: v for k, v in ctx.reasons.items() if v},
        "settings": {**vars(args), "device": str(ctx.device), "dtype": "bf16", "min_chunk_tokens_used": ctx.min_chunk,
                     "shapes": [asdict(s) for s in ctx.shapes],
                     "grid_scenarios": [ctx.scenario(*s).label for s in GRID_SCENARIOS],
                     "bf16_tolerance": BF16_TOLERANCE, "fp8_tolerance": FP8_TOLERANCE},
    }
    rec = Recorder(args.out, args.time_budget, header)
    print(f"gpu_h200: {ctx.device}, torch {torch.__version__}, megatron-core {ctx.env['megatron_core']}, "
          f"Transformer Engine {ctx.env['transformer_engine']}; budget {args.time_budget:g} s; writing {args.out}", flush=True)
    for name, reason in header["unavailable"].items():
        print(f"  unavailable: {name}: {reason}", flush=True)
    if "grid" in args.sections:
        grid_section(ctx, rec)
    if "correctness" in args.sections:
        correctness_section(ctx, rec, fp8=False)
    if "pipeline" in args.sections:
        pipeline_section(ctx, rec)
    if "correctness" in args.sections:
        correctness_section(ctx, rec, fp8=True)
    rec.finish()

    grid = [r for r in rec.rows if r["section"] == "grid" and r["status"] == "ok" and "links" in r and "ep_ms" in r]
    if grid:
        print()
        ctx.common.print_table(grid, [
            ("model", "model", ""), ("scenario", "scenario", ""), ("ep_max_mean", "EP max/mean", ".2f"),
            ("llep_max_mean", "LLEP max/mean", ".2f"), ("ep_ms", "EP fwd ms", ".2f"), ("llep_ms", "LLEP fwd ms", ".2f"),
            ("ideal_ms", "ideal fwd ms", ".2f"), ("speedup", "fwd x", ".2f"), ("speedup_fwd_bwd", "fwd+bwd x", ".2f"),
            ("paper_speedup", "paper fwd x", ""), ("ep_peak_gb", "EP peak GB", ".2f"), ("llep_peak_gb", "LLEP peak GB", ".2f"),
        ])
    print(f"\n{rec.status}: {len(rec.rows)} rows in {rec.elapsed():.0f} s "
          + ", ".join(f"{s}: {c}" for s, c in rec.sections().items()) + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
