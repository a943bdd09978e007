"""Hugging Face checkpoint -> Megatron-Core model chunks, per rank and streaming: every rank reads only
the tensors of the parameters it holds (expert rows included) and narrows tensor-parallel parameters
to its partition, through the family's rule table (:mod:`recipes.hf.rules`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from recipes.hf.checkpoint import HFCheckpoint, HFCheckpointError
from recipes.hf.rules import (
    TRANSFORMS,
    Context,
    ConversionError,
    Entry,
    Reader,
    Transform,
    _agree,
    _as_chunks,
    _CompiledRule,
    _Family,
    _layer_of,
    _log,
    _partition_dim,
    _proc_status,
    _reset_peak_rss,
    _strip_wrappers,
    _tp_group_of,
    _world,
    canonical_entries,
)


@dataclass
class ImportReport:
    """Per-rank numbers of one import."""

    parameters: int = 0  # local tensors filled
    param_bytes: int = 0  # their bytes (this rank's own parameter memory)
    bytes_read: int = 0  # bytes read from the checkpoint by this rank
    tensors_read: int = 0
    rss_before: int = 0  # RSS when the import started (bytes)
    peak_rss: int = 0  # peak RSS during the import (VmHWM after a reset; 0 if unknown)
    peak_reset: bool = False  # whether VmHWM could be reset at the start
    seconds: float = 0.0

    @property
    def peak_overhead(self) -> int:
        """Peak RSS above the RSS at the start: what the import itself needed on this rank."""
        return max(0, self.peak_rss - self.rss_before)


def import_hf_checkpoint(model_chunks, ckpt: Union[HFCheckpoint, str], family, *, verbose: bool = True,
                         check_unused: bool = True) -> ImportReport:
    """Fill every local parameter of ``model_chunks`` from the HF checkpoint ``ckpt`` (a
    directory or an :class:`HFCheckpoint`) with ``family``'s table (a family or recipe name, or
    the module). Call it right after the model is built, before a CAP placement is applied and
    before DDP and the optimizer exist. Collective; raises :class:`ConversionError` on every rank
    if a parameter has no rule, a tensor is missing or has the wrong shape, or (``check_unused``)
    some HF tensor was read by no rank and the family does not list it as ignorable."""
    if isinstance(ckpt, str):
        try:
            ckpt = HFCheckpoint(ckpt)
        except HFCheckpointError as err:
            _agree(str(err))
            raise
    fam = _Family(family)
    chunks = _as_chunks(model_chunks)
    report = ImportReport(rss_before=_proc_status().get("VmRSS", 0))
    report.peak_reset = _reset_peak_rss()
    start = time.perf_counter()
    error = None
    try:
        entries = [(e, getattr(_strip_wrappers(chunk), "config", None)) for chunk in chunks
                   for e in canonical_entries(chunk)]
        todo = []
        for entry, config in entries:
            found = fam.find(entry.canonical)
            if found is None:
                if not isinstance(entry.tensor, torch.nn.Parameter):
                    continue  # a buffer no rule names
                raise ConversionError(f"Megatron parameter {entry.canonical} ({entry.local_name}) has no rule in "
                                      f"{fam.module.__name__}.MAPPING")
            todo.append((entry, config, *found))
        layers_total = len({_layer_of(e.canonical) for e, _, _, _ in todo} - {None})
        done_layers: set = set()
        current_layer = None
        with torch.no_grad():
            for entry, config, rule, groups in todo:
                layer = _layer_of(entry.canonical)
                if layer != current_layer and current_layer is not None and current_layer not in done_layers:
                    ckpt.release()  # unmap what this layer read
                    done_layers.add(current_layer)
                    _log(f"layer {current_layer} imported ({len(done_layers)}/{layers_total} on rank 0, "
                         f"{ckpt.bytes_read / 2**20:.1f} MiB read)", verbose)
                current_layer = layer
                _import_one(entry, config, rule, groups, fam, ckpt)
                report.parameters += 1
                report.param_bytes += entry.tensor.numel() * entry.tensor.element_size()
            if current_layer is not None and current_layer not in done_layers:
                done_layers.add(current_layer)
                _log(f"layer {current_layer} imported ({len(done_layers)}/{layers_total} on rank 0, "
                     f"{ckpt.bytes_read / 2**20:.1f} MiB read)", verbose)
    except (ConversionError, HFCheckpointError) as err:
        error = str(err)
    _agree(error)
    if check_unused:
        fam.add_ignorable(ckpt.config, next((c for _, c in entries if c is not None), None) if error is None else None)
        used = set(ckpt.names_read)
        if _world() > 1:
            gathered: list = [None] * _world()
            dist.all_gather_object(gathered, sorted(used))
            used = set().union(*map(set, gathered))
        unused = sorted(n for n in ckpt.names() if n not in used and not fam.ignorable(n))
        if unused:
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise ConversionError(f"{ckpt.directory}: {len(unused)} tensor(s) not used by any Megatron parameter: "
                                  f"{', '.join(unused[:5])}{more} (a different architecture or config.json?)")
    report.bytes_read = ckpt.bytes_read
    report.tensors_read = len(ckpt.names_read)
    report.peak_rss = _proc_status().get("VmHWM", 0)
    report.seconds = time.perf_counter() - start
    ckpt.close()
    return report


def _import_one(entry: Entry, config, rule: _CompiledRule, groups: dict[str, int], fam: _Family,
                ckpt: HFCheckpoint) -> None:
    param = entry.tensor
    names = fam.hf_names(rule, groups, ckpt.config)
    ctx = Context(config=config, hf_config=ckpt.config, dtype=param.dtype,
                  megatron_name=entry.canonical, hf_names=names, groups=groups, device=param.device)
    hint = ""
    if groups.get("mtp") is not None:  # e.g. transformers' save_pretrained keeps config.json's MTP count, not the layer
        hint = (f" (multi-token-prediction layer {groups['mtp']}, which config.json's num_nextn_predict_layers = "
                f"{ckpt.config.get('num_nextn_predict_layers')} promises: pass --hf-drop-mtp to build the model "
                "without MTP layers; library: recipe_from_hf_config(..., drop_mtp=True))")
    transform = TRANSFORMS[rule.transform_name]
    tp_rank, tp_size, _ = _tp_group_of(entry)
    dim = _partition_dim(entry, tp_size)
    rows = _own_rows(entry, transform, rule, names, ckpt, dim, tp_rank, tp_size)
    reader = Reader(ckpt, expert_row=groups["expert"] if rule.rule.fused_experts else None, missing_hint=hint,
                    rows=rows)
    full = transform.to_megatron(reader, names, ctx)
    if rows is not None:
        dim = None  # read as this rank's partition already
    local = full
    if dim is not None and full.dim() != param.dim():  # e.g. sinks [heads] for a [1, heads, 1, 1] parameter
        dim = next((d for d, n in enumerate(full.shape) if n > 1), 0)
    if dim is not None:
        if full.shape[dim] % tp_size:
            raise ConversionError(f"{' + '.join(names)} -> {entry.canonical}: dim {dim} of {tuple(full.shape)} is not "
                                  f"divisible by tensor-parallel size {tp_size}")
        part = full.shape[dim] // tp_size
        local = full.narrow(dim, tp_rank * part, part)
    if tuple(local.shape) != tuple(param.shape) and local.numel() == param.numel() and \
            [n for n in local.shape if n != 1] == [n for n in param.shape if n != 1]:
        local = local.reshape(param.shape)  # the same values with singleton dims added or dropped
    if tuple(local.shape) != tuple(param.shape):
        raise ConversionError(f"{' + '.join(names)} {tuple(full.shape)} does not fit Megatron {entry.canonical} "
                              f"{tuple(param.shape)}{' (TP partition)' if dim is not None else ''}: config.json and "
                              f"the recipe disagree on a size")
    param.data.copy_(local.to(device=param.device, dtype=param.dtype))


def _own_rows(entry: Entry, transform: Transform, rule: _CompiledRule, names: tuple[str, ...], ckpt: HFCheckpoint,
              dim: Optional[int], tp_rank: int, tp_size: int) -> Optional[slice]:
    """The rows of the HF tensor this rank's dim-0 partition holds, where a row-local transform
    lets it read only those (None: read the whole tensor and narrow it)."""
    if dim != 0 or not transform.row_local or rule.rule.fused_experts or len(names) != 1 or not ckpt.has(names[0]):
        return None
    shape = ckpt.shape(names[0])
    part = entry.tensor.shape[0]
    if shape[0] != part * tp_size or tuple(shape[1:]) != tuple(entry.tensor.shape[1:]):
        raise ConversionError(f"{names[0]} {tuple(shape)} does not fit Megatron {entry.canonical} "
                              f"{tuple(entry.tensor.shape)} (TP partition): config.json and the recipe disagree "
                              "on a size")
    return slice(tp_rank * part, (tp_rank + 1) * part)
