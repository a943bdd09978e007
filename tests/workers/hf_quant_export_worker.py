"""Rank-side code of tests/hf/test_hf_quant_export.py: import a quantized gpt-oss (MXFP4) and
DeepSeek-V3 (block FP8) checkpoint at EP = 2, export it in the published precision untouched, then
after a pretend training step (every parameter nudged) in the published precision and in float32.
Also the numbers docs/finetune.md quotes: ``python tests/workers/hf_quant_export_worker.py DIR``, the
export's per-rank peak memory on a model many shards large; ``python tests/workers/hf_quant_export_worker.py
--fine-tuned DIR``, the MXFP4 export of the tiny gpt-oss fine-tuned at three learning rates (with the
``recipes`` on PYTHONPATH, so that another tree's export can be measured on the same checkpoints)."""

from __future__ import annotations

import os
import shutil
import zlib

import torch


def _nudge(model, scale: float) -> None:
    """A stand-in for training: every parameter moves by ``scale`` x N(0, 1), seeded by its local
    name (replicated parameters move alike on every rank)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            param.add_(scale * torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype))


def _exports(model, family, source_dir: str, out_root: str, prefix: str, recipe_config: dict) -> dict:
    """Round trip (source scales), fresh scales; after the nudge: published precision and fp32."""
    from recipes.hf.__main__ import exported_config, quantization_logits
    from recipes.hf.checkpoint import HFCheckpoint
    from recipes.hf.exporting import export_hf_checkpoint
    from recipes.hf.rules import family_module
    from recipes.hf.quantization import ExportQuantizer

    module = family_module(family)
    source_config = HFCheckpoint(source_dir).config
    quantized_config = exported_config(source_config, recipe_config, quantized=True)

    def export(name: str, source, dtype=torch.bfloat16, quantized: bool = True):
        quantizer = ExportQuantizer(module.QUANTIZED_HF, source_config, source) if quantized else None
        config = quantized_config if quantized else exported_config(source_config, recipe_config)
        layout = source.weight_map() if source is not None else None  # as the CLI: --quant-source's shards
        return export_hf_checkpoint([model], family, os.path.join(out_root, f"{prefix}_{name}"), config, dtype=dtype,
                                    max_shard_bytes=64 * 1024, verbose=False, quantizer=quantizer, shard_layout=layout)

    out = dict(round_trip=export("round_trip", HFCheckpoint(source_dir)), fresh=export("fresh", None))
    _nudge(model, 2e-2)
    out["tuned"] = export("tuned", HFCheckpoint(source_dir))
    out["tuned_fp32"] = export("tuned_fp32", None, dtype=torch.float32, quantized=False)
    # the CLI's logit check (last: it quantizes the weights in place)
    quantizer = ExportQuantizer(module.QUANTIZED_HF, source_config, HFCheckpoint(source_dir))
    out["trained_logits"], out["exported_logits"] = quantization_logits(model, family, quantized_config, quantizer,
                                                                        torch.device("cpu"))
    return out


def run(rank: int, world: int, gpt_oss_mxfp4: str, deepseek_fp8: str, out_root: str) -> dict:
    import hf_deepseek_v3_worker as D
    import hf_gpt_oss_worker as W
    from recipes.hf.importing import import_hf_checkpoint
    from recipes.hf.tables.gpt_oss import hf_config_from_recipe

    torch._dynamo.config.disable = True
    recipe, model = W._build(W.Job(gpt_oss_mxfp4, torch.zeros(1), torch.zeros(1)), W.Layout(ep=world, llep=False))
    import_hf_checkpoint([model], gpt_oss_mxfp4, "gpt-oss", verbose=False)
    out = {"gpt-oss": _exports(model, "gpt-oss", gpt_oss_mxfp4, out_root, "gpt_oss", hf_config_from_recipe(recipe))}
    _, model = D._build(deepseek_fp8, world)  # the same EP = world process groups
    D._import(model, deepseek_fp8)
    out["deepseek-v3"] = _exports(model, "deepseek-v3", deepseek_fp8, out_root, "deepseek", {})
    return out


# ---------------------------------------------------------------------------------------------
# memory: python tests/workers/hf_quant_export_worker.py DIR
# ---------------------------------------------------------------------------------------------


def measure(rank: int, world: int, mxfp4_dir: str, out_dir: str, max_shard_bytes: int, source_layout: bool = False) -> dict:
    """Import ``mxfp4_dir`` at EP = world, export it in MXFP4 (source scales; with ``source_layout``
    into the source's shard files, as ``--quant-source`` does, else into ``max_shard_bytes``
    shards); per-rank numbers."""
    import hf_gpt_oss_worker as W
    from recipes.hf.checkpoint import HFCheckpoint
    from recipes.hf.exporting import export_hf_checkpoint
    from recipes.hf.importing import import_hf_checkpoint
    from recipes.hf.tables.gpt_oss import QUANTIZED_HF
    from recipes.hf.quantization import ExportQuantizer

    _, model = W._build(W.Job(mxfp4_dir, torch.zeros(1), torch.zeros(1)), W.Layout(ep=world, llep=False))
    imported = import_hf_checkpoint([model], mxfp4_dir, "gpt-oss", verbose=False)
    config = HFCheckpoint(mxfp4_dir).config
    layout = HFCheckpoint(mxfp4_dir).weight_map() if source_layout else None
    exported = export_hf_checkpoint([model], "gpt-oss", out_dir, config, max_shard_bytes=max_shard_bytes, verbose=False,
                                    quantizer=ExportQuantizer(QUANTIZED_HF, config, HFCheckpoint(mxfp4_dir)),
                                    shard_layout=layout)
    return dict(param_mib=imported.param_bytes / 2**20, import_peak_mib=imported.peak_overhead / 2**20,
                export_peak_mib=exported.peak_overhead / 2**20, rss_before_mib=exported.rss_before / 2**20,
                peak_reset=exported.peak_reset, written_mib=exported.bytes_written / 2**20, shards=len(exported.files),
                seconds=exported.seconds)


# ---------------------------------------------------------------------------------------------
# after fine-tuning: python tests/workers/hf_quant_export_worker.py --fine-tuned DIR
# ---------------------------------------------------------------------------------------------


def fine_tuned_exports(root: str) -> None:
    """The tiny gpt-oss in MXFP4 (vocabulary 320: the byte tokenizer's ids fit), fine-tuned two
    steps by finetune.py --hf-checkpoint (2 ranks, LLEP) at learning rates 1e-3 (the tiny recipe's
    default), 1e-4 and 2e-5, each exported with --quant-source in bf16 and fp32 (one process):
    prints the export's error and logit-check lines (a refused export prints them too)."""
    import subprocess
    import sys

    import hf_gpt_oss_worker as W
    import recipes

    repo = os.path.dirname(os.path.dirname(os.path.abspath(recipes.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    bf16, mxfp4 = os.path.join(root, "bf16"), os.path.join(root, "mxfp4")
    if not os.path.isdir(mxfp4):
        W.save_tiny_model(bf16, mxfp4, vocab_size=320)
    print(f"recipes from {repo}", flush=True)
    for lr in ("1e-3", "1e-4", "2e-5"):
        ckpt = os.path.join(root, f"tuned_lr{lr}")
        if not os.path.isdir(ckpt):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "recipes/finetune.py",
                            "--recipe", "gpt-oss-tiny", "--hf-checkpoint", mxfp4, "--train-iters", "2", "--lr", lr,
                            "--min-lr", "0", "--lr-warmup-iters", "0", "--seq-length", "32", "--save", ckpt],
                           cwd=repo, env=env, check=True, capture_output=True)
        for dtype in ("bf16", "fp32"):
            out = os.path.join(root, f"export_lr{lr}_{dtype}")
            shutil.rmtree(out, ignore_errors=True)
            result = subprocess.run([sys.executable, "-m", "recipes.hf", "export", "--load", ckpt, "--out", out,
                                     "--quant-source", mxfp4, "--dtype", dtype, "--expert-model-parallel-size", "1"],
                                    cwd=repo, env=env, capture_output=True, text=True)
            for line in (result.stdout + result.stderr).splitlines():
                if any(key in line for key in ("quantization error", "logit difference", "error:", "warning:")):
                    print(f"lr {lr}, {dtype}: {line}", flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "--fine-tuned":
        fine_tuned_exports(sys.argv[2])
        sys.exit(0)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # recipes/, run from anywhere
    import hf_gpt_oss_worker as W
    from megatron_llep.testing.distributed import run_distributed

    root = sys.argv[1]
    shard = 16 * 2**20
    for layers in (4, 8):  # the export's peak should not grow with the model: it holds one layer at a time
        mxfp4 = os.path.join(root, f"mxfp4_{layers}_layers")
        if not os.path.isdir(mxfp4):
            W.save_tiny_model(os.path.join(root, f"bf16_{layers}_layers"), mxfp4, max_shard_size="64MB",
                              **{**W.MEASURE_SHAPE, "num_hidden_layers": layers})
        size = sum(os.path.getsize(os.path.join(mxfp4, f)) for f in os.listdir(mxfp4)) / 2**20
        for world, source_layout in ((1, False), (2, False), (2, True)):
            out = os.path.join(root, f"export_{layers}_layers_ep{world}{'_source_layout' if source_layout else ''}")
            shutil.rmtree(out, ignore_errors=True)
            for rank, r in enumerate(run_distributed(measure, world, mxfp4, out, shard, source_layout, timeout_s=900)):
                where = "the source's shard files" if source_layout else f"shards of <= {shard / 2**20:.0f} MiB"
                print(f"{layers} layers, MXFP4 checkpoint {size:.0f} MiB, EP={world} rank {rank}, {where}: own parameters "
                      f"{r['param_mib']:.0f} MiB (fp32); peak RSS over the start: import +{r['import_peak_mib']:.0f} "
                      f"MiB, export +{r['export_peak_mib']:.0f} MiB (over {r['rss_before_mib']:.0f} MiB; wrote "
                      f"{r['written_mib']:.0f} MiB in {r['shards']} files, "
                      f"{r['seconds']:.1f} s)", flush=True)
