"""Megatron-Core model chunks -> a Hugging Face checkpoint: tensor-parallel partitions gathered inside
their group, every tensor sent from one owning rank to rank 0, layer by layer, which writes bounded
safetensors shards in the published precision (:class:`recipes.hf.quantization.ExportQuantizer`);
and the round trip through that precision applied to the model in place."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_llep.runtime.state import drop_kept_experts
from megatron_llep.writable import OutputError
from recipes.hf.checkpoint import HFCheckpointWriter
from recipes.hf.importing import _import_one
from recipes.hf.rules import (
    TRANSFORMS,
    Context,
    ConversionError,
    Entry,
    _agree,
    _as_chunks,
    _CompiledRule,
    _Family,
    _log,
    _partition_dim,
    _proc_status,
    _rank,
    _reset_peak_rss,
    _strip_wrappers,
    _tp_group_of,
    _world,
    canonical_entries,
)


@dataclass
class ExportReport:
    """Numbers of one export (``tensors`` .. ``files``: rank 0's writing; memory: this rank's)."""

    tensors: int = 0
    bytes_written: int = 0
    files: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # rank 0: the writer's notes on tensors outside the source's shards
    seconds: float = 0.0
    rss_before: int = 0  # RSS when the export started (bytes)
    peak_rss: int = 0  # peak RSS during the export (VmHWM after a reset; 0 if unknown)
    peak_reset: bool = False
    quantization: dict = field(default_factory=dict)  # rank 0: tensor group -> recipes.hf.quantization.QuantStats

    @property
    def peak_overhead(self) -> int:
        """Peak RSS above the RSS at the start: what the export itself needed on this rank."""
        return max(0, self.peak_rss - self.rss_before)


def _write_hf_tensor(writer: HFCheckpointWriter, fam: _Family, hf_name: str, tensor: torch.Tensor,
                     quantizer) -> tuple[int, Optional[str]]:
    """Queue one HF tensor, in the published precision where ``quantizer`` (an
    :class:`recipes.hf.quantization.ExportQuantizer`) stores it quantized; returns the number of tensors
    written and the error (rank 0 only gets here: the caller makes every rank raise it)."""
    try:
        encoded = quantizer.encode(hf_name, tensor) if quantizer is not None else None
    except ValueError as err:
        return 0, f"{hf_name}: {err}"
    try:
        if encoded is None:
            writer.add(hf_name, tensor, dtype=torch.float32 if fam.keep_fp32(hf_name) else None)
            return 1, None
        for name, part in encoded.items():
            writer.add(name, part, dtype=torch.float32 if part.dtype == torch.float32 else None)
    except OutputError as err:  # a shard could not be written (a full disk): its line, every rank stops
        return 0, str(err)
    return len(encoded), None


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _full_local(entry: Entry) -> tuple[torch.Tensor, Optional[int], int]:
    """The entry's tensor and its TP partition dim/size (None, 1 when not partitioned)."""
    _, tp_size, _ = _tp_group_of(entry)
    return entry.tensor, _partition_dim(entry, tp_size), tp_size


def _gather_tp(entry: Entry) -> torch.Tensor:
    tensor = entry.tensor.detach()
    _, tp_size, group = _tp_group_of(entry)
    dim = _partition_dim(entry, tp_size)
    if dim is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _router_rows_in_original_order(entry: Entry, tensor: torch.Tensor, placement, config) -> torch.Tensor:
    """A placed model's router holds per-expert rows in physical slot order: put them back."""
    if placement is None or ".router." not in entry.local_name or tensor.dim() < 1 or entry.layer_number is None:
        return tensor
    if tensor.shape[0] != config.num_moe_experts or int(entry.layer_number) not in placement.layers:
        return tensor
    expert_to_slot = torch.as_tensor(placement.expert_to_slot(int(entry.layer_number)), device=tensor.device,
                                     dtype=torch.long)
    return tensor[expert_to_slot]


def export_hf_checkpoint(model_chunks, family, out_dir: str, hf_config: dict, dtype: Optional[torch.dtype] = torch.bfloat16,
                         placement=None, *, max_shard_bytes: int = 5 * 2**30, verbose: bool = True,
                         quantizer=None, shard_layout: Optional[dict[str, str]] = None) -> ExportReport:
    """Write the model as a Hugging Face checkpoint under ``out_dir`` (rank 0 writes; collective).

    Tensor-parallel partitions are gathered in their group, every tensor goes from its lowest
    owning rank to rank 0, layer by layer; rank 0 applies the family's ``to_hf`` transforms (fused
    expert tensors stacked in expert order) and writes ``dtype`` shards of at most
    ``max_shard_bytes``, the index and ``hf_config`` as ``config.json`` (tensors the family lists in
    ``KEEP_FP32_HF`` stay float32). With ``placement`` (the CAP placement the model is in), experts
    and router rows are written in the original order. With ``quantizer`` (an
    :class:`recipes.hf.quantization.ExportQuantizer`, used on rank 0) the tensors it names are written in
    the published precision instead. With ``shard_layout`` (the source checkpoint's
    :meth:`HFCheckpoint.weight_map`) each tensor goes into the shard file the source names, not into
    ``max_shard_bytes`` shards (:class:`HFCheckpointWriter`; its notes are printed). Peak memory:
    rank 0 holds one output group (a layer's fused experts at most) and the pending shard(s); the
    report measures it per rank, as the import does."""
    fam = _Family(family)
    chunks = _as_chunks(model_chunks)
    report = ExportReport(rss_before=_proc_status().get("VmRSS", 0))
    report.peak_reset = _reset_peak_rss()
    start = time.perf_counter()
    rank, world = _rank(), _world()
    error = None
    local: dict[str, tuple[Entry, _CompiledRule, dict]] = {}
    config = None
    try:
        for chunk in chunks:
            config = getattr(_strip_wrappers(chunk), "config", config)
            for entry in canonical_entries(chunk, placement):
                found = fam.find(entry.canonical)
                if found is None:
                    if isinstance(entry.tensor, torch.nn.Parameter):
                        raise ConversionError(f"Megatron parameter {entry.canonical} ({entry.local_name}) has no rule in "
                                              f"{fam.module.__name__}.MAPPING")
                    continue
                local[entry.canonical] = (entry, *found)
    except ConversionError as err:
        error = str(err)
    _agree(error)

    # every rank's names and full shapes -> one global order and an owner per name
    meta = {}
    for name, (entry, rule, groups) in local.items():
        tensor, dim, tp_size = _full_local(entry)
        shape = list(tensor.shape)
        if dim is not None:
            shape[dim] *= tp_size
        meta[name] = (tuple(shape), str(tensor.dtype).replace("torch.", ""), rule.index, groups)
    gathered: list = [meta] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(gathered, meta)
    owner: dict[str, int] = {}
    info: dict[str, tuple] = {}
    for r, per_rank in enumerate(gathered):
        for name, value in per_rank.items():
            owner.setdefault(name, r)
            info.setdefault(name, value)

    def order_key(name: str):
        shape, _, rule_index, groups = info[name]
        layer = groups.get("layer", -1)
        return (groups.get("mtp", -1), layer, rule_index, groups.get("expert", -1))

    # output groups: one per (rule, placeholders except expert); fused expert groups need all experts
    units: dict[tuple, list[str]] = {}
    for name in sorted(info, key=order_key):
        _, _, rule_index, groups = info[name]
        key = (rule_index, tuple(sorted((k, v) for k, v in groups.items() if k != "expert")))
        if not fam.rules[rule_index].rule.fused_experts:
            key = key + (name,)
        units.setdefault(key, []).append(name)

    writer = HFCheckpointWriter(out_dir, config=hf_config, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                layout=shard_layout) if rank == 0 else None
    device = _comm_device()
    last_layer = None
    error = None
    with torch.no_grad():
        for key, names in units.items():
            pieces: dict[str, dict[str, torch.Tensor]] = {}
            stacked: dict[str, torch.Tensor] = {}  # fused experts: each expert's row goes straight into place
            for name in names:
                tensor = None
                if name in local:  # TP gather on every holder (collective inside the TP group)
                    entry = local[name][0]
                    tensor = _router_rows_in_original_order(entry, _gather_tp(entry), placement, config)
                src = owner[name]
                if rank == 0:
                    if src != 0:
                        shape, dtype_name, _, _ = info[name]
                        tensor = torch.empty(shape, dtype=getattr(torch, dtype_name), device=device)
                        dist.recv(tensor, src=src)
                    rule = fam.rules[info[name][2]]
                    groups = info[name][3]
                    ctx = Context(config=config, hf_config=hf_config, dtype=tensor.dtype, megatron_name=name,
                                  hf_names=fam.hf_names(rule, groups, hf_config), groups=groups)
                    try:
                        pieces[name] = {k: v.detach().cpu() for k, v in
                                        TRANSFORMS[rule.transform_name].to_hf(tensor, ctx).items()}
                        expert = groups.get("expert", -1)
                        if rule.rule.fused_experts and 0 <= expert < len(names):
                            for hf_name, row in pieces[name].items():
                                stacked.setdefault(hf_name, row.new_empty((len(names), *row.shape)))[expert] = row
                            pieces[name] = dict.fromkeys(pieces[name])  # the names only: no second copy
                    except (ConversionError, ValueError, RuntimeError) as err:
                        error = error or f"{name}: {err}"
                elif rank == src:
                    dist.send(tensor.contiguous().to(device), dst=0)
            if rank == 0 and error is None:
                rule = fam.rules[key[0]]
                if rule.rule.fused_experts:
                    ordered = sorted(names, key=lambda n: info[n][3]["expert"])
                    experts = [info[n][3]["expert"] for n in ordered]
                    if experts != list(range(len(experts))):
                        error = f"{names[0]}: experts {experts} do not cover 0..{len(experts) - 1}"
                    else:
                        for hf_name in pieces[ordered[0]]:
                            written, failure = _write_hf_tensor(writer, fam, hf_name, stacked.pop(hf_name), quantizer)
                            report.tensors, error = report.tensors + written, error or failure
                else:
                    for hf_name, tensor in pieces[names[0]].items():
                        written, failure = _write_hf_tensor(writer, fam, hf_name, tensor, quantizer)
                        report.tensors, error = report.tensors + written, error or failure
                layer = dict(key[1]).get("layer")
                if layer is not None and layer != last_layer:
                    _log(f"layer {layer} exported", verbose)
                    last_layer = layer
    if rank == 0 and error is None:
        try:
            report.files = writer.close()
        except OutputError as err:
            error = str(err)
    if rank == 0 and error is not None:
        writer.discard()  # what --out held before stays as it was
    if rank == 0 and error is None:
        report.notes = writer.notes
        for note in writer.notes:
            _log(f"note: {note}")
        report.bytes_written = writer.total_bytes
        if quantizer is not None:
            report.quantization = dict(quantizer.stats)
    _agree(error)
    if world > 1:
        dist.barrier()
    report.peak_rss = _proc_status().get("VmHWM", 0)
    report.seconds = time.perf_counter() - start
    return report


class _HFTensors:
    """HF tensors held in memory, read the way :class:`Reader` reads an :class:`HFCheckpoint`: a
    fused-expert tensor is already the expert's row (read by the expert's int index), rows of a
    vocabulary-parallel tensor are read by slice."""

    directory = "(quantized in memory)"

    def __init__(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        self.tensors, self.config = tensors, config

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_rows(self, name: str, index) -> torch.Tensor:
        return self.tensors[name] if isinstance(index, int) else self.tensors[name][index]


def quantize_parameters_in_place(model_chunks, family, hf_config: dict, quantizer,
                                 dtype: Optional[torch.dtype] = torch.bfloat16) -> int:
    """Replace every parameter with what the checkpoint :func:`export_hf_checkpoint` writes with
    ``quantizer`` (an :class:`recipes.hf.quantization.ExportQuantizer`) and ``dtype`` loads: through the
    family's ``to_hf``, :meth:`~recipes.hf.quantization.ExportQuantizer.round_trip` (plain tensors: cast
    to ``dtype`` unless kept in float32), and back through ``to_megatron``, so the model then
    computes what the exported checkpoint computes (the export's logit check). Collective inside
    tensor-parallel groups; returns the parameters that hold quantized weights."""
    fam = _Family(family)
    changed = 0
    error = None
    plain_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}  # the tensors read back are plain
    with torch.no_grad():
        for chunk in _as_chunks(model_chunks):
            config = getattr(_strip_wrappers(chunk), "config", None)
            for entry in canonical_entries(chunk):
                found = fam.find(entry.canonical)
                if found is None:
                    continue
                rule, groups = found
                names = fam.hf_names(rule, groups, hf_config)
                full = _gather_tp(entry)
                ctx = Context(config=config, hf_config=hf_config, dtype=full.dtype, megatron_name=entry.canonical,
                              hf_names=names, groups=groups, device=full.device)
                expert = groups.get("expert") if rule.rule.fused_experts else None
                try:
                    tensors = TRANSFORMS[rule.transform_name].to_hf(full, ctx)
                    loaded = {n: quantizer.round_trip(n, t, expert) for n, t in tensors.items()}
                    changed += any(v is not None for v in loaded.values())
                    tensors = {n: loaded[n].to(t.device) if loaded[n] is not None else
                               t if dtype is None or fam.keep_fp32(n) else t.to(dtype) for n, t in tensors.items()}
                    _import_one(entry, config, rule, groups, fam, _HFTensors(tensors, plain_config))
                except (ConversionError, ValueError) as err:
                    error = error or f"{entry.canonical}: {err}"
    _agree(error)
    drop_kept_experts("the weights were replaced by their quantized round trip")  # LLEP's copies are stale now
    return changed
