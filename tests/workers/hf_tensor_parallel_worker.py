"""Rank side of tests/hf/test_hf_tensor_parallel.py: build a family's recipe from a Hugging Face
config.json at TP x EP (LLEP layers, expert TP 1, sequence parallelism off as the CPU recipes
build it), import, compare the logits with transformers', run the negative controls and export (and
the quantized export's logit check)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Job:
    """One family at one layout (a launch runs several, one after the other)."""

    family: str  # "gpt-oss" or "deepseek-v3"
    hf_dir: str
    ids: torch.Tensor
    reference: torch.Tensor  # transformers' logits of ``ids``
    tp: int
    ep: int
    export_dir: str
    wrong_dim_export_dir: str  # the export with one parameter's partition dim flipped
    quant_source: Optional[str] = None  # the checkpoint in its quantized layout: run the export's logit check


# the row-parallel parameter whose partition dim the negative controls flip (1 -> 0)
WRONG_DIM_PARAMETER = "decoder.layers.0.self_attention.linear_proj.weight"
WRONG_DIM_HF_TENSOR = "model.layers.0.self_attn.o_proj.weight"  # its tensor in both families


def _build(job: Job):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_llep.config import LLEPConfig
    from megatron_llep.runtime.layer import with_llep
    from recipes.hf.checkpoint import HFCheckpoint
    from recipes.hf.rules import family_module

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(job.tp, 1, expert_model_parallel_size=job.ep,
                                             expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    hf_config = HFCheckpoint(job.hf_dir).config
    name = "gpt-oss-tiny" if job.family == "gpt-oss" else None
    recipe = family_module(job.family).recipe_from_hf_config(hf_config, name, ep_size=job.ep, tp_size=job.tp,
                                                             dtype=torch.float32, cpu=True)
    spec = with_llep(recipe.layer_spec(), LLEPConfig(min_chunk_tokens=1, cost_aware=False))
    model = GPTModel(recipe.config, spec, mtp_block_spec=recipe.mtp_spec(spec), **recipe.gpt_model_kwargs())
    return recipe, model.eval()


def _logits_err(model, job: Job) -> float:
    from recipes.runtime.logits import lm_logits

    with torch.no_grad():
        out = lm_logits(model, job.ids).double()
    reference = job.reference.double()
    return float((out - reference).abs().max() / reference.abs().max())


@contextlib.contextmanager
def _partition_dim_flipped(model):
    param = dict(model.named_parameters())[WRONG_DIM_PARAMETER]
    assert param.partition_dim == 1, param.partition_dim
    param.partition_dim = 0
    try:
        yield
    finally:
        param.partition_dim = 1


@contextlib.contextmanager
def _gate_up_without_rank_blocks():
    """DeepSeek's dense/shared ``linear_fc1`` as plain ``[gate; up]`` (not ``[gate_r; up_r]`` per rank)."""
    from recipes.hf.rules import TRANSFORMS, register_transform, Transform

    original = TRANSFORMS["deepseek_gate_up"]

    class Unblocked(Transform):
        def to_megatron(self, read, names, ctx):
            return torch.cat([read(n) for n in names])

    register_transform("deepseek_gate_up", Unblocked())
    try:
        yield
    finally:
        register_transform("deepseek_gate_up", original)


def _checkpoint_counting_bytes_per_tensor(directory: str):
    from recipes.hf.checkpoint import HFCheckpoint

    class Counting(HFCheckpoint):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.bytes_by_tensor: dict[str, int] = {}

        def _count(self, name: str, tensor: torch.Tensor) -> None:
            super()._count(name, tensor)
            self.bytes_by_tensor[name] = self.bytes_by_tensor.get(name, 0) + tensor.numel() * tensor.element_size()

    return Counting(directory)


def run(rank: int, world: int, jobs: list) -> list:
    """Every job of the launch in turn: one result dict per job."""
    return [run_one(job) for job in jobs]


def run_one(job: Job) -> dict:
    from recipes.hf.checkpoint import HFCheckpoint
    from recipes.hf.exporting import export_hf_checkpoint
    from recipes.hf.importing import import_hf_checkpoint
    from recipes.hf.rules import ConversionError, family_module

    torch._dynamo.config.disable = True
    recipe, model = _build(job)
    ckpt = _checkpoint_counting_bytes_per_tensor(job.hf_dir)
    report = import_hf_checkpoint(model, ckpt, job.family, verbose=False)
    out = dict(err=_logits_err(model, job), bytes_read=report.bytes_read, bytes_by_tensor=ckpt.bytes_by_tensor)

    # negative controls: a wrong partition dim (import refuses it, the export's tensor differs);
    # for DeepSeek-V3 also the gate/up TP layout dropped (same shapes, wrong values)
    with _partition_dim_flipped(model):
        try:
            import_hf_checkpoint(model, job.hf_dir, job.family, verbose=False)
            out["wrong_dim_import_error"] = None
        except ConversionError as err:
            out["wrong_dim_import_error"] = str(err)
    import_hf_checkpoint(model, job.hf_dir, job.family, verbose=False)
    if job.family == "deepseek-v3":
        with _gate_up_without_rank_blocks():
            import_hf_checkpoint(model, job.hf_dir, job.family, verbose=False)
        out["gate_up_unblocked_err"] = _logits_err(model, job)
        import_hf_checkpoint(model, job.hf_dir, job.family, verbose=False)
    out["err_after_controls"] = _logits_err(model, job)

    module = family_module(job.family)
    base = HFCheckpoint(job.hf_dir).config
    hf_config = module.hf_config_from_recipe(recipe, base) if job.family == "gpt-oss" else base
    export_hf_checkpoint(model, job.family, job.export_dir, hf_config, verbose=False)
    with _partition_dim_flipped(model):
        export_hf_checkpoint(model, job.family, job.wrong_dim_export_dir, hf_config, verbose=False)
    if job.quant_source:  # last: it replaces the weights by their quantized round trip
        from recipes.hf.__main__ import quantization_logits
        from recipes.hf.quantization import ExportQuantizer

        source = HFCheckpoint(job.quant_source)
        quantizer = ExportQuantizer(module.QUANTIZED_HF, source.config, source)
        trained, exported = quantization_logits(model, job.family, source.config, quantizer, torch.device("cpu"))
        out["logit_check_max_abs"] = float((exported - trained).abs().max())
    return out


def checkpoint_tensors(directory: str) -> dict:
    import glob
    import os

    from safetensors.torch import load_file

    out = {}
    for file in glob.glob(os.path.join(directory, "*.safetensors")):
        out.update(load_file(file))
    return out


def first_difference(original: dict, exported: dict) -> Optional[str]:
    """The first tensor name whose exported tensor is not bitwise the original (None: all equal)."""
    if sorted(original) != sorted(exported):
        return f"names differ: {sorted(set(original) ^ set(exported))[:3]}"
    for name in sorted(original):
        a, b = original[name], exported[name]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            return name
    return None
