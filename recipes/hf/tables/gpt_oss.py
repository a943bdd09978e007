"""gpt-oss <-> Hugging Face (``GptOssForCausalLM``): the conversion table, the expert transforms and
the recipe built from a ``config.json``.

Hugging Face layout (what ``save_pretrained`` writes; the release stores the expert weights as MXFP4
``*_blocks``/``*_scales`` instead, dequantized here with :mod:`recipes.hf.quantization`):

- ``mlp.experts.gate_up_proj`` ``[E, D, 2H]``, columns INTERLEAVED: even = glu (gate), odd = linear
  (up); ``gate_up_proj_bias`` ``[E, 2H]`` likewise. Megatron's ``linear_fc1`` is ``[2H, D]`` with the
  glu half first, then the linear half.
- ``mlp.experts.down_proj`` ``[E, H, D]`` (``x @ W``); Megatron's ``linear_fc2.weight`` is ``[D, H]``.
- ``self_attn.sinks`` ``[heads]`` = Megatron's learnable ``softmax_offset``; q/k/v/o with biases;
  ``mlp.router`` weight and bias.

Export writes the experts back as MXFP4 (``QUANTIZED_HF``, :class:`recipes.hf.quantization.ExportQuantizer`)
when the source checkpoint was quantized, bf16 on request.

The mapping agrees with Megatron-Bridge's ``GPTOSSBridge`` (src/megatron/bridge/models/gpt_oss/
gpt_oss_bridge.py: the same HF <-> Megatron names, gate/up de-interleaving, transposed down_proj);
it was checked here independently against transformers' forward (tests/hf/test_hf_gpt_oss.py).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from recipes.hf.rules import architectures_problem, Context, ConversionError, Reader, register_transform, Rule, Transform

L = "model.layers.{layer}"
M = "decoder.layers.{layer}"
MAPPING = [
    Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Rule(f"{M}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
    Rule(f"{M}.self_attention.linear_qkv.layer_norm_weight", f"{L}.input_layernorm.weight"),  # TE: fused into qkv
    Rule(f"{M}.self_attention.linear_qkv.weight",
         (f"{L}.self_attn.q_proj.weight", f"{L}.self_attn.k_proj.weight", f"{L}.self_attn.v_proj.weight"), "qkv"),
    Rule(f"{M}.self_attention.linear_qkv.bias",
         (f"{L}.self_attn.q_proj.bias", f"{L}.self_attn.k_proj.bias", f"{L}.self_attn.v_proj.bias"), "qkv"),
    Rule(f"{M}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight"),
    Rule(f"{M}.self_attention.linear_proj.bias", f"{L}.self_attn.o_proj.bias"),
    Rule(f"{M}.self_attention.core_attention.softmax_offset", f"{L}.self_attn.sinks", "gpt_oss_sinks"),
    Rule(f"{M}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
    Rule(f"{M}.mlp.router.weight", f"{L}.mlp.router.weight"),
    Rule(f"{M}.mlp.router.bias", f"{L}.mlp.router.bias"),
    # one [E, ...] HF tensor per layer: the engine hands each expert its row
    Rule(f"{M}.mlp.experts.{{expert}}.linear_fc1.weight", f"{L}.mlp.experts.gate_up_proj", "gpt_oss_gate_up"),
    Rule(f"{M}.mlp.experts.{{expert}}.linear_fc1.bias", f"{L}.mlp.experts.gate_up_proj_bias", "gpt_oss_gate_up_bias"),
    Rule(f"{M}.mlp.experts.{{expert}}.linear_fc2.weight", f"{L}.mlp.experts.down_proj", "gpt_oss_down"),
    Rule(f"{M}.mlp.experts.{{expert}}.linear_fc2.bias", f"{L}.mlp.experts.down_proj_bias"),
    # the same under Transformer Engine's TEGroupedMLP names (``linear_fc1.weight{expert}``)
    Rule(f"{M}.mlp.experts.linear_fc1.weight{{expert}}", f"{L}.mlp.experts.gate_up_proj", "gpt_oss_gate_up"),
    Rule(f"{M}.mlp.experts.linear_fc1.bias{{expert}}", f"{L}.mlp.experts.gate_up_proj_bias", "gpt_oss_gate_up_bias"),
    Rule(f"{M}.mlp.experts.linear_fc2.weight{{expert}}", f"{L}.mlp.experts.down_proj", "gpt_oss_down"),
    Rule(f"{M}.mlp.experts.linear_fc2.bias{{expert}}", f"{L}.mlp.experts.down_proj_bias"),
    Rule("decoder.final_layernorm.weight", "model.norm.weight"),
    Rule("output_layer.weight", "lm_head.weight"),
]

IGNORE_HF: tuple[str, ...] = ()

# the release's precision, for export (recipes.hf.quantization.ExportQuantizer): (HF name regex, format,
# error-report group). The release stores both fused expert weights as MXFP4 of their [E, out, in]
# transpose (``*_blocks`` / ``*_scales``); everything else is bf16.
QUANTIZED_HF: tuple[tuple[str, str, str], ...] = (
    (r"\.mlp\.experts\.gate_up_proj$", "mxfp4_experts", "experts gate_up_proj (fc1)"),
    (r"\.mlp\.experts\.down_proj$", "mxfp4_experts", "experts down_proj (fc2)"),
)


# ---------------------------------------------------------------------------------------------
# transforms
# ---------------------------------------------------------------------------------------------


def _expert_weight(read: Reader, name: str, ctx: Context) -> torch.Tensor:
    """One expert's row of a fused expert weight as transformers holds it (``gate_up_proj``
    ``[D, 2H]``, ``down_proj`` ``[H, D]``): stored, or dequantized from MXFP4 ``_blocks``/``_scales``
    (to the parameter dtype: bf16 on GPU, fp32 on CPU). A plain one under a config.json that says
    MXFP4, and ``_scales`` that do not fit their ``_blocks``, are ConversionErrors naming the tensor."""
    blocks, scales = name + "_blocks", name + "_scales"
    if read.has(name):
        method = (ctx.hf_config.get("quantization_config") or {}).get("quant_method")
        if method == "mxfp4":  # transformers' dequantized saves drop quantization_config
            raise ConversionError(f"{read.ckpt.directory}: config.json's quantization_config says mxfp4, but {name} is "
                                  f"stored plain (no {blocks} / {scales}): remove "
                                  "quantization_config from config.json (a dequantized copy) or give the MXFP4 checkpoint")
        return read(name)
    if read.has(blocks) and read.has(scales):
        from recipes.hf.quantization import gpt_oss_expert_weight_from_mxfp4

        block_shape, scale_shape = read.ckpt.shape(blocks), read.ckpt.shape(scales)
        if scale_shape != block_shape[:-1]:
            raise ConversionError(f"{read.ckpt.directory}: {scales} has shape {scale_shape}, but {blocks} "
                                  f"{block_shape} needs {block_shape[:-1]} (one E8M0 scale per 32-value block): a "
                                  "damaged checkpoint or not gpt-oss's MXFP4 layout")
        dtype = ctx.dtype if ctx.dtype.is_floating_point else torch.float32
        device = ctx.device if ctx.device is not None and ctx.device.type == "cuda" else None  # dequantize on the GPU
        # rows of one expert: blocks [out, in/32, 16], scales [out, in/32]
        blocks_, scales_ = (read(n)[None].to(device) if device else read(n)[None] for n in (blocks, scales))
        try:
            return gpt_oss_expert_weight_from_mxfp4(blocks_, scales_, dtype)[0]
        except ValueError as err:  # e.g. blocks stored as another dtype than uint8
            raise ConversionError(f"{read.ckpt.directory}: {blocks} + {scales}: {err}") from None
    raise ConversionError(f"{read.ckpt.directory}: neither {name} nor {blocks} + {scales} in the checkpoint")


def deinterleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved (glu, linear, glu, linear, ...) along ``dim`` -> (all glu, all linear)."""
    even, odd = [slice(None)] * tensor.dim(), [slice(None)] * tensor.dim()
    even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat([tensor[tuple(even)], tensor[tuple(odd)]], dim=dim)


def interleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """(all glu, all linear) along ``dim`` -> interleaved (glu, linear, glu, linear, ...)."""
    dim = dim % tensor.dim()
    glu, lin = torch.chunk(tensor, 2, dim=dim)
    return torch.stack([glu, lin], dim=dim + 1).flatten(dim, dim + 1)


def _expert_tp(ctx: Context) -> int:
    return int(getattr(ctx.config, "expert_tensor_parallel_size", None) or 1) if ctx.config is not None else 1


def to_rank_blocks(tensor: torch.Tensor, tp: int) -> torch.Tensor:
    """(glu; linear) along dim 0 -> Megatron's tensor-parallel order of a gated fc1: rank r holds
    (glu_r; linear_r), so the full tensor the engine narrows is (glu_0; lin_0; glu_1; lin_1; ...)."""
    if tp == 1:
        return tensor
    glu, lin = torch.chunk(tensor, 2, dim=0)
    return torch.cat([torch.cat(pair) for pair in zip(torch.chunk(glu, tp), torch.chunk(lin, tp))])


def from_rank_blocks(tensor: torch.Tensor, tp: int) -> torch.Tensor:
    if tp == 1:
        return tensor
    blocks = [torch.chunk(block, 2, dim=0) for block in torch.chunk(tensor, tp, dim=0)]
    return torch.cat([b[0] for b in blocks] + [b[1] for b in blocks])


class GateUp(Transform):
    """``gate_up_proj[e]`` ``[D, 2H]`` (interleaved columns) <-> ``linear_fc1.weight`` ``[2H, D]``
    (glu rows, then linear rows)."""

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return to_rank_blocks(deinterleave(_expert_weight(read, name, ctx), dim=1).t(), _expert_tp(ctx))

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        return {name: interleave(from_rank_blocks(tensor, _expert_tp(ctx)), dim=0).t().contiguous()}


class GateUpBias(Transform):
    """``gate_up_proj_bias[e]`` ``[2H]`` (interleaved) <-> ``linear_fc1.bias`` (glu half first)."""

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return to_rank_blocks(deinterleave(read(name), dim=0), _expert_tp(ctx))

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        return {name: interleave(from_rank_blocks(tensor, _expert_tp(ctx)), dim=0)}


class Down(Transform):
    """``down_proj[e]`` ``[H, D]`` <-> ``linear_fc2.weight`` ``[D, H]``."""

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return _expert_weight(read, name, ctx).t()

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        return {name: tensor.t().contiguous()}


class Sinks(Transform):
    """``self_attn.sinks`` ``[heads]`` <-> ``core_attention.softmax_offset`` (Megatron's local
    attention holds ``[heads]``; other shapes of the same values are reshaped by the engine)."""

    def to_megatron(self, read, names, ctx):
        (name,) = names
        return read(name)

    def to_hf(self, tensor, ctx):
        (name,) = ctx.hf_names
        return {name: tensor.reshape(-1)}


register_transform("gpt_oss_gate_up", GateUp())
register_transform("gpt_oss_gate_up_bias", GateUpBias())
register_transform("gpt_oss_down", Down())
register_transform("gpt_oss_sinks", Sinks())


# ---------------------------------------------------------------------------------------------
# recipe <-> config.json
# ---------------------------------------------------------------------------------------------

FIXED_SIZES = ("20b", "120b")  # recipes whose sizes config.json must match
FIXED_SIZE_RECIPES = tuple(f"gpt-oss-{v}" for v in FIXED_SIZES)  # (recipes/finetune.py: others take config.json's)
SWIGLU_ALPHA = 1.702  # quick_gelu's constant (Megatron's activation)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(hf: dict) -> dict:
    """The rope fields of a config.json as ``GPT_OSS_ARCHITECTURE`` keys (transformers 5 writes
    ``rope_parameters`` with ``rope_theta`` inside; the release writes ``rope_scaling`` +
    ``rope_theta``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    theta = params.get("rope_theta", hf.get("rope_theta", 150000.0))
    rope_type = params.get("rope_type", params.get("type", "yarn"))
    if rope_type != "yarn":
        raise ConversionError(f"config.json: {field}.rope_type = {rope_type!r}, but gpt-oss uses 'yarn'")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"config.json: {field}.partial_rotary_factor = {params['partial_rotary_factor']} is not "
                              f"supported (gpt-oss rotates the whole head)")
    factor = float(params.get("factor", 32.0))
    original = int(params.get("original_max_position_embeddings", 4096))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then uses 0.1 ln(factor) + 1
        mscale, mscale_all_dim = 1.0, 0.0
    expected = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale_all_dim else \
        _yarn_mscale(factor, mscale)
    attention_factor = params.get("attention_factor")
    if attention_factor is not None and abs(float(attention_factor) - expected) > 1e-9:
        raise ConversionError(f"config.json: {field}.attention_factor = {attention_factor} is not supported (Megatron "
                              f"derives {expected:.6f} from factor/mscale)")
    return dict(
        rotary_base=float(theta), yarn_rotary_scaling_factor=factor, yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(params.get("beta_fast") or 32.0), yarn_beta_slow=float(params.get("beta_slow") or 1.0),
        yarn_mscale=float(mscale), yarn_mscale_all_dim=float(mscale_all_dim),
        yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
    )


def _get(hf: dict, *names: str, default: Any = None, required: bool = True) -> Any:
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    if required and default is None:
        raise ConversionError(f"config.json: {names[0]} is missing")
    return default


def hf_sizes(hf: dict) -> dict:
    """The ``sizes`` of :func:`recipes.models.gpt_oss` from a gpt-oss config.json."""
    model_type = hf.get("model_type")
    if model_type != "gpt_oss":
        raise ConversionError(f"config.json: model_type = {model_type!r}, expected 'gpt_oss' for a gpt-oss recipe")
    problem = architectures_problem(hf, "GptOssForCausalLM")
    if problem:
        raise ConversionError(f"config.json: {problem}")
    heads = int(_get(hf, "num_attention_heads"))
    hidden = int(_get(hf, "hidden_size"))
    return dict(
        num_layers=int(_get(hf, "num_hidden_layers")), num_moe_experts=int(_get(hf, "num_local_experts", "num_experts")),
        hidden_size=hidden, moe_ffn_hidden_size=int(_get(hf, "intermediate_size")), num_attention_heads=heads,
        num_query_groups=int(_get(hf, "num_key_value_heads", default=heads)),
        kv_channels=int(_get(hf, "head_dim", default=hidden // heads)), vocab_size=int(_get(hf, "vocab_size")),
        max_sequence_length=int(_get(hf, "max_position_embeddings", default=131072)),
    )


def hf_architecture(hf: dict, layers: int) -> dict:
    """The ``architecture`` of :func:`recipes.models.gpt_oss` from a gpt-oss config.json;
    ConversionError naming the field for anything Megatron's gpt-oss model cannot represent."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        sliding_layers = None
    else:
        bad = sorted({t for t in layer_types} - {"sliding_attention", "full_attention"})
        if bad or len(layer_types) != layers:
            raise ConversionError(f"config.json: layer_types must list 'sliding_attention'/'full_attention' for each of "
                                  f"the {layers} layers (got {len(layer_types)} entries{', ' + str(bad) if bad else ''})")
        sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
    window = hf.get("sliding_window")
    if window is None or int(window) < 1:
        if sliding_layers is None or any(sliding_layers):
            raise ConversionError(f"config.json: sliding_window = {window!r} but layers use sliding attention")
        window = 128
    arch = dict(
        moe_router_topk=int(_get(hf, "num_experts_per_tok", "experts_per_token", default=4)),
        sliding_window=int(window), sliding_layers=sliding_layers,
        layernorm_epsilon=float(_get(hf, "rms_norm_eps", default=1e-5)),
        activation_func_clamp_value=float(_get(hf, "swiglu_limit", default=7.0)),
        **_rope(hf),
    )
    alpha = float(hf.get("swiglu_alpha", SWIGLU_ALPHA))
    if abs(alpha - SWIGLU_ALPHA) > 1e-12:
        raise ConversionError(f"config.json: swiglu_alpha = {alpha}, but Megatron's quick_gelu uses {SWIGLU_ALPHA}")
    if hf.get("attention_bias", True) is not True:
        raise ConversionError("config.json: attention_bias = false, but gpt-oss (and this recipe) has q/k/v/o biases")
    if hf.get("tie_word_embeddings", False):
        raise ConversionError("config.json: tie_word_embeddings = true, but gpt-oss has a separate lm_head")
    return arch


# the config.json field behind each recipe key (for error messages)
HF_FIELD = dict(
    num_layers="num_hidden_layers", num_moe_experts="num_local_experts", hidden_size="hidden_size",
    moe_ffn_hidden_size="intermediate_size", num_attention_heads="num_attention_heads",
    num_query_groups="num_key_value_heads", kv_channels="head_dim", vocab_size="vocab_size",
    max_sequence_length="max_position_embeddings", moe_router_topk="num_experts_per_tok",
    sliding_window="sliding_window", sliding_layers="layer_types", layernorm_epsilon="rms_norm_eps",
    activation_func_clamp_value="swiglu_limit", rotary_base="rope_theta", yarn_rotary_scaling_factor="rope factor",
    yarn_original_max_position_embeddings="rope original_max_position_embeddings", yarn_beta_fast="rope beta_fast",
    yarn_beta_slow="rope beta_slow", yarn_mscale="rope mscale", yarn_mscale_all_dim="rope mscale_all_dim",
    yarn_correction_range_round_to_int="rope truncate",
)


def recipe_from_hf_config(hf_config: dict, recipe: Optional[str] = None, **layout):
    """The gpt-oss Recipe for a Hugging Face config.json (like Megatron-Bridge's ``from_hf_config``).

    ``recipe`` picks the family and training defaults: ``gpt-oss-20b`` / ``gpt-oss-120b`` are fixed
    sizes, and a config.json that contradicts one (layers, experts, widths, vocabulary, window,
    rope, ...) is a ConversionError naming the field; ``gpt-oss-tiny`` takes every size from
    config.json (any gpt-oss-architecture checkpoint, tiny or released), as does ``None``. ``layout``:
    ``ep_size``, ``tp_size``, ``pp_size``, ``dtype``, ``cpu`` as for :func:`recipes.models.gpt_oss`."""
    from recipes.models import GPT_OSS_ARCHITECTURE, GPT_OSS_SIZES, gpt_oss

    recipe = recipe or "gpt-oss-tiny"
    if not recipe.startswith("gpt-oss-") or recipe[len("gpt-oss-"):] not in GPT_OSS_SIZES:
        raise ConversionError(f"--recipe {recipe} is not a gpt-oss recipe ({', '.join('gpt-oss-' + v for v in GPT_OSS_SIZES)})")
    variant = recipe[len("gpt-oss-"):]
    fixed = variant in FIXED_SIZES
    expected = dict(GPT_OSS_SIZES[variant], **GPT_OSS_ARCHITECTURE)

    def check(values: dict) -> None:
        default_layers = tuple(i % 2 == 0 for i in range(expected["num_layers"]))
        for key, value in values.items():
            want = expected[key]
            if key == "sliding_layers":
                value, want = value or default_layers, want or default_layers
            if key == "max_sequence_length":
                continue  # a shorter context is fine
            if value != want and not (isinstance(want, float) and isinstance(value, (int, float))
                                      and abs(float(value) - want) <= 1e-9 * max(1.0, abs(want))):
                raise ConversionError(f"config.json: {HF_FIELD[key]} = {value!r} contradicts --recipe {recipe} "
                                      f"({want!r}); use --recipe gpt-oss-tiny to take every size from config.json")

    sizes = hf_sizes(hf_config)
    if fixed:
        check(sizes)
    arch = hf_architecture(hf_config, sizes["num_layers"])
    if fixed:
        check(arch)
        return gpt_oss(variant, **layout)
    return gpt_oss(variant, sizes=sizes, architecture=arch, name="gpt-oss-hf", **layout)


def hf_config_from_recipe(recipe, base: Optional[dict] = None) -> dict:
    """A bf16 ``config.json`` for ``recipe`` (``GptOssForCausalLM``). With ``base`` (the imported
    checkpoint's config.json) its other fields are kept and the quantization config dropped."""
    config = recipe.config
    skip = config.window_attn_skip_freq
    layers = config.num_layers
    if isinstance(skip, int):
        sliding = [(i + 1) % skip != 0 for i in range(layers)]
    else:
        sliding = [bool(s) for s in skip]
    rope = {
        "rope_type": "yarn", "rope_theta": float(recipe.rotary_base), "factor": float(config.yarn_rotary_scaling_factor),
        "original_max_position_embeddings": int(config.yarn_original_max_position_embeddings),
        "beta_fast": float(config.yarn_beta_fast), "beta_slow": float(config.yarn_beta_slow),
        "truncate": bool(config.yarn_correction_range_round_to_int),
    }
    if config.yarn_mscale_all_dim:
        rope.update(mscale=float(config.yarn_mscale), mscale_all_dim=float(config.yarn_mscale_all_dim))
    out = dict(base or {})
    out.pop("quantization_config", None)
    out.pop("rope_scaling", None)
    out.update(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=layers,
        num_local_experts=config.num_moe_experts, hidden_size=config.hidden_size,
        intermediate_size=config.moe_ffn_hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels, vocab_size=recipe.vocab_size,
        max_position_embeddings=recipe.max_sequence_length, num_experts_per_tok=config.moe_router_topk,
        sliding_window=config.window_size[0] + 1,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rms_norm_eps=config.layernorm_epsilon, swiglu_limit=config.activation_func_clamp_value,
        swiglu_alpha=SWIGLU_ALPHA, rope_parameters=rope, attention_bias=True, tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if "experts_per_token" in out:
        out["experts_per_token"] = config.moe_router_topk
    if "rope_theta" in out:
        out["rope_theta"] = float(recipe.rotary_base)
    out.setdefault("hidden_act", "silu")
    out.setdefault("attention_dropout", 0.0)
    out.setdefault("initializer_range", 0.02)
    return out
