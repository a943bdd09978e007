"""The conversion engine between Megatron-Core model chunks and Hugging Face checkpoints.

A model family (``recipes/hf/gpt_oss.py``, ``recipes/hf/deepseek_v3.py``) is data: ``MAPPING``, a
list of :class:`Rule` ``(megatron, hf, transform)``. ``megatron`` is a *canonical* Megatron name
pattern, ``hf`` one Hugging Face name pattern or a tuple of them, ``transform`` the name of a
registered :class:`Transform`. Patterns use the placeholders ``{layer}`` (global 0-based decoder
layer), ``{expert}`` (global expert id) and ``{mtp}`` (multi-token-prediction layer); a family may
add its own HF-side placeholders computed from those (``PLACEHOLDERS``, e.g. DeepSeek-V3's MTP layer
``k`` is HF layer ``num_hidden_layers + k``).

Canonical names are a model chunk's parameter names made global: ``decoder.layers.{i}.`` -> the
layer's global index (``layer_number - 1``, so pipeline stages map right); a local expert index ->
the global expert id ``E``: ``...experts.local_experts.{j}.X`` (``SequentialMLP``) ->
``...experts.{E}.X``, and Transformer Engine's ``TEGroupedMLP`` ``...experts.linear_fc1.weight{j}``
-> ``...experts.linear_fc1.weight{E}``. Other Transformer Engine names stay as they are (e.g. the
fused norms ``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``):
the family tables map them, like every other name. ``_extra_state`` is skipped; buffers take part
only where a rule names them (the router's ``expert_bias``).

An expert rule whose HF pattern has no ``{expert}`` reads an HF tensor fused over experts
(``[E, ...]``, gpt-oss): the transform's ``read(name)`` then returns only row ``E`` (read with
:meth:`HFCheckpoint.get_rows`), and on export the per-expert results are stacked in expert order.

Import (:func:`import_hf_checkpoint`) is per rank and streaming: every rank reads only the tensors
of the parameters it holds, expert rows included, and narrows tensor-parallel parameters to its
partition; where a transform is ``row_local`` (the vocabulary-parallel embedding and output layer),
it reads only its partition's rows. Export (:func:`export_hf_checkpoint`) gathers tensor-parallel
partitions inside their group and sends every tensor from one owning rank to rank 0, layer by
layer, which writes bounded safetensors shards, in the published precision with a
:class:`recipes.hf.quant.ExportQuantizer`. Both are collective over the default process group; errors are raised on
every rank alike (:class:`ConversionError`, one line naming the parameter / tensor / field).
"""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from megatron_llep.runtime.state import drop_kept_experts
from megatron_llep.writable import OutputError
from recipes.hf.checkpoint import HFCheckpoint, HFCheckpointError, HFCheckpointWriter

FAMILIES: dict[str, str] = {"gpt-oss": "recipes.hf.gpt_oss", "deepseek-v3": "recipes.hf.deepseek_v3"}

LOG_PREFIX = "[hf]"


class ConversionError(ValueError):
    """A checkpoint that does not fit the model (missing/unused tensors, shapes, config fields)."""


# ---------------------------------------------------------------------------------------------
# rules and transforms
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter pattern <-> one or more HF tensor patterns, through ``transform``."""

    megatron: str
    hf: Union[str, tuple[str, ...]]
    transform: str = "copy"

    @property
    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)

    @property
    def fused_experts(self) -> bool:
        """The HF side holds all experts in one ``[E, ...]`` tensor."""
        return "{expert}" in self.megatron and not any("{expert}" in p for p in self.hf_patterns)


@dataclass
class Context:
    """What a transform may need: the Megatron config, the HF config, the target dtype (and, on
    import, device), the placeholder values of the matched names and the names themselves."""

    config: Any  # TransformerConfig
    hf_config: dict
    dtype: torch.dtype
    megatron_name: str
    hf_names: tuple[str, ...]
    groups: dict[str, int] = field(default_factory=dict)
    device: Optional[torch.device] = None  # the parameter's device on import (dequantize there)

    @property
    def layer(self) -> Optional[int]:
        return self.groups.get("layer")

    @property
    def expert(self) -> Optional[int]:
        return self.groups.get("expert")

    @property
    def mtp(self) -> Optional[int]:
        return self.groups.get("mtp")


class Reader:
    """``read(name)``: an HF tensor as a transform sees it (for a fused-experts rule, only the
    context's expert row; for a row-local transform of a vocabulary-parallel parameter, only this
    rank's rows); ``read.has(name)``; ``read.rows(name, index)`` for explicit row reads."""

    def __init__(self, ckpt: HFCheckpoint, expert_row: Optional[int] = None, missing_hint: str = "",
                 rows: Optional[slice] = None) -> None:
        self.ckpt = ckpt
        self.expert_row = expert_row
        self.rows = rows
        self.missing_hint = missing_hint  # appended to the missing-tensor error

    def __call__(self, name: str) -> torch.Tensor:
        if not self.ckpt.has(name):
            raise ConversionError(f"{self.ckpt.directory}: tensor {name!r} is missing from the checkpoint"
                                  f"{self.missing_hint}")
        if self.expert_row is not None:
            return self.ckpt.get_rows(name, self.expert_row)
        if self.rows is not None:
            return self.ckpt.get_rows(name, self.rows)
        return self.ckpt.get(name)

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def rows(self, name: str, index) -> torch.Tensor:
        return self.ckpt.get_rows(name, index)


class Transform:
    """HF tensors -> one Megatron tensor (full, unpartitioned) and back.

    ``to_megatron(read, names, ctx)``: ``names`` are the rule's HF names formatted for this
    parameter; return the Megatron tensor (any float dtype; the engine casts).
    ``to_hf(tensor, ctx)``: the full Megatron tensor -> ``{hf name: tensor}`` (names from
    ``ctx.hf_names``; for a fused-experts rule, the expert's row without the leading dim).

    ``row_local``: the Megatron tensor's row ``i`` is row ``i`` of its one HF tensor, so a rank
    holding a dim-0 tensor-parallel partition (the vocabulary-parallel embedding and output layer)
    reads only its own rows."""

    row_local = False

    def to_megatron(self, read: Reader, names: tuple[str, ...], ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, tensor: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
        raise NotImplementedError


TRANSFORMS: dict[str, Transform] = {}


def register_transform(name: str, transform: Transform) -> Transform:
    """Register ``transform`` under ``name`` (re-registering the same name replaces it)."""
    if not isinstance(transform, Transform):
        raise TypeError(f"register_transform({name!r}, ...) needs a Transform, got {type(transform).__name__}")
    TRANSFORMS[name] = transform
    return transform


class Copy(Transform):
    """One HF tensor, same layout."""

    row_local = True

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return read(name)

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        return {name: tensor}


class QKV(Transform):
    """HF ``q_proj``/``k_proj``/``v_proj`` (weights or biases) <-> Megatron's fused ``linear_qkv``,
    interleaved per query group: for each group, its ``heads/groups`` query heads, then its key
    head, then its value head (``kv_channels`` rows each)."""

    @staticmethod
    def _sizes(config) -> tuple[int, int, int]:
        groups = config.num_query_groups or config.num_attention_heads
        return groups, config.num_attention_heads // groups, config.kv_channels

    def to_megatron(self, read, names, ctx):
        q, k, v = (read(n) for n in names)
        groups, per_group, head = self._sizes(ctx.config)
        rest = q.shape[1:]
        qkv = torch.cat([q.reshape(groups, per_group * head, *rest), k.reshape(groups, head, *rest),
                         v.reshape(groups, head, *rest)], dim=1)
        return qkv.reshape(groups * (per_group + 2) * head, *rest)

    def to_hf(self, tensor, ctx):
        groups, per_group, head = self._sizes(ctx.config)
        rest = tensor.shape[1:]
        grouped = tensor.reshape(groups, (per_group + 2) * head, *rest)
        q, k, v = torch.split(grouped, [per_group * head, head, head], dim=1)
        qn, kn, vn = ctx.hf_names
        return {qn: q.reshape(-1, *rest), kn: k.reshape(-1, *rest), vn: v.reshape(-1, *rest)}


register_transform("copy", Copy())
register_transform("qkv", QKV())


# ---------------------------------------------------------------------------------------------
# families
# ---------------------------------------------------------------------------------------------


def architectures_problem(hf_config: dict, expected: str) -> Optional[str]:
    """What is wrong with config.json's ``architectures`` for a family converting ``expected`` (a
    transformers class name; None: nothing). A config.json without the field is taken by its
    ``model_type`` alone."""
    architectures = hf_config.get("architectures")
    if architectures is None or architectures == [expected]:
        return None
    return (f"architectures = {architectures!r}, expected [{expected!r}] (the model class these recipes convert; "
            "another head or base model has other tensors)")


def family_key(name: str) -> str:
    """``"gpt-oss-20b"`` -> ``"gpt-oss"``: the FAMILIES key a recipe name starts with."""
    for key in sorted(FAMILIES, key=len, reverse=True):
        if name == key or name.startswith(key + "-"):
            return key
    raise ConversionError(f"no Hugging Face conversion for {name!r} (families: {', '.join(sorted(FAMILIES))})")


def family_module(family: Union[str, ModuleType]) -> ModuleType:
    """The family module for a family name, a recipe name or the module itself."""
    if isinstance(family, ModuleType):
        return family
    return importlib.import_module(FAMILIES[family_key(family)])


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class _CompiledRule:
    def __init__(self, rule: Rule, index: int) -> None:
        self.rule = rule
        self.index = index
        self.transform_name = rule.transform
        pattern, pos = "", 0
        for m in _PLACEHOLDER.finditer(rule.megatron):
            pattern += re.escape(rule.megatron[pos:m.start()]) + f"(?P<{m.group(1)}>\\d+)"
            pos = m.end()
        self.regex = re.compile(pattern + re.escape(rule.megatron[pos:]) + "$")

    def match(self, name: str) -> Optional[dict[str, int]]:
        m = self.regex.match(name)
        return None if m is None else {k: int(v) for k, v in m.groupdict().items()}


class _Family:
    """A family module's table, compiled."""

    def __init__(self, family: Union[str, ModuleType]) -> None:
        self.module = family_module(family)
        self.rules = [_CompiledRule(rule, i) for i, rule in enumerate(self.module.MAPPING)]
        for rule in self.rules:
            if rule.transform_name not in TRANSFORMS:
                raise ConversionError(f"{self.module.__name__}: rule {rule.rule.megatron!r} names unregistered "
                                      f"transform {rule.transform_name!r}")
        self.placeholders: dict[str, Callable[[dict, dict], Any]] = dict(getattr(self.module, "PLACEHOLDERS", {}))
        self.ignore_hf = [re.compile(p) for p in getattr(self.module, "IGNORE_HF", ())]
        self.keep_fp32_hf = [re.compile(p) for p in getattr(self.module, "KEEP_FP32_HF", ())]

    def add_ignorable(self, hf_config: dict, config) -> None:
        """The family's ``ignore_hf(hf_config, config)`` patterns (model-dependent), if it has one."""
        fn = getattr(self.module, "ignore_hf", None)
        if fn is not None:
            self.ignore_hf += [re.compile(p) for p in fn(hf_config, config)]

    def keep_fp32(self, hf_name: str) -> bool:
        return any(p.search(hf_name) for p in self.keep_fp32_hf)

    def find(self, canonical: str) -> Optional[tuple[_CompiledRule, dict[str, int]]]:
        for rule in self.rules:
            groups = rule.match(canonical)
            if groups is not None:
                return rule, groups
        return None

    def hf_names(self, rule: _CompiledRule, groups: dict[str, int], hf_config: dict) -> tuple[str, ...]:
        values: dict[str, Any] = dict(groups)
        for key, fn in self.placeholders.items():
            if any("{" + key + "}" in p for p in rule.rule.hf_patterns):
                values[key] = fn(groups, hf_config)
        return tuple(p.format(**values) for p in rule.rule.hf_patterns)

    def ignorable(self, hf_name: str) -> bool:
        return any(p.search(hf_name) for p in self.ignore_hf)


# ---------------------------------------------------------------------------------------------
# canonical Megatron names
# ---------------------------------------------------------------------------------------------

_DECODER_LAYER = re.compile(r"^(?P<pre>(?:.*\.)?decoder\.layers)\.(?P<i>\d+)\.(?P<rest>.+)$")
_LOCAL_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.local_experts\.(?P<j>\d+)\.(?P<rest>.+)$")
_TE_GROUPED_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)(?P<j>\d+)$")
# parameters split across tensor-parallel ranks without Megatron's ``tensor_model_parallel`` mark
_UNMARKED_TP_DIM0 = ("core_attention.softmax_offset",)


@dataclass
class Entry:
    """One local parameter (or buffer) under its canonical name."""

    canonical: str
    local_name: str
    tensor: torch.Tensor
    is_expert: bool
    layer_number: Optional[int] = None  # Megatron's 1-based layer number of the MoE layer (placements)
    slot: Optional[int] = None  # physical global expert slot


def _strip_wrappers(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def canonical_entries(chunk: torch.nn.Module, placement=None) -> list[Entry]:
    """Every parameter of a model chunk (DDP/Float16Module wrappers removed) and every buffer
    named ``expert_bias``, under canonical names. With ``placement`` (a CAP placement applied to
    the model), expert ids are the original ones: slot ``s`` holds
    ``placement.slot_to_expert(layer_number)[s]``."""
    chunk = _strip_wrappers(chunk)
    items = [(n, p) for n, p in chunk.named_parameters()]
    items += [(n, b) for n, b in chunk.named_buffers() if n.rsplit(".", 1)[-1] == "expert_bias"]
    entries = []
    for name, tensor in items:
        if name.endswith("_extra_state"):
            continue
        entries.append(_canonical(chunk, name, tensor, placement))
    return entries


def _canonical(chunk: torch.nn.Module, name: str, tensor: torch.Tensor, placement) -> Entry:
    canonical = name
    m = _DECODER_LAYER.match(name)
    if m:
        layer = chunk.get_submodule(f"{m['pre']}.{m['i']}")
        number = getattr(layer, "layer_number", None)
        if number is None:
            raise ConversionError(f"{name}: its transformer layer has no layer_number")
        canonical = f"{m['pre']}.{int(number) - 1}.{m['rest']}"
    slot = layer_number = None
    expert_match = _LOCAL_EXPERT.match(name) or _TE_GROUPED_EXPERT.match(name)
    if expert_match:
        pre = expert_match["pre"]
        moe_layer = chunk.get_submodule(pre[: -len(".experts")])
        indices = getattr(moe_layer, "local_expert_indices", None)
        if indices is None:
            raise ConversionError(f"{name}: its MoE layer has no local_expert_indices")
        slot = int(indices[int(expert_match["j"])])
        layer_number = getattr(moe_layer, "layer_number", None)
        expert = slot
        if placement is not None:
            expert = int(placement.slot_to_expert(int(layer_number))[slot])
        canon_pre = _canonical_prefix(chunk, pre)
        if "rest" in expert_match.groupdict():
            canonical = f"{canon_pre}.{expert}.{expert_match['rest']}"
        else:  # TEGroupedMLP: the global id in place of the local one
            canonical = f"{canon_pre}.{expert_match['fc']}.{expert_match['kind']}{expert}"
    elif ".router." in name:  # its per-expert rows follow a placement too
        layer_number = getattr(chunk.get_submodule(name.rsplit(".router.", 1)[0]), "layer_number", None)
    return Entry(canonical, name, tensor, is_expert=expert_match is not None, layer_number=layer_number, slot=slot)


def _canonical_prefix(chunk: torch.nn.Module, pre: str) -> str:
    m = _DECODER_LAYER.match(pre + ".x")
    if not m:
        return pre
    number = chunk.get_submodule(f"{m['pre']}.{m['i']}").layer_number
    return f"{m['pre']}.{int(number) - 1}.{m['rest'][:-2]}"


def canonical_name(chunk: torch.nn.Module, name: str, placement=None) -> str:
    """The canonical name of parameter ``name`` of ``chunk``."""
    chunk = _strip_wrappers(chunk)
    tensor = dict(chunk.named_parameters()).get(name)
    if tensor is None:
        tensor = dict(chunk.named_buffers())[name]
    return _canonical(chunk, name, tensor, placement).canonical


# ---------------------------------------------------------------------------------------------
# tensor parallelism
# ---------------------------------------------------------------------------------------------


def _tp_group_of(entry: Entry):
    """(rank, size, group) of the tensor-parallel group that splits this parameter."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1, None
    if entry.is_expert:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def _partition_dim(entry: Entry, tp_size: int) -> Optional[int]:
    if tp_size == 1:
        return None
    if getattr(entry.tensor, "tensor_model_parallel", False):
        return int(entry.tensor.partition_dim)
    if any(entry.canonical.endswith(s) for s in _UNMARKED_TP_DIM0):  # the heads dim
        return next((d for d, n in enumerate(entry.tensor.shape) if n > 1), 0)
    return None


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------


def _proc_status() -> dict[str, int]:
    values = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where it is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _log(message: str, verbose: bool = True) -> None:
    if verbose and _rank() == 0:
        print(f"{LOG_PREFIX} {message}", flush=True)


def _agree(error: Optional[str]) -> None:
    """Raise ConversionError on every rank if any rank failed (the first failing rank's message)."""
    if _world() == 1:
        if error:
            raise ConversionError(error)
        return
    errors: list = [None] * _world()
    dist.all_gather_object(errors, error)
    for message in errors:
        if message:
            raise ConversionError(message)


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------


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


def _as_chunks(model_chunks) -> list[torch.nn.Module]:
    return [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)


def _layer_of(canonical: str) -> Optional[int]:
    m = _DECODER_LAYER.match(canonical)
    return int(m["i"]) if m else None


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


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


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
    quantization: dict = field(default_factory=dict)  # rank 0: tensor group -> recipes.hf.quant.QuantStats

    @property
    def peak_overhead(self) -> int:
        """Peak RSS above the RSS at the start: what the export itself needed on this rank."""
        return max(0, self.peak_rss - self.rss_before)


def _write_hf_tensor(writer: HFCheckpointWriter, fam: _Family, hf_name: str, tensor: torch.Tensor,
                     quantizer) -> tuple[int, Optional[str]]:
    """Queue one HF tensor, in the published precision where ``quantizer`` (an
    :class:`recipes.hf.quant.ExportQuantizer`) stores it quantized; returns the number of tensors
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
    :class:`recipes.hf.quant.ExportQuantizer`, used on rank 0) the tensors it names are written in
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
    ``quantizer`` (an :class:`recipes.hf.quant.ExportQuantizer`) and ``dtype`` loads: through the
    family's ``to_hf``, :meth:`~recipes.hf.quant.ExportQuantizer.round_trip` (plain tensors: cast
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

