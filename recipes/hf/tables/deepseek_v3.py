"""DeepSeek-V3 <-> Megatron-Core: the conversion table, its transforms and the config translation.

Hugging Face layout (the released ``deepseek-ai/DeepSeek-V3`` and transformers'
``DeepseekV3ForCausalLM``) -> Megatron-Core (``recipes/models/__init__.py`` ``deepseek_v3``):

* MLA: ``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``, ``q_b_proj`` ->
  ``linear_q_up_proj`` (``q_proj`` -> ``linear_q_proj`` without a query LoRA), ``kv_a_proj_with_mqa``
  -> ``linear_kv_down_proj``, ``kv_a_layernorm`` -> ``kv_layernorm``, ``kv_b_proj`` ->
  ``linear_kv_up_proj``, ``o_proj`` -> ``linear_proj``. Both sides lay rows out alike (per head
  ``[nope, rope]`` for queries, ``[kv_lora, rope]`` for the compressed key/value, per head
  ``[k_nope, v]`` for its up-projection), and both read the rope dimensions as interleaved pairs
  (Megatron's MLA de-interleaves them, transformers' ``rope_interleave``); a checkpoint with
  ``"rope_interleave": false`` has its rope rows permuted on the way in and back on the way out.
  With Transformer Engine the two latent norms are fused into the up-projections
  (``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``).
* MLPs: ``gate_proj``/``up_proj`` stacked -> ``linear_fc1``, ``down_proj`` -> ``linear_fc2``, for the
  first ``first_k_dense_replace`` dense layers, every routed expert and the shared experts
  (``n_shared_experts`` of them fused into one of width ``n_shared_experts * moe_intermediate_size``).
* Router: ``mlp.gate.weight`` -> ``router.weight``, ``mlp.gate.e_score_correction_bias`` -> the
  router's ``expert_bias`` buffer (used for selection only, as in DeepSeek-V3).
* MTP layer ``k``: HF layer ``num_hidden_layers + k`` (61 in the release): ``enorm``, ``hnorm``,
  ``eh_proj``, its transformer layer (Megatron's ``transformer_layer``, ``mtp_model_layer`` from
  0.17), ``shared_head.norm`` -> the MTP ``final_layernorm``. Its
  ``embed_tokens`` and ``shared_head.head`` are copies of the main embedding and output layer
  (shared in Megatron): ignored on import, written again on export.
* FP8: a weight stored as float8 e4m3 with a ``weight_scale_inv`` beside it (the release: 128 x 128
  blocks, ``quantization_config.weight_block_size``) is dequantized on import
  (``recipes.hf.quantization.dequantize_fp8_blockwise``); export writes them back as FP8 (``QUANTIZED_HF``)
  when the source checkpoint was quantized, plain bf16 on request.

:func:`recipe_from_hf_config` builds the Megatron recipe from a ``config.json`` and
:func:`hf_config_from_recipe` writes one for a recipe. Everything Megatron-Core cannot reproduce
exactly (e.g. group scoring other than DeepSeek-V3's top-2, see
``recipes.models.check_deepseek_group_routing``) is refused with one error naming the fields.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from recipes.hf.rules import architectures_problem, Context, ConversionError, Reader, register_transform, Rule, Transform

# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------

# (Megatron name under a transformer layer, HF name(s) under ``model.layers.N.``, transform)
_LAYER_RULES: list[tuple[str, Any, str]] = [
    ("input_layernorm.weight", "input_layernorm.weight", "copy"),
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", "deepseek_linear"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight", "copy"),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attn.q_a_layernorm.weight", "copy"),  # TE
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", "deepseek_q_up"),
    ("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight", "deepseek_q_up"),  # q_lora_rank None
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "deepseek_kv_down"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight", "copy"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attn.kv_a_layernorm.weight", "copy"),  # TE
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", "deepseek_linear"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "deepseek_linear"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", "copy"),
    # dense MLP (the first first_k_dense_replace layers)
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "deepseek_gate_up"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight", "copy"),  # TE: fused into fc1
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", "deepseek_linear"),
    # MoE
    ("mlp.router.weight", "mlp.gate.weight", "copy"),
    ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", "copy"),
    ("mlp.experts.{expert}.linear_fc1.weight",
     ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"), "deepseek_gate_up"),
    ("mlp.experts.{expert}.linear_fc2.weight", "mlp.experts.{expert}.down_proj.weight", "deepseek_linear"),
    # the same under Transformer Engine's TEGroupedMLP names
    ("mlp.experts.linear_fc1.weight{expert}",
     ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"), "deepseek_gate_up"),
    ("mlp.experts.linear_fc2.weight{expert}", "mlp.experts.{expert}.down_proj.weight", "deepseek_linear"),
    ("mlp.shared_experts.linear_fc1.weight",
     ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "deepseek_gate_up"),
    ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight", "deepseek_linear"),
]


def _layer_rules(megatron_prefix: str, hf_prefix: str) -> list[Rule]:
    rules = []
    for megatron, hf, transform in _LAYER_RULES:
        hf_names = tuple(f"{hf_prefix}.{h}" for h in hf) if isinstance(hf, tuple) else f"{hf_prefix}.{hf}"
        rules.append(Rule(f"{megatron_prefix}.{megatron}", hf_names, transform))
    return rules


MAPPING: list[Rule] = [
    Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", "deepseek_embedding"),
    Rule("output_layer.weight", "lm_head.weight", "deepseek_output_layer"),
    Rule("decoder.final_layernorm.weight", "model.norm.weight", "copy"),
    *_layer_rules("decoder.layers.{layer}", "model.layers.{layer}"),
    # multi-token prediction: Megatron's MTP layer k is HF layer num_hidden_layers + k
    Rule("mtp.layers.{mtp}.enorm.weight", "model.layers.{mtp_layer}.enorm.weight", "copy"),
    Rule("mtp.layers.{mtp}.hnorm.weight", "model.layers.{mtp_layer}.hnorm.weight", "copy"),
    Rule("mtp.layers.{mtp}.eh_proj.weight", "model.layers.{mtp_layer}.eh_proj.weight", "deepseek_linear"),
    Rule("mtp.layers.{mtp}.final_layernorm.weight", "model.layers.{mtp_layer}.shared_head.norm.weight", "copy"),
    *_layer_rules("mtp.layers.{mtp}.transformer_layer", "model.layers.{mtp_layer}"),  # Megatron-Core 0.16
    *_layer_rules("mtp.layers.{mtp}.mtp_model_layer", "model.layers.{mtp_layer}"),  # 0.17+
]

PLACEHOLDERS = {"mtp_layer": lambda groups, hf_config: int(hf_config["num_hidden_layers"]) + groups["mtp"]}

# HF tensors no Megatron parameter reads: the MTP layers' copies of the embedding and output layer
IGNORE_HF = (r"^model\.layers\.\d+\.embed_tokens\.weight$", r"^model\.layers\.\d+\.shared_head\.head\.weight$",
             r"\.rotary_emb\.inv_freq$")

# the release's precision, for export (recipes.hf.quantization.ExportQuantizer): (HF name regex, format,
# error-report group). Every linear weight of a layer (attention, dense MLP, experts, shared
# experts, the MTP layer's eh_proj) is e4m3 in blocks of quantization_config.weight_block_size with
# a float32 ``weight_scale_inv``; embeddings, norms, the router and lm_head stay bf16/fp32.
QUANTIZED_HF: tuple[tuple[str, str, str], ...] = (
    (r"\.self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$", "fp8_block",
     "attention"),
    (r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$", "fp8_block", "dense mlp"),
    (r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", "fp8_block", "routed experts"),
    (r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$", "fp8_block", "shared experts"),
    (r"\.eh_proj\.weight$", "fp8_block", "mtp eh_proj"),
)

# HF tensors the release keeps in float32 whatever the checkpoint dtype (transformers'
# _keep_in_fp32_modules_strict): the selection bias must not be rounded to bf16 on export
KEEP_FP32_HF = (r"\.mlp\.gate\.e_score_correction_bias$",)


def ignore_hf(hf_config: dict, config) -> list[str]:
    """HF names to ignore for this model: every MTP layer of the checkpoint the model does not
    have (built with ``drop_mtp``, or fewer MTP layers than ``num_nextn_predict_layers``)."""
    first = int(hf_config.get("num_hidden_layers", 0))
    have = int(getattr(config, "mtp_num_layers", None) or 0) if config is not None else 0
    wanted = int(hf_config.get("num_nextn_predict_layers") or 0)
    return [rf"^model\.layers\.{first + k}\." for k in range(have, wanted)]

# ---------------------------------------------------------------------------------------------
# transforms
# ---------------------------------------------------------------------------------------------

SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's FP8 weights: "<name>.weight" + "<name>.weight_scale_inv"


def _block_size(hf_config: dict) -> tuple[int, int]:
    quant = hf_config.get("quantization_config") or {}
    block = quant.get("weight_block_size") or (128, 128)
    if len(block) != 2:
        raise ConversionError(f"quantization_config.weight_block_size = {block}: expected two sizes")
    return int(block[0]), int(block[1])


def read_weight(read: Reader, name: str, ctx: Context) -> torch.Tensor:
    """``name`` from the checkpoint; an FP8 weight with ``<name>_scale_inv`` beside it comes back
    dequantized (to ``ctx.dtype``, or float32)."""
    weight = read(name)
    scale_name = name + SCALE_SUFFIX
    if read.has(scale_name):
        from recipes.hf.quantization import dequantize_fp8_blockwise

        dtype = ctx.dtype if ctx.dtype is not None and ctx.dtype.is_floating_point else torch.float32
        try:
            return dequantize_fp8_blockwise(weight, read(scale_name), block_size=_block_size(ctx.hf_config), dtype=dtype)
        except (ValueError, RuntimeError) as err:
            raise ConversionError(f"{name} (+ {scale_name}): {err}") from None
    if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ConversionError(f"{name} is {weight.dtype} but the checkpoint has no {scale_name} to dequantize it")
    return weight


def _rope_interleaved(hf_config: dict) -> bool:
    return bool(hf_config.get("rope_interleave", True))


def _rope_rows(rows: int, rope: int, period: int, to_megatron: bool) -> torch.Tensor:
    """Row order turning transformers' non-interleaved rope dims (pairs ``j, j + rope/2``) into
    DeepSeek's interleaved ones (pairs ``2j, 2j + 1``, what Megatron's MLA reads), or back: within
    each ``period`` of rows, the last ``rope`` rows are permuted."""
    half = rope // 2
    interleave = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # meg[i] = hf[p[i]]
    perm = interleave if to_megatron else torch.argsort(interleave)
    index = torch.arange(rows).reshape(-1, period)
    index[:, period - rope:] = index[:, period - rope:][:, perm]
    return index.reshape(-1)


class DeepSeekLinear(Transform):
    """One weight, same layout; FP8 + ``weight_scale_inv`` dequantized."""

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return read_weight(read, name, ctx)

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        return {name: tensor}


def _glu_tp_size(ctx: Context) -> int:
    """Tensor-parallel size splitting a gated ``linear_fc1``: expert TP for routed experts, TP else."""
    if ctx.config is None:
        return 1
    key = "expert_tensor_parallel_size" if ctx.expert is not None else "tensor_model_parallel_size"
    return int(getattr(ctx.config, key, None) or 1)


class DeepSeekGateUp(Transform):
    """``gate_proj`` and ``up_proj`` stacked into Megatron's gated ``linear_fc1`` ([gate; up]).
    Under tensor parallelism each rank holds ``[gate_r; up_r]`` (Megatron chunks its local fc1
    output in two), so the full tensor is laid out rank block by rank block and the engine's
    contiguous TP narrowing hands every rank its pair; export gathers the same order back."""

    def to_megatron(self, read, names, ctx):
        gate, up = (read_weight(read, n, ctx) for n in names)
        if gate.shape != up.shape:
            raise ConversionError(f"{names[0]} {tuple(gate.shape)} and {names[1]} {tuple(up.shape)} differ in shape")
        tp = _glu_tp_size(ctx)
        if gate.shape[0] % tp:
            raise ConversionError(f"{names[0]}: {gate.shape[0]} rows are not divisible by tensor-parallel size {tp}")
        return torch.cat([t for pair in zip(gate.chunk(tp), up.chunk(tp)) for t in pair], dim=0)

    def to_hf(self, tensor, ctx):
        blocks = tensor.chunk(2 * _glu_tp_size(ctx), dim=0)
        gate, up = torch.cat(blocks[0::2], dim=0), torch.cat(blocks[1::2], dim=0)
        return dict(zip(ctx.hf_names, (gate, up)))


class _RopeRowsReordered(Transform):
    """A projection whose output rows hold rope dimensions, re-ordered for a checkpoint with
    ``rope_interleave: false`` (identity otherwise). ``_period`` gives the rows of one head."""

    def _period(self, rows: int, hf: dict) -> int:
        raise NotImplementedError

    def _index(self, rows: int, ctx: Context, to_megatron: bool) -> Optional[torch.Tensor]:
        if _rope_interleaved(ctx.hf_config):
            return None
        return _rope_rows(rows, int(ctx.hf_config["qk_rope_head_dim"]), self._period(rows, ctx.hf_config), to_megatron)

    def to_megatron(self, read, names, ctx):
        (name,) = names
        weight = read_weight(read, name, ctx)
        index = self._index(weight.shape[0], ctx, True)
        return weight if index is None else weight[index]

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        index = self._index(tensor.shape[0], ctx, False)
        return {name: tensor if index is None else tensor[index]}


class DeepSeekQueryUp(_RopeRowsReordered):
    """``q_b_proj`` (or ``q_proj``): rows per head ``[qk_nope_head_dim, qk_rope_head_dim]`` on both sides."""

    def _period(self, rows: int, hf: dict) -> int:
        return int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])


class DeepSeekKVDown(_RopeRowsReordered):
    """``kv_a_proj_with_mqa``: rows ``[kv_lora_rank, qk_rope_head_dim]`` on both sides."""

    def _period(self, rows: int, hf: dict) -> int:
        return rows


def _mtp_layers(ctx: Context) -> int:
    config_layers = getattr(ctx.config, "mtp_num_layers", None) if ctx.config is not None else None
    return int(config_layers or 0)


class SharedWithMTP(Transform):
    """The embedding / output layer: one HF tensor on import; on export also the copies each MTP
    layer of the release carries (``model.layers.{N+k}.embed_tokens`` / ``.shared_head.head``)."""

    row_local = True

    def __init__(self, mtp_suffix: str) -> None:
        self.mtp_suffix = mtp_suffix

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return read(name)

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        out = {name: tensor}
        first = int(ctx.hf_config["num_hidden_layers"])
        for k in range(_mtp_layers(ctx)):
            out[f"model.layers.{first + k}.{self.mtp_suffix}"] = tensor
        return out


register_transform("deepseek_linear", DeepSeekLinear())
register_transform("deepseek_gate_up", DeepSeekGateUp())
register_transform("deepseek_q_up", DeepSeekQueryUp())
register_transform("deepseek_kv_down", DeepSeekKVDown())
register_transform("deepseek_embedding", SharedWithMTP("embed_tokens.weight"))
register_transform("deepseek_output_layer", SharedWithMTP("shared_head.head.weight"))

# ---------------------------------------------------------------------------------------------
# config.json <-> recipe
# ---------------------------------------------------------------------------------------------

LAYOUT_KEYS = ("ep_size", "tp_size", "pp_size", "dtype", "cpu")
FIXED_SIZES = ("671b",)  # variants whose sizes config.json must match
FIXED_SIZE_RECIPES = ("deepseek-v3", "deepseek-v3-671b")  # (recipes/finetune.py: deepseek-v3-tiny takes config.json's)


class _RopeSource(dict):
    """HF field name of each rope parameter (for messages)."""

    def __init__(self, prefix: str, theta_top_level: bool) -> None:
        super().__init__()
        self.prefix, self.theta_top_level = prefix, theta_top_level

    def __missing__(self, key: str) -> str:
        if key == "rope_theta" and self.theta_top_level:
            return "rope_theta"
        return f"{self.prefix}.{key}"


def _rope(hf: dict) -> tuple[dict, _RopeSource]:
    """(rope parameters, the HF field of each) in either transformers form: legacy ``rope_theta`` +
    ``rope_scaling`` (the release) or ``rope_parameters`` (transformers 5)."""
    params = dict(hf.get("rope_parameters") or {})
    prefix = "rope_parameters"
    if not params or hf.get("rope_scaling"):
        params = dict(hf.get("rope_scaling") or {})
        prefix = "rope_scaling"
    source = _RopeSource(prefix, "rope_theta" not in params and "rope_theta" in hf)
    if "rope_theta" not in params:
        params["rope_theta"] = hf.get("rope_theta", 10000.0)
    if "type" in params and "rope_type" not in params:
        source["rope_type"] = f"{prefix}.type"
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params, source


def _translate(hf: dict) -> tuple[dict, dict, dict[str, str], list[str]]:
    """config.json -> (sizes, architecture, Megatron key -> HF field, problems)."""
    problems: list[str] = []
    source: dict[str, str] = {}

    def get(key: str, default: Any = KeyError) -> Any:
        if key in hf and hf[key] is not None:
            return hf[key]
        if default is KeyError:
            problems.append(f"{key} is missing")
            return None
        return default

    def put(target: dict, megatron: str, hf_key: str, value: Any) -> None:
        target[megatron] = value
        source[megatron] = hf_key

    sizes: dict = {}
    arch: dict = {}
    layers = get("num_hidden_layers")
    put(sizes, "num_layers", "num_hidden_layers", layers)
    put(sizes, "dense_layers", "first_k_dense_replace", get("first_k_dense_replace", 0))
    put(sizes, "hidden_size", "hidden_size", get("hidden_size"))
    put(sizes, "ffn_hidden_size", "intermediate_size", get("intermediate_size"))
    moe_ffn = get("moe_intermediate_size")
    put(sizes, "moe_ffn_hidden_size", "moe_intermediate_size", moe_ffn)
    put(sizes, "num_moe_experts", "n_routed_experts", get("n_routed_experts"))
    shared = get("n_shared_experts", 0)
    put(sizes, "moe_shared_expert_intermediate_size", "n_shared_experts",
        shared * moe_ffn if shared and moe_ffn else None)
    heads = get("num_attention_heads")
    put(sizes, "num_attention_heads", "num_attention_heads", heads)
    put(sizes, "q_lora_rank", "q_lora_rank", get("q_lora_rank", None))
    put(sizes, "kv_lora_rank", "kv_lora_rank", get("kv_lora_rank"))
    put(sizes, "qk_head_dim", "qk_nope_head_dim", get("qk_nope_head_dim"))
    put(sizes, "qk_pos_emb_head_dim", "qk_rope_head_dim", get("qk_rope_head_dim"))
    put(sizes, "v_head_dim", "v_head_dim", get("v_head_dim"))
    put(sizes, "moe_router_num_groups", "n_group", get("n_group", None))
    put(sizes, "moe_router_group_topk", "topk_group", get("topk_group", None))
    put(sizes, "moe_router_topk", "num_experts_per_tok", get("num_experts_per_tok"))
    put(sizes, "vocab_size", "vocab_size", get("vocab_size"))
    put(sizes, "max_sequence_length", "max_position_embeddings", get("max_position_embeddings"))

    put(arch, "layernorm_epsilon", "rms_norm_eps", get("rms_norm_eps", 1e-6))
    put(arch, "moe_router_topk_scaling_factor", "routed_scaling_factor", get("routed_scaling_factor", 1.0))
    put(arch, "mtp_num_layers", "num_nextn_predict_layers", get("num_nextn_predict_layers", 0))

    rope, rope_source = _rope(hf)
    put(arch, "rotary_base", rope_source["rope_theta"], rope["rope_theta"])
    if rope["rope_type"] == "yarn":
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings")
        if original is None:
            problems.append(f"{rope_source['rope_type']} = yarn without original_max_position_embeddings")
        if factor is None and original:
            factor = (hf.get("max_position_embeddings") or 0) / original  # transformers' implicit factor
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            pair = (float(mscale), float(mscale_all_dim))
        elif not mscale_all_dim:
            pair = (1.0, 0.0)  # transformers then scales by get_mscale(factor) alone, as Megatron does with these
        else:
            problems.append(f"{rope_source['mscale_all_dim']} = {mscale_all_dim} without mscale: transformers' "
                            "YaRN scaling then has no Megatron-Core equivalent")
            pair = (1.0, float(mscale_all_dim))
        put(arch, "rope_type", rope_source["rope_type"], "yarn")
        put(arch, "rotary_scaling_factor", rope_source["factor"], factor)
        put(arch, "original_max_position_embeddings", rope_source["original_max_position_embeddings"],
            original)
        put(arch, "beta_fast", rope_source["beta_fast"], rope.get("beta_fast") or 32)
        put(arch, "beta_slow", rope_source["beta_slow"], rope.get("beta_slow") or 1)
        put(arch, "mscale", rope_source["mscale"], pair[0])
        put(arch, "mscale_all_dim", rope_source["mscale_all_dim"], pair[1])
        if rope.get("attention_factor") is not None:
            problems.append(f"{rope_source['attention_factor']} = {rope['attention_factor']}: an explicit YaRN "
                            "attention factor has no Megatron-Core field")
        if rope.get("truncate") is False:
            problems.append(f"{rope_source['truncate']} = false: Megatron-Core's MLA YaRN always rounds the "
                            "correction range")
    elif rope["rope_type"] == "default":
        put(arch, "rope_type", rope_source["rope_type"], "rope")
        # MLA's softmax scale reads the YaRN factor even for plain rope: 1 makes it 1/sqrt(d)
        put(arch, "rotary_scaling_factor", rope_source["rope_type"], 1.0)
    else:
        problems.append(f"{rope_source['rope_type']} = {rope['rope_type']!r}: only yarn and default rope map to "
                        "Megatron-Core's MLA")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"{rope_source['partial_rotary_factor']} = {rope['partial_rotary_factor']} is not supported")

    # what Megatron-Core's DeepSeek-V3 cannot express
    fixed = dict(hidden_act="silu", attention_bias=False, tie_word_embeddings=False, scoring_func="sigmoid",
                 topk_method="noaux_tc", moe_layer_freq=1)
    for key, value in fixed.items():
        if key in hf and hf[key] is not None and hf[key] != value:
            problems.append(f"{key} = {hf[key]!r} (only {value!r} is supported)")
    if heads is not None and hf.get("num_key_value_heads") not in (None, heads):
        problems.append(f"num_key_value_heads = {hf['num_key_value_heads']} differs from num_attention_heads = {heads}")
    topk = sizes["moe_router_topk"]
    norm = hf.get("norm_topk_prob", False)
    if topk is not None and topk > 1 and not norm:
        problems.append("norm_topk_prob = false: Megatron-Core's sigmoid router always normalises the top-k weights")
    if topk == 1 and norm:
        problems.append("norm_topk_prob = true with num_experts_per_tok = 1: Megatron-Core does not normalise a "
                        "single weight")
    if None not in (topk, sizes["num_moe_experts"]):
        from recipes.models import check_deepseek_group_routing

        try:
            check_deepseek_group_routing(topk, sizes["moe_router_num_groups"], sizes["moe_router_group_topk"],
                                         sizes["num_moe_experts"], names=("num_experts_per_tok", "n_group", "topk_group"))
        except ValueError as err:
            problems.append(str(err))
    if layers is not None and not 0 <= sizes["dense_layers"] <= layers:
        problems.append(f"first_k_dense_replace = {sizes['dense_layers']} is not in 0..num_hidden_layers = {layers}")
    return sizes, arch, source, problems


def _variant_of(recipe: str) -> str:
    from recipes.models import DEEPSEEK_V3_SIZES

    variant = {"deepseek-v3": "671b", "deepseek-v3-671b": "671b"}.get(recipe, recipe.replace("deepseek-v3-", "", 1))
    if not recipe.startswith("deepseek-v3") or variant not in DEEPSEEK_V3_SIZES:
        raise ConversionError(f"recipe {recipe!r} is not a DeepSeek-V3 recipe (deepseek-v3, deepseek-v3-tiny)")
    return variant


def recipe_from_hf_config(hf_config: dict, recipe: Optional[str] = None, *, drop_mtp: bool = False, **kwargs):
    """The Megatron recipe (``recipes.models.Recipe``) of a DeepSeek-V3 ``config.json``.

    ``kwargs``: the layout (``ep_size``, ``tp_size``, ``pp_size``, ``dtype``, ``cpu``, as
    ``recipes.models.deepseek_v3`` takes them) and optionally explicit values of any Megatron
    field the config sets (``num_layers=61``, ``moe_router_topk=8``, ...). ``recipe``: ``deepseek-v3``
    is a fixed size the config must describe; ``deepseek-v3-tiny`` (or None) takes every size from
    the config (any DeepSeek-V3-architecture checkpoint, tiny or released). A config field
    that contradicts the recipe or an explicit value, or that Megatron-Core cannot reproduce, is one
    :class:`ConversionError` naming every such field. ``drop_mtp``: build without the MTP layers
    (e.g. for a checkpoint re-saved by transformers, which does not keep them)."""
    from recipes.models import DEEPSEEK_V3_ARCHITECTURE, DEEPSEEK_V3_SIZES, deepseek_v3

    layout = {k: kwargs.pop(k) for k in LAYOUT_KEYS if k in kwargs}
    sizes, arch, source, problems = _translate(hf_config)
    model_type = hf_config.get("model_type")
    if model_type not in (None, "deepseek_v3"):
        problems.insert(0, f"model_type = {model_type!r} (expected 'deepseek_v3')")
    architectures = architectures_problem(hf_config, "DeepseekV3ForCausalLM")
    if architectures and model_type in (None, "deepseek_v3"):
        problems.insert(0, architectures)
    if drop_mtp:
        arch["mtp_num_layers"] = 0
    variant = "hf"
    expected: dict = {}
    if recipe is not None:
        variant = _variant_of(recipe)
        if variant in FIXED_SIZES:
            expected.update(DEEPSEEK_V3_SIZES[variant])
            expected.update(DEEPSEEK_V3_ARCHITECTURE)
            if drop_mtp:
                expected["mtp_num_layers"] = 0
    unknown = sorted(set(kwargs) - set(sizes) - set(arch))
    if unknown:
        raise ConversionError(f"recipe_from_hf_config: unknown fields {unknown} (layout: {', '.join(LAYOUT_KEYS)})")
    contradictions = []
    for key, value in {**sizes, **arch}.items():
        for what, wanted in ((f"recipe {recipe}", expected), ("the explicit value", kwargs)):
            if key in wanted and not _same(value, wanted[key]):
                contradictions.append(f"{source.get(key, key)} = {value!r} contradicts {what} {key} = {wanted[key]!r}")
    problems = contradictions + problems
    if problems:
        raise ConversionError("DeepSeek-V3 config.json: " + "; ".join(problems))
    try:
        return deepseek_v3(variant, sizes=sizes, architecture=arch, **layout)
    except ValueError as err:
        raise ConversionError(f"DeepSeek-V3 config.json: {err}") from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def hf_config_from_recipe(recipe, *, rope_interleave: bool = True, dtype: str = "bfloat16") -> dict:
    """A ``config.json`` (transformers ``DeepseekV3ForCausalLM``, the release's field names and
    legacy ``rope_scaling`` form) describing ``recipe``'s model."""
    c = recipe.config
    freq = c.moe_layer_freq
    if isinstance(freq, int):
        freq = [1 if i % freq == 0 else 0 for i in range(c.num_layers)]
    dense = next((i for i, moe in enumerate(freq) if moe), c.num_layers)
    if any(not moe for moe in freq[dense:]):
        raise ConversionError(f"{recipe.name}: moe_layer_freq {c.moe_layer_freq} is not 'the first k dense, the rest MoE'")
    if c.moe_shared_expert_intermediate_size and c.moe_shared_expert_intermediate_size % c.moe_ffn_hidden_size:
        raise ConversionError(f"{recipe.name}: moe_shared_expert_intermediate_size {c.moe_shared_expert_intermediate_size}"
                              f" is not a multiple of moe_ffn_hidden_size {c.moe_ffn_hidden_size}")
    config = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=recipe.vocab_size,
        max_position_embeddings=recipe.max_sequence_length,
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        moe_intermediate_size=c.moe_ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        first_k_dense_replace=dense,
        moe_layer_freq=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_head_dim,
        qk_rope_head_dim=c.qk_pos_emb_head_dim,
        v_head_dim=c.v_head_dim,
        n_routed_experts=c.num_moe_experts,
        n_shared_experts=(c.moe_shared_expert_intermediate_size or 0) // c.moe_ffn_hidden_size,
        num_experts_per_tok=c.moe_router_topk,
        n_group=c.moe_router_num_groups or 1,
        topk_group=c.moe_router_group_topk or 1,
        routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
        norm_topk_prob=c.moe_router_topk > 1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        hidden_act="silu",
        rms_norm_eps=c.layernorm_epsilon,
        attention_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        num_nextn_predict_layers=c.mtp_num_layers or 0,
        rope_theta=c.rotary_base,
        rope_interleave=rope_interleave,
        initializer_range=c.init_method_std,
        torch_dtype=dtype,
    )
    if c.rope_type == "yarn":
        config["rope_scaling"] = dict(type="yarn", factor=c.rotary_scaling_factor,
                                      original_max_position_embeddings=c.original_max_position_embeddings,
                                      beta_fast=c.beta_fast, beta_slow=c.beta_slow, mscale=c.mscale,
                                      mscale_all_dim=c.mscale_all_dim)
    else:
        config["rope_scaling"] = None
    return config
