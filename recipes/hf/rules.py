"""The rules of the conversion between Megatron-Core model chunks and Hugging Face checkpoints, which
:mod:`recipes.hf.importing` and :mod:`recipes.hf.exporting` apply.

A model family (``recipes/hf/tables/gpt_oss.py``, ``recipes/hf/tables/deepseek_v3.py``) is data: ``MAPPING``, a
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

Import (:func:`recipes.hf.importing.import_hf_checkpoint`) is per rank and streaming: every rank reads only the tensors
of the parameters it holds, expert rows included, and narrows tensor-parallel parameters to its
partition; where a transform is ``row_local`` (the vocabulary-parallel embedding and output layer),
it reads only its partition's rows. Export (:func:`recipes.hf.exporting.export_hf_checkpoint`) gathers tensor-parallel
partitions inside their group and sends every tensor from one owning rank to rank 0, layer by
layer, which writes bounded safetensors shards, in the published precision with a
:class:`recipes.hf.quantization.ExportQuantizer`. Both are collective over the default process group; errors are raised on
every rank alike (:class:`ConversionError`, one line naming the parameter / tensor / field).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from recipes.hf.checkpoint import HFCheckpoint

FAMILIES: dict[str, str] = {"gpt-oss": "recipes.hf.tables.gpt_oss", "deepseek-v3": "recipes.hf.tables.deepseek_v3"}

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


def _as_chunks(model_chunks) -> list[torch.nn.Module]:
    return [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)


def _layer_of(canonical: str) -> Optional[int]:
    m = _DECODER_LAYER.match(canonical)
    return int(m["i"]) if m else None


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
