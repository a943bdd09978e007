"""Hugging Face checkpoints in and out of the fine-tuning recipes (run under torchrun; as one process
only where the recipe runs at EP = 1: gpt-oss's expert biases need EP >= 2 with local experts, so
its import is refused there with that reason).

Import (HF -> a Megatron checkpoint in recipes/runtime/checkpointing.py's layout, iteration 0, that
``recipes/finetune.py --load OUT`` resumes from with the same recipe, layout and --seq-length)::

    python -m torch.distributed.run --nproc_per_node 8 -m recipes.hf import --hf /models/gpt-oss-20b \\
        --recipe gpt-oss-20b --out ckpt [--expert-model-parallel-size 8 --seq-length 4096 ... any finetune.py flag]

Export (a Megatron checkpoint saved by finetune.py or by ``import`` -> HF safetensors + config.json,
experts in their original order even if the run used a CAP placement)::

    python -m torch.distributed.run --nproc_per_node 2 -m recipes.hf export --load ckpt --out hf_out \\
        [--quant-source /models/gpt-oss-20b | --fresh-scales | --dequantized]

A model imported from a quantized checkpoint (config.json's ``quantization_config``: gpt-oss's MXFP4
experts, DeepSeek-V3's block FP8) is exported in that precision, with the same tensor names and
quantization_config, each block under the scale that errs least (recipes/hf/quantization.py):
``--quant-source DIR`` (the checkpoint imported) lends its block scales, so every block training
left unchanged comes out bit for bit as it went in, and its shard layout (each tensor in the shard
file its index names; ``--max-shard-size-gib`` applies without it); ``--fresh-scales`` chooses among
new scales only; ``--dequantized`` writes plain ``--dtype`` weights instead. One of them is required
for such a model. The export prints the quantization error per tensor group, the logit check (the
model as trained vs as exported on a fixed prompt set) and its peak memory per rank; an export
whose top-1 agreement falls below ``LOGIT_CHECK_MIN_AGREEMENT`` is removed again (exit status 1)
unless ``--accept-logit-difference``.

The model sizes come from the config.json recorded in the checkpoint (runs started from
``--hf-checkpoint`` or ``import``), from ``--hf-config``, or from the recipe. Any TP/PP/EP layout
can export any checkpoint (dist_checkpointing reshards). Errors are one line from rank 0, exit status 2
(config.json and the layout of an import are checked before any process group starts).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Optional, Sequence

import torch

from recipes.runtime.entry_point import (EntryPoint, RankZeroArgumentParser, check_numeric_domains, check_writable_directories,
                                  launch_rank)

ENTRY = EntryPoint("recipes.hf")  # its lines: "[recipes.hf] ...", errors once per job from rank 0

LOGIT_CHECK_PROMPTS = (4, 64)  # the fixed prompt set of the export's logit check: sequences x tokens
LOGIT_CHECK_SEED = 0
# below this top-1 agreement with the model as trained the export refuses (removes what it wrote, exit 1)
# unless --accept-logit-difference
LOGIT_CHECK_MIN_AGREEMENT = 0.99


def _parser() -> argparse.ArgumentParser:
    parser = RankZeroArgumentParser(prog="python -m recipes.hf", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face checkpoint -> Megatron checkpoint (iteration 0)",
                         description="Other flags are finetune.py's (layout, --seq-length, --dtype, ...): the "
                                     "checkpoint resumes with the same ones.")
    imp.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face checkpoint directory")
    imp.add_argument("--recipe", required=True, help="gpt-oss-20b, gpt-oss-120b, gpt-oss-tiny (any size), deepseek-v3, ...")
    imp.add_argument("--out", required=True, metavar="DIR", help="save directory (finetune.py --load DIR)")
    imp.add_argument("--hf-drop-mtp", action="store_true",
                     help="build the model without config.json's multi-token-prediction layers "
                          "(num_nextn_predict_layers) and ignore their tensors: for checkpoints saved without them, "
                          "e.g. by transformers' save_pretrained; the checkpoint records no MTP layers")
    exp = sub.add_parser("export", help="Megatron checkpoint -> Hugging Face safetensors + config.json")
    exp.add_argument("--load", required=True, metavar="DIR", help="finetune.py --save directory or one iter_* directory")
    exp.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    exp.add_argument("--recipe", default=None, help="default: the checkpoint's")
    exp.add_argument("--hf-config", default=None, metavar="PATH",
                     help="config.json (or its directory) giving the model sizes, if the checkpoint records none")
    exp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    exp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    exp.add_argument("--expert-model-parallel-size", type=int, default=None, help="default: world / (TP x PP)")
    exp.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype of the written tensors")
    exp.add_argument("--max-shard-size-gib", type=float, default=5.0,
                     help="shard size bound, unless --quant-source gives the source's shard layout")
    precision = exp.add_mutually_exclusive_group()
    precision.add_argument("--quant-source", default=None, metavar="DIR",
                           help="the quantized Hugging Face checkpoint the model was imported from: export in its "
                                "precision and shard layout, each block under the scale that errs least, its own block "
                                "scale among them (unchanged blocks are bit-identical)")
    precision.add_argument("--fresh-scales", action="store_true",
                           help="export in the source's precision (quantization_config), each block under the new "
                                "scale that errs least")
    precision.add_argument("--dequantized", action="store_true",
                           help="write plain --dtype weights even if the source checkpoint was quantized")
    exp.add_argument("--skip-logit-check", action="store_true",
                     help="with a quantized export, skip comparing the logits on a fixed prompt set before and after "
                          "quantization (PP = 1 only)")
    exp.add_argument("--accept-logit-difference", action="store_true",
                     help=f"keep a quantized export whose top-1 agreement with the model as trained (the logit check) "
                          f"is below {LOGIT_CHECK_MIN_AGREEMENT}, with a warning; without it such an export is removed "
                          "and the command exits with status 1")
    return parser


def _single_process_env() -> None:
    """Run as one process when started by neither torchrun nor srun (whose variables give RANK and
    WORLD_SIZE: the import checks its layout before any process group starts)."""
    from recipes.runtime.launch_env import rendezvous_env_from_slurm

    try:
        rendezvous_env_from_slurm()
    except ValueError as err:  # inconsistent SLURM_* variables
        ENTRY.fail(err, launch_rank())
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _launch_world_size() -> int:
    """The job's world size before any process group exists (torchrun's, srun's, or 1)."""
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() else 1


def run_import(args: argparse.Namespace, rest: list[str]) -> str:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from recipes.runtime import checkpointing, finetuning, model_building

    fargs = finetuning.parse_args(["--recipe", args.recipe, "--hf-checkpoint", args.hf, "--save", args.out,
                                 *(["--hf-drop-mtp"] if args.hf_drop_mtp else []), *rest])
    # config.json and the layout before any process group starts: every rank finds a bad one alike,
    # rank 0 reports it and the others wait for the launcher to end them
    try:
        hf_config, layout = model_building.layout_for(fargs, _launch_world_size(),
                                                      torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    except model_building.ConfigError as err:
        ENTRY.fail(err, launch_rank())
    rank, world, device = ENTRY.init_distributed()
    ENTRY.lock_save_directory(args.out, rank, "--out")  # one run per save directory, as in fine-tuning
    parallel_state.initialize_model_parallel(layout["tp"], layout["pp"], expert_model_parallel_size=layout["ep"],
                                             expert_tensor_parallel_size=1)
    torch.manual_seed(fargs.seed)
    model_parallel_cuda_manual_seed(fargs.seed)
    try:
        recipe, model, optimizer, scheduler = finetuning.build(fargs, layout, device, 0, None, hf_config,
                                                             import_hf=args.hf)
    except model_building.ConfigError as err:
        ENTRY.fail(err, rank)
    # the distributed optimizer's sharded state needs Adam's (zero) state entries before any step
    checkpointing._create_empty_adam_state(optimizer)
    run_info = finetuning.run_info_for(fargs, layout, world, hf_config)
    try:
        directory = checkpointing.save_checkpoint(args.out, model, optimizer, scheduler,
                                                  checkpointing.TrainingProgress(), run_info)
    except checkpointing.CheckpointSaveError as err:  # e.g. a full disk: one line, the partial files removed
        ENTRY.fail(err, rank, status=1)
    ENTRY.say(f"wrote {directory} ({recipe.name}, TP={layout['tp']} PP={layout['pp']} EP={layout['ep']}); fine-tune "
              f"with: recipes/finetune.py --recipe {args.recipe} --load {args.out} --save {args.out} "
              f"{' '.join(rest)}".rstrip())
    parallel_state.destroy_model_parallel()
    return directory


def _read_hf_config(path: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--hf-config {path}: cannot read {file} ({err})") from None


def exported_config(source: Optional[dict], generated: dict, quantized: bool = False) -> dict:
    """The config.json an export writes: the source checkpoint's (recorded by ``import`` or
    ``--hf-checkpoint``, or ``--hf-config``) field for field, since training changes no field of it
    and only the source knows its conventions (``rope_interleave``, ``initializer_range``, the rope
    field form, ...), less ``quantization_config`` unless the export is ``quantized`` (in the
    source's precision); without a source config, the one the recipe describes."""
    if not source:
        return dict(generated)
    return {k: v for k, v in source.items() if quantized or k != "quantization_config"}


def export_quantizer(args: argparse.Namespace, hf_config: Optional[dict], family,
                     device: Optional[torch.device] = None):
    """The :class:`recipes.hf.quantization.ExportQuantizer` (quantizing on ``device``) for an export in
    the source's precision, or None for plain weights; ValueError (one line naming the flag) where
    the flags and the checkpoint disagree."""
    from recipes.hf.checkpoint import HFCheckpoint
    from recipes.hf.quantization import ExportQuantizer

    quant = (hf_config or {}).get("quantization_config")
    if not quant:
        if args.quant_source or args.fresh_scales:
            raise ValueError(f"--{'quant-source' if args.quant_source else 'fresh-scales'}: the checkpoint's "
                             "config.json has no quantization_config (it was not imported from a quantized checkpoint)")
        return None
    if args.dequantized:
        return None
    method = quant.get("quant_method")
    rules = getattr(family, "QUANTIZED_HF", None)
    if not rules:
        raise ValueError(f"config.json: quantization_config.quant_method = {method!r} has no export in "
                         f"{family.__name__}; pass --dequantized")
    if not (args.quant_source or args.fresh_scales):
        raise ValueError(f"the model was imported from a {method} checkpoint: pass --quant-source DIR (that checkpoint: "
                         "unchanged blocks keep its bits), --fresh-scales (new scales) or --dequantized (plain weights)")
    source = None
    if args.quant_source:
        source = HFCheckpoint(args.quant_source)
        source_method = (source.config.get("quantization_config") or {}).get("quant_method")
        if source_method != method:
            raise ValueError(f"--quant-source {args.quant_source}: its quantization_config.quant_method is "
                             f"{source_method!r}, the model's {method!r}; give the checkpoint the model was imported from")
    return ExportQuantizer(rules, hf_config, source, device=device)


def quantization_logits(model, family, hf_config: dict, quantizer, device: torch.device,
                        dtype: torch.dtype = torch.bfloat16) -> tuple:
    """Logits ``(as trained, as exported)`` of the model on the fixed prompt set (seeded random
    token ids, ``LOGIT_CHECK_PROMPTS``): the second with every weight replaced by what the
    checkpoint exported with ``quantizer`` and ``dtype`` loads, in place (call it after the
    export). Collective; PP = 1."""
    from recipes.hf.exporting import quantize_parameters_in_place
    from recipes.runtime.logits import lm_logits

    gen = torch.Generator().manual_seed(LOGIT_CHECK_SEED)
    ids = torch.randint(0, int(hf_config["vocab_size"]), LOGIT_CHECK_PROMPTS, generator=gen).to(device)
    model.eval()
    with torch.no_grad():
        trained = lm_logits(model, ids).float()
        quantize_parameters_in_place([model], family, hf_config, quantizer, dtype)
        exported = lm_logits(model, ids).float()
    return trained, exported


def top1_agreement(trained: torch.Tensor, exported: torch.Tensor) -> float:
    """The fraction of positions where both logits pick the same token."""
    return float((exported.argmax(-1) == trained.argmax(-1)).float().mean())


def logit_difference_line(trained: torch.Tensor, exported: torch.Tensor) -> str:
    diff = (exported - trained).abs()
    return (f"logit difference, exported vs as trained ({LOGIT_CHECK_PROMPTS[0]} fixed prompts x "
            f"{LOGIT_CHECK_PROMPTS[1]} tokens): max abs {float(diff.max()):.3e}, relative "
            f"{float(diff.max() / trained.abs().max()):.3e}, top-1 agreement {top1_agreement(trained, exported):.4f}")


def finish_logit_check(agreement: float, out_dir: str, files: Sequence[str], accept: bool, rank: int) -> None:
    """The logit check's verdict on an export written to ``out_dir`` (``files``: its shards) whose
    top-1 agreement with the model as trained is ``agreement`` (the same on every rank): below
    ``LOGIT_CHECK_MIN_AGREEMENT`` the export is removed and the command ends with one line, exit
    status 1, unless ``accept`` (--accept-logit-difference), which keeps it with a warning line."""
    from recipes.hf.checkpoint import remove_hf_checkpoint_files

    if agreement >= LOGIT_CHECK_MIN_AGREEMENT:
        return
    problem = (f"logit check: the exported model's top-1 agreement with the model as trained is {agreement:.4f}, "
               f"below {LOGIT_CHECK_MIN_AGREEMENT} (docs/finetune.md, export in the published precision)")
    if accept:
        ENTRY.say(f"warning: {problem}; the export is kept (--accept-logit-difference)", file=sys.stderr)
        return
    if rank == 0:
        remove_hf_checkpoint_files(out_dir, files)
    ENTRY.fail(RuntimeError(f"{problem}: removed the exported files from {out_dir}; pass --accept-logit-difference "
                            "to keep such an export, or --dequantized for plain weights"), rank, status=1)


def run_export(args: argparse.Namespace) -> str:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_llep.placement import read_checkpoint_placement
    from recipes.runtime import checkpointing, model_building
    from recipes.runtime.model_building import check_vocabulary_split
    from recipes.hf.exporting import export_hf_checkpoint
    from recipes.hf.rules import ConversionError, family_key, family_module
    from recipes.hf.quantization import error_report

    rank, world, device = ENTRY.init_distributed()
    try:
        directory = checkpointing.resolve_checkpoint(args.load)
        run_info = model_building.saved_run_info(directory)
        recipe_name = args.recipe or run_info.get("recipe")
        if recipe_name is None:
            raise ValueError(f"{directory} records no recipe: pass --recipe")
        recorded = run_info.get("recipe")
        if args.recipe and recorded and family_key(args.recipe) != family_key(recorded):
            raise ValueError(f"--recipe {args.recipe} is a {family_key(args.recipe)} model, but {directory} was trained "
                             f"as {recorded} ({family_key(recorded)}): drop --recipe (the checkpoint's is the default)")
        hf_config = _read_hf_config(args.hf_config) if args.hf_config else run_info.get("hf_config")
        family = family_module(recipe_name)
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        if world % (tp * pp):
            raise ValueError(f"world size {world} is not divisible by TP x PP = {tp} x {pp}")
        ep = args.expert_model_parallel_size or world // (tp * pp)
        fargs = argparse.Namespace(recipe=recipe_name, hf_checkpoint=args.hf_config, load=args.load,
                                   hf_config_source=args.hf_config and f"--hf-config {args.hf_config}")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        recipe = model_building.make_recipe(fargs, hf_config, ep_size=ep, tp_size=tp, pp_size=pp, dtype=dtype,
                                      cpu=device.type == "cpu")
        check_vocabulary_split(recipe, tp, hf_config is not None)
        quantizer = export_quantizer(args, hf_config, family, device=device if device.type == "cuda" else None)
        shard_layout = quantizer.source.weight_map() if quantizer is not None and quantizer.source is not None else None
    except (ValueError, checkpointing.CheckpointError) as err:
        ENTRY.fail(err, rank)
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(recipe.config, recipe.layer_spec(), mtp_block_spec=recipe.mtp_spec(recipe.layer_spec()),
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), **recipe.gpt_model_kwargs())
    if device.type == "cuda":
        model.cuda(device)
    state = {"model": model.sharded_state_dict(metadata=checkpointing.SHARDING_METADATA)}
    mismatch = checkpointing.tensor_mismatch(state, directory)
    if mismatch:
        described = f"--hf-config {args.hf_config}" if args.hf_config else f"--recipe {args.recipe}" if args.recipe \
            else "what it records"
        ENTRY.fail(ValueError(f"the model {described} describes is not the one {directory} holds: {mismatch}; give the "
                              f"config.json and recipe it was trained with"
                              f"{'' if described == 'what it records' else ' (or drop the flag)'}"), rank)
    loaded = dist_checkpointing.load(state, directory)
    model.load_state_dict(loaded["model"])
    placement = read_checkpoint_placement(directory)
    config_json = exported_config(hf_config, family.hf_config_from_recipe(recipe), quantized=quantizer is not None)
    export_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    precision = f"{hf_config['quantization_config'].get('quant_method')}, " if quantizer is not None else ""
    ENTRY.say(f"exporting {directory} ({recipe.name}, {precision}{args.dtype}"
              f"{', CAP placement undone' if placement else ''}) to {args.out}")
    try:
        report = export_hf_checkpoint([model], recipe_name, args.out, config_json,
                                      dtype=export_dtype, placement=placement, max_shard_bytes=int(args.max_shard_size_gib * 2**30),
                                      quantizer=quantizer, shard_layout=shard_layout)
    except ConversionError as err:
        ENTRY.fail(err, rank)
    for line in error_report(report.quantization):
        ENTRY.say(line)
    if quantizer is not None and not args.skip_logit_check:
        if pp > 1:
            ENTRY.say("logit check skipped: it runs at --pipeline-model-parallel-size 1")
        else:
            try:
                trained, exported = quantization_logits(model, recipe_name, config_json, quantizer, device,
                                                        dtype=export_dtype)
            except ConversionError as err:
                ENTRY.fail(err, rank)
            ENTRY.say(logit_difference_line(trained, exported))
            agreement = [top1_agreement(trained, exported)]
            dist.broadcast_object_list(agreement, src=0)  # rank 0's logits decide, for every rank alike
            finish_logit_check(agreement[0], args.out, report.files, args.accept_logit_difference, rank)
    ENTRY.say(f"wrote {report.tensors} tensors, {report.bytes_written / 2**20:.1f} MiB in {len(report.files)} shard(s) "
              f"to {args.out} in {report.seconds:.1f} s; peak RSS +{report.peak_overhead / 2**20:.0f} MiB on rank 0")
    parallel_state.destroy_model_parallel()
    dist.barrier()
    return args.out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "export" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "export":
        check_numeric_domains(parser, args, ("max_shard_size_gib", "tensor_model_parallel_size",
                                             "pipeline_model_parallel_size", "expert_model_parallel_size"))
    if args.command == "import" and not os.path.isdir(args.hf):
        parser.error(f"--hf: {args.hf} is not a directory")
    if args.command == "export" and not os.path.isdir(args.load):
        parser.error(f"--load: {args.load} is not a directory")
    check_writable_directories(parser, [(args.out, "--out")])  # import: its save directory, export: the HF files
    from recipes.runtime.cpu_warnings import quiet_known_cpu_warnings

    quiet_known_cpu_warnings()  # before the first Megatron-Core import
    _single_process_env()
    import torch.distributed as dist

    if args.command == "import":
        run_import(args, rest)
    else:
        run_export(args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
