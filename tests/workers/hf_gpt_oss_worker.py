"""Rank-side code of tests/hf/test_hf_gpt_oss.py: build the gpt-oss recipe from a Hugging Face
config.json at some TP/PP/EP layout, import the checkpoint, run the forward pass and compare the
logits with transformers' (computed by the test process on the same token ids). Imported by spawned
gloo processes, and by the test itself for building the tiny Hugging Face models."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

HIDDEN, FFN, HEADS, GROUPS, HEAD_DIM, VOCAB, EXPERTS, LAYERS = 32, 32, 4, 2, 8, 96, 8, 4  # MXFP4: widths % 32 == 0
SLIDING_WINDOW, SEQ, BATCH = 8, 24, 2
HOT_EXPERTS = (0, 1, 2)  # the router bias favours these (all on EP rank 0 of 2): LLEP spills


# ---------------------------------------------------------------------------------------------
# the tiny Hugging Face models (test process)
# ---------------------------------------------------------------------------------------------


def hf_config(**overrides):
    from transformers import GptOssConfig

    kwargs = dict(num_hidden_layers=LAYERS, num_local_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=FFN,
                  head_dim=HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=GROUPS, vocab_size=VOCAB,
                  sliding_window=SLIDING_WINDOW, max_position_embeddings=131072, num_experts_per_tok=4)
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def randomize(model, seed: int = 0, hot_bias: float = 6.0) -> None:
    """Every tensor random: norms 1 +- 0.2, expert biases large enough that the +-7 clamps act
    (so clamping before or after the bias differ), sinks, router bias favouring HOT_EXPERTS."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif "experts" in name and "bias" in name:
                param.copy_(4.0 * noise)
            elif name.endswith("sinks"):
                param.copy_(noise)
            elif name.endswith("router.bias"):
                noise[list(HOT_EXPERTS)] += hot_bias
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.2 * noise)


def random_mxfp4(shape: tuple, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``(blocks, scales)`` for a weight of ``shape`` = (..., rows, cols): blocks
    ``[..., rows, cols/32, 16]`` uint8 (two E2M1 values per byte), scales ``[..., rows, cols/32]``
    E8M0 exponents 124..126 (values up to 6 * 2**-1)."""
    *lead, rows, cols = shape
    blocks = torch.randint(0, 256, (*lead, rows, cols // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(124, 127, (*lead, rows, cols // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def save_tiny_model(directory: str, mxfp4_directory: Optional[str] = None, seed: int = 0, max_shard_size="5GB",
                    **overrides):
    """A random GptOssForCausalLM saved in bf16 with save_pretrained (the dequantized layout); its
    expert weights are MXFP4 values (dequantized by transformers' own converter), and with
    ``mxfp4_directory`` the same model is also written as the release stores it (``*_blocks`` /
    ``*_scales``, quantization_config). Returns the fp32 model loaded back from ``directory``."""
    import json
    import shutil

    from safetensors.torch import load_file
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = GptOssForCausalLM(hf_config(**overrides))
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    packed = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                # the stored (quantized) weight is [E, out, in]; transformers holds its transpose
                e, rows, cols = param.shape
                blocks, scales = random_mxfp4((e, cols, rows), gen)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).float())
                packed[name] = (blocks, scales)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size=max_shard_size)
    if mxfp4_directory:
        os.makedirs(mxfp4_directory, exist_ok=True)
        tensors = {}
        for file in sorted(os.listdir(directory)):
            if file.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(directory, file)))
        for name, (blocks, scales) in packed.items():
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        from recipes.hf.checkpoint import HFCheckpointWriter

        writer = HFCheckpointWriter(mxfp4_directory, dtype=None, max_shard_bytes=int(64 * 2**20))
        for name in sorted(tensors, key=_layer_order):
            writer.add(name, tensors[name])
        writer.close()
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        with open(os.path.join(mxfp4_directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        shutil.copy(os.path.join(directory, "generation_config.json"), mxfp4_directory)
    return GptOssForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32).eval()


def _layer_order(name: str) -> tuple:
    parts = name.split(".")
    return (int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1, name)


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# rank side
# ---------------------------------------------------------------------------------------------


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 2
    llep: bool = True
    gpu_settings: bool = False  # the recipe as built for GPUs (cpu=False), parameters created on CPU
    backward: bool = False  # also run a backward pass (does Megatron's in-place fc2 bias break at EP=TP=1?)


@dataclass
class Job:
    hf_dir: str
    ids: torch.Tensor
    reference: torch.Tensor
    layout: Layout = field(default_factory=Layout)
    extra_layouts: tuple = ()  # more layouts of the same world: each builds, imports and compares
    negative_controls: bool = False
    placement: bool = False
    export_dir: Optional[str] = None
    mxfp4_dir: Optional[str] = None  # the same model with MXFP4 experts: imported params must be equal
    error_dirs: tuple = ()  # broken checkpoints: the error each import raises


def _build(job: Job, layout: Layout):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_llep.config import LLEPConfig
    from megatron_llep.runtime.layer import with_llep
    from recipes.hf.checkpoint import HFCheckpoint
    from recipes.hf.tables.gpt_oss import recipe_from_hf_config

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(layout.tp, layout.pp, expert_model_parallel_size=layout.ep,
                                             expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    config = HFCheckpoint(job.hf_dir).config
    recipe = recipe_from_hf_config(config, "gpt-oss-tiny", ep_size=layout.ep, tp_size=layout.tp, pp_size=layout.pp,
                                   dtype=torch.float32, cpu=not layout.gpu_settings)
    if layout.gpu_settings:
        recipe.config.use_cpu_initialization = True  # the GPU recipe, its parameters created on this CPU
    spec = recipe.layer_spec()
    if layout.llep:
        spec = with_llep(spec, LLEPConfig(min_chunk_tokens=1, imbalance_threshold=1.0, cost_aware=False))
    model = GPTModel(recipe.config, spec, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), **recipe.gpt_model_kwargs())
    return recipe, model


def logits(model, ids: torch.Tensor, pp: int) -> Optional[torch.Tensor]:
    """The model's logits [batch, seq, vocab] on the last pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state

    position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    if pp == 1:
        return model(ids, position_ids, None)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        output = model_chunk(batch, position_ids, None)
        return output, lambda out: (out.sum() * 0.0, {"logits": out.detach()})

    model.config.pipeline_dtype = torch.float32
    stored = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
        seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return stored[0]["logits"]


def _compare(model, job: Job, layout: Layout) -> Optional[float]:
    with torch.no_grad():
        out = logits(model, job.ids, layout.pp)
    return None if out is None else rel_err(out, job.reference)


def _llep_modes(model) -> list[str]:
    return [(m.token_dispatcher.last_stats.mode, round(m.token_dispatcher.last_stats.max_mean_before, 2)) for m in model.modules()
            if hasattr(m, "token_dispatcher") and getattr(m.token_dispatcher, "last_stats", None) is not None]


class _UnsplitGateUp:
    """Negative control: gate_up_proj's interleaved columns taken as (glu half, linear half)."""

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return read(name).t()

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        return {name: tensor.t()}


def run(rank: int, world: int, job: Job) -> dict:
    from recipes.hf.tables import gpt_oss  # noqa: F401  (registers the transforms)
    from recipes.hf.exporting import export_hf_checkpoint
    from recipes.hf.importing import import_hf_checkpoint
    from recipes.hf.rules import TRANSFORMS, register_transform, Transform

    torch._dynamo.config.disable = True
    out: dict = {}
    layout = job.layout
    recipe, model = _build(job, layout)
    report = import_hf_checkpoint([model], job.hf_dir, "gpt-oss", verbose=False)
    out["report"] = report
    out["err"] = _compare(model, job, layout)
    out["modes"] = _llep_modes(model)

    if job.mxfp4_dir:
        reference = {n: p.detach().clone() for n, p in model.named_parameters()}
        import_hf_checkpoint([model], job.mxfp4_dir, "gpt-oss", verbose=False)
        out["mxfp4_max_param_diff"] = max(float((p.detach() - reference[n]).abs().max()) for n, p in model.named_parameters())
        out["mxfp4_err"] = _compare(model, job, layout)

    if job.negative_controls:
        controls = {}
        # 1) gate/up columns left interleaved (weight and bias)
        saved = {k: TRANSFORMS[k] for k in ("gpt_oss_gate_up", "gpt_oss_gate_up_bias")}
        broken = type("Unsplit", (_UnsplitGateUp, Transform), {})()
        broken_bias = type("UnsplitBias", (Transform,), {
            "to_megatron": lambda self, read, names, ctx: read(names[0]),
            "to_hf": lambda self, tensor, ctx: {ctx.hf_names[0]: tensor}})()
        register_transform("gpt_oss_gate_up", broken)
        register_transform("gpt_oss_gate_up_bias", broken_bias)
        try:
            import_hf_checkpoint([model], job.hf_dir, "gpt-oss", verbose=False)
            controls["gate_up_not_deinterleaved"] = _compare(model, job, layout)
        finally:
            for key, transform in saved.items():
                register_transform(key, transform)
        import_hf_checkpoint([model], job.hf_dir, "gpt-oss", verbose=False)
        # 2) Megatron's fused bias + quick-GEGLU (clamps before adding fc1's bias): what the recipe refuses
        model.config.bias_activation_fusion = True
        try:
            controls["fused_bias_activation"] = _compare(model, job, layout)
        finally:
            model.config.bias_activation_fusion = False
        # 3) attention sinks dropped (zero): Megatron's learnable softmax offset must carry them
        with torch.no_grad():
            sinks = [m.softmax_offset for m in model.modules() if getattr(m, "softmax_offset", None) is not None]
            saved_sinks = [s.detach().clone() for s in sinks]
            for s in sinks:
                s.zero_()
            controls["sinks_dropped"] = _compare(model, job, layout)
            for s, v in zip(sinks, saved_sinks):
                s.copy_(v)
        out["controls"] = controls
        out["err_after_controls"] = _compare(model, job, layout)

    placement = None
    if job.placement:
        from megatron_llep.placement import ExpertPlacement
        from megatron_llep.integrations.placement import apply_placement
        from megatron_llep.integrations.placement import moe_layers

        numbers = sorted(moe_layers(model))
        all_layers = range(1, recipe.config.num_layers + 1)
        rng = np.random.default_rng(7)
        perms = {n: rng.permutation(recipe.config.num_moe_experts) for n in all_layers}
        placement = ExpertPlacement(recipe.config.num_moe_experts, layout.ep, perms)
        apply_placement(model, placement)
        out["placed_layers"] = numbers
        out["placement_err"] = _compare(model, job, layout)
        out["placement_modes"] = _llep_modes(model)

    if job.export_dir:
        from recipes.hf.checkpoint import HFCheckpoint
        from recipes.hf.tables.gpt_oss import hf_config_from_recipe

        base = HFCheckpoint(job.hf_dir).config
        out["export"] = export_hf_checkpoint([model], "gpt-oss", job.export_dir, hf_config_from_recipe(recipe, base),
                                             placement=placement, max_shard_bytes=64 * 1024, verbose=False)

    for extra in job.extra_layouts:
        _, model = _build(job, extra)
        import_hf_checkpoint([model], job.hf_dir, "gpt-oss", verbose=False)
        out.setdefault("extra", []).append((extra, _compare(model, job, extra), _llep_modes(model)))
        if extra.backward:
            out["backward"] = _backward(model, job.ids)

    if job.error_dirs:
        out["errors"] = import_errors(rank, world, list(job.error_dirs))
    return out


def _backward(model, ids: torch.Tensor) -> str:
    try:
        position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        model(ids, position_ids, None).sum().backward()
        return "ok"
    except RuntimeError as err:
        return f"RuntimeError: {str(err).splitlines()[0]}"


def import_errors(rank: int, world: int, directories: list) -> list:
    """The error each (broken) checkpoint directory's import raises (None if it imports)."""
    from recipes.hf.importing import import_hf_checkpoint
    from recipes.hf.rules import ConversionError

    messages = []
    for directory in directories:
        _, model = _build(Job(directory, torch.zeros(1), torch.zeros(1)), Layout(ep=1, llep=False))
        try:
            import_hf_checkpoint([model], directory, "gpt-oss", verbose=False)
            messages.append(None)
        except ConversionError as err:
            messages.append(f"ConversionError: {err}")
    return messages


# ---------------------------------------------------------------------------------------------
# host memory of a streaming import (docs/finetune.md): python tests/workers/hf_gpt_oss_worker.py DIR
# ---------------------------------------------------------------------------------------------

MEASURE_SHAPE = dict(num_hidden_layers=8, num_local_experts=32, hidden_size=512, intermediate_size=512, head_dim=64,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=8192)


def measure(rank: int, world: int, hf_dir: str) -> dict:
    """Build the recipe from ``hf_dir``'s config.json at EP = world, import, and report per rank."""
    job = Job(hf_dir, torch.zeros(1), torch.zeros(1))
    _, model = _build(job, Layout(ep=world, llep=False))
    from recipes.hf.importing import import_hf_checkpoint

    report = import_hf_checkpoint([model], hf_dir, "gpt-oss", verbose=False)
    from recipes.hf.rules import _proc_status

    return dict(status={k: v / 2**20 for k, v in _proc_status().items()}, param_mib=report.param_bytes / 2**20, read_mib=report.bytes_read / 2**20,
                rss_before_mib=report.rss_before / 2**20, peak_overhead_mib=report.peak_overhead / 2**20,
                peak_reset=report.peak_reset, seconds=report.seconds)


if __name__ == "__main__":
    import sys

    from megatron_llep.testing.distributed import run_distributed

    root = sys.argv[1]
    bf16, mxfp4 = os.path.join(root, "bf16"), os.path.join(root, "mxfp4")
    if not os.path.isdir(bf16):
        save_tiny_model(bf16, mxfp4, max_shard_size="64MB", **MEASURE_SHAPE)
    for directory in (bf16, mxfp4):
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 2**20
        for world in (1, 2):
            for rank, r in enumerate(run_distributed(measure, world, directory, timeout_s=900)):
                print(f"{os.path.basename(directory)} ({size:.0f} MiB on disk) EP={world} rank {rank}: own parameters "
                      f"{r['param_mib']:.1f} MiB (fp32), read {r['read_mib']:.1f} MiB, peak RSS during the import "
                      f"+{r['peak_overhead_mib']:.1f} MiB over {r['rss_before_mib']:.0f} MiB, {r['seconds']:.1f} s "
                      f"(after: {', '.join(f'{k} {v:.0f}' for k, v in r['status'].items())})", flush=True)
