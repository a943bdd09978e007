"""DeepSeek-V3 Hugging Face import/export tests: the reference side (a tiny random transformers
``DeepseekV3ForCausalLM`` plus an MTP layer written like the release's ``model.layers.{N}``, its
logits, FP8 copies of the checkpoint) and the rank side (import into Megatron-Core with LLEP,
logits, negative controls, export). Imported by the test and by the spawned gloo processes;
transformers is imported only on the reference side."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from typing import Optional

import torch

SEQ = 32
BATCH = 2
SEED = 1234
# e_score_correction_bias of every MoE layer (MTP included): experts 0-2 of group 0 favoured, so
# every token keeps group 0 and rank 0 of EP=2 (experts 0-3) receives all routed tokens
HOT_BIAS = (0.75, 0.5, 0.25, 0.0, -0.125, 0.0625, -0.0625, 0.125)


# ---------------------------------------------------------------------------------------------
# reference side (transformers)
# ---------------------------------------------------------------------------------------------


def tiny_hf_config(rope_interleave: bool = True, **fields) -> dict:
    """config.json of the deepseek-v3-tiny recipe, in the release's field names (``fields``
    replace some)."""
    from recipes.hf.tables.deepseek_v3 import hf_config_from_recipe
    from recipes.models import deepseek_v3

    return {**hf_config_from_recipe(deepseek_v3("tiny", cpu=True), rope_interleave=rope_interleave), **fields}


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter and the router bias: norms around 1, weights ~ 1/sqrt(fan-in), parameters
    bf16-representable (the checkpoint is bf16 but the float32 selection bias; the model computes
    in fp32)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                value = 1.0 + 0.25 * torch.randn(p.shape, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                value = torch.randn(p.shape, generator=gen)
            else:
                fan_in = p.shape[-1]
                scale = 3.0 if name.endswith("gate.weight") else 1.0  # spread router scores
                value = scale * torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
            p.copy_(_bf16_exact(value))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):  # float32 in the release: not rounded
                hot = torch.tensor(HOT_BIAS) if b.numel() == len(HOT_BIAS) else 0.25 * torch.randn(b.shape, generator=gen)
                b.copy_(hot + 0.03125 * torch.randn(b.shape, generator=gen))


class MTPReference(torch.nn.Module):
    """DeepSeek-V3's MTP module (as vLLM / SGLang run the release's layer 61) out of transformers'
    own DeepSeek-V3 modules: ``eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])`` -> decoder layer ->
    ``shared_head.norm`` -> the shared output layer."""

    def __init__(self, config) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        h = config.hidden_size
        self.index = config.num_hidden_layers
        self.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_norm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, model, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        nxt = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # Megatron's roll
        x = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(nxt)), self.hnorm(hidden)], dim=-1))
        s = input_ids.shape[1]
        positions = torch.arange(s).unsqueeze(0).expand_as(input_ids)
        cos_sin = model.model.rotary_emb(x, positions)
        mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]
        x = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        if isinstance(x, tuple):
            x = x[0]
        return model.lm_head(self.shared_norm(x))

    def hf_tensors(self, model) -> dict[str, torch.Tensor]:
        """The layer under the release's names (experts split per expert, as save_pretrained does)."""
        p = f"model.layers.{self.index}"
        out = {f"{p}.enorm.weight": self.enorm.weight, f"{p}.hnorm.weight": self.hnorm.weight,
               f"{p}.eh_proj.weight": self.eh_proj.weight, f"{p}.shared_head.norm.weight": self.shared_norm.weight,
               f"{p}.embed_tokens.weight": model.model.embed_tokens.weight,
               f"{p}.shared_head.head.weight": model.lm_head.weight}
        for name, t in list(self.layer.state_dict().items()):
            if ".experts.gate_up_proj" in name:
                for e in range(t.shape[0]):
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{p}.mlp.experts.{e}.up_proj.weight"] = up
            elif ".experts.down_proj" in name:
                for e in range(t.shape[0]):
                    out[f"{p}.mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                out[f"{p}.{name}"] = t
        return {k: v.detach().clone() for k, v in out.items()}


def write_checkpoint(directory: str, config: dict, tensors: dict[str, torch.Tensor], shards: int = 2) -> None:
    """A release-style directory: bf16 tensors (the selection bias fp32), ``shards`` safetensors
    shards, the index and config.json."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def release_dtypes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.float() if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16) for n, t in tensors.items()}


def build_reference(directory: str, config: dict, seed: int = SEED, latent_scale: float = 1.0,
                    mtp_tensors: bool = True) -> dict:
    """Write a tiny random DeepSeek-V3 (+ MTP layer) checkpoint to ``directory``; return the
    token ids and transformers' logits (main, and the MTP layer's by the reference above).
    ``latent_scale`` (a power of 2): the q/kv down-projections scaled by it, so that the latent
    norms' eps weighs in. ``mtp_tensors=False``: no MTP layer written (what transformers'
    save_pretrained gives, config.json still counting it)."""
    import tempfile

    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    gen = torch.Generator().manual_seed(seed)
    hf_config = DeepseekV3Config(**copy.deepcopy(config))  # transformers edits nested dicts in place
    hf_config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_config).eval()
    mtp = MTPReference(hf_config).eval()
    _randomise(model, gen)
    _randomise(mtp, gen)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *mtp.named_parameters()]:
            if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(latent_scale)
    with tempfile.TemporaryDirectory() as tmp:  # transformers' own on-disk names (experts split)
        model.save_pretrained(tmp)
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
    if mtp_tensors:
        tensors.update(mtp.hf_tensors(model))
    write_checkpoint(directory, config, release_dtypes(tensors))
    ids = torch.randint(2, config["vocab_size"], (BATCH, SEQ), generator=gen)
    with torch.no_grad():
        out = model(ids)
        hidden = model.model(ids).last_hidden_state
        mtp_logits = mtp(model, ids, hidden)
    return dict(ids=ids, logits=out.logits.detach(), mtp_logits=mtp_logits.detach())


def hf_logits(directory: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of a checkpoint directory (fp32, eager attention)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # it lists the MTP layer's tensors, which transformers does not load
    model = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


FP8_MAX = 448.0


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block FP8: e4m3 weight, float32 ``weight_scale_inv`` per ``block`` (edges
    partial); returns (fp8 weight, scale_inv, the dequantized float32 weight)."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    w = weight.float()
    padded = torch.zeros(nr * br, nc * bc)
    padded[:rows, :cols] = w
    amax = padded.reshape(nr, br, nc, bc).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)
    expand = scale_inv.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    q = (w / expand).to(torch.float8_e4m3fn)
    return q, scale_inv, q.float() * expand


def fp8_checkpoint(source: str, directory: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A copy of ``source`` with every linear weight in block FP8 + ``weight_scale_inv`` (the
    release's scheme: norms, embeddings, the output layer, the router stay bf16/fp32); returns the
    dequantized value of each quantized weight."""
    from safetensors.torch import load_file

    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                         weight_block_size=list(block))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(os.listdir(source)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, file)))
    expected = {}
    for name in sorted(tensors):
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            q, scale_inv, deq = quantize_fp8(tensors[name], block)
            tensors[name] = q
            tensors[name + "_scale_inv"] = scale_inv
            expected[name] = deq
    write_checkpoint(directory, config, tensors, shards=3)
    return expected


# ---------------------------------------------------------------------------------------------
# rank side (Megatron-Core)
# ---------------------------------------------------------------------------------------------


def _build(directory: str, ep: int, **options):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_llep.config import LLEPConfig
    from megatron_llep.runtime.layer import with_llep
    from recipes.hf.checkpoint import HFCheckpoint
    from recipes.hf.tables.deepseek_v3 import recipe_from_hf_config

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        model_parallel_cuda_manual_seed(SEED)
    hf_config = HFCheckpoint(directory).config
    recipe = recipe_from_hf_config(hf_config, ep_size=ep, dtype=torch.float32, cpu=True, **options)
    spec = with_llep(recipe.layer_spec(), LLEPConfig(min_chunk_tokens=2, cost_aware=False))
    model = GPTModel(recipe.config, spec, mtp_block_spec=recipe.mtp_spec(spec), **recipe.gpt_model_kwargs())
    return recipe, model


def _import(model, directory: str):
    from recipes.hf.importing import import_hf_checkpoint

    return import_hf_checkpoint(model, directory, "deepseek-v3", verbose=False)


def _logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from recipes.runtime.logits import lm_and_mtp_logits, lm_logits

    model.eval()
    with torch.no_grad():
        main, (mtp,) = lm_and_mtp_logits(model, ids)
        alone = lm_logits(model, ids)
    return main, mtp, alone


def _llep_modes(model) -> list[str]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    modes = []
    for module in model.modules():
        if isinstance(module, MoELayer):
            stats = getattr(module.token_dispatcher, "last_stats", None)
            modes.append(stats.mode if stats is not None else "none")
    return modes


@contextlib.contextmanager
def rope_nope_swapped():
    """Negative control: queries' per-head rows taken as [rope, nope] instead of [nope, rope]."""
    from recipes.hf.tables import deepseek_v3 as family
    from recipes.hf.rules import TRANSFORMS, register_transform

    original = TRANSFORMS["deepseek_q_up"]

    class Swapped(family.DeepSeekQueryUp):
        def to_megatron(self, read, names, ctx):
            w = super().to_megatron(read, names, ctx)
            nope, rope = int(ctx.hf_config["qk_nope_head_dim"]), int(ctx.hf_config["qk_rope_head_dim"])
            heads = w.reshape(-1, nope + rope, w.shape[-1])
            return torch.cat([heads[:, nope:], heads[:, :nope]], dim=1).reshape(w.shape)

    register_transform("deepseek_q_up", Swapped())
    try:
        yield
    finally:
        register_transform("deepseek_q_up", original)


def run_ep(rank: int, world: int, directory: str, ids: torch.Tensor, export_dir: Optional[str]) -> dict:
    """At EP = world (one sequence per rank): import, logits with LLEP, the bias control, export."""
    from megatron.core.transformer.moe.router import TopKRouter

    _, model = _build(directory, world)
    report = _import(model, directory)
    mine = ids[rank:rank + 1]
    main, mtp, alone = _logits(model, mine)
    out = dict(main=main, mtp=mtp, alone=alone, modes=_llep_modes(model), bytes_read=report.bytes_read)
    if export_dir is not None:
        from recipes.hf.exporting import export_hf_checkpoint
        from recipes.hf.checkpoint import HFCheckpoint

        export_hf_checkpoint(model, "deepseek-v3", export_dir, HFCheckpoint(directory).config, dtype=torch.bfloat16,
                             verbose=False)
    # negative control: the selection bias dropped
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, TopKRouter) and module.expert_bias is not None:
                module.expert_bias.zero_()
    out["no_bias_main"], _, _ = _logits(model, mine)
    return out


def run_single(rank: int, world: int, interleaved_dir: str, plain_dir: str, plain_as_interleaved_dir: str,
               ids: torch.Tensor, fp8_dirs: list) -> dict:
    """The smallest layout (one rank, EP = 1): the rope_interleave=false checkpoint, its two
    negative controls (the config's rope claim flipped, rope/nope swapped), FP8 imports."""
    from recipes.hf.rules import canonical_entries

    out: dict = {}
    _, model = _build(plain_dir, 1)
    _import(model, plain_dir)
    out["main"], out["mtp"], out["alone"] = _logits(model, ids)
    _import(model, plain_as_interleaved_dir)
    out["rope_claim_flipped"], _, _ = _logits(model, ids)
    with rope_nope_swapped():
        _import(model, interleaved_dir)
    out["rope_nope_swapped"], _, _ = _logits(model, ids)
    _import(model, interleaved_dir)
    out["interleaved_main"], _, _ = _logits(model, ids)
    # the release's MTP layer left out of the model: its tensors are ignored, the main logits unchanged
    _, no_mtp = _build(interleaved_dir, 1, drop_mtp=True)
    _import(no_mtp, interleaved_dir)
    no_mtp.eval()
    with torch.no_grad():
        out["no_mtp_main"] = no_mtp(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), None)
    out["no_mtp_has_mtp"] = getattr(no_mtp, "mtp", None) is not None
    for directory in fp8_dirs:
        _import(model, directory)
        out[directory] = {e.canonical: e.tensor.detach().clone() for e in canonical_entries(model)}
    return out


def run_variants(rank: int, world: int, cases: list, latent_eps_control: Optional[str] = None) -> dict:
    """One rank, EP = 1: each (directory, ids) imported and its main + MTP logits; with
    ``latent_eps_control`` (a directory) also that checkpoint's logits with MLA's latent norms left
    at Megatron-Core's default eps (layernorm_epsilon), the negative control of the eps fix."""
    from megatron.core import parallel_state

    out: dict = {}
    for directory, ids in cases:
        _, model = _build(directory, 1)
        _import(model, directory)
        main, mtp, _ = _logits(model, ids)
        out[directory] = dict(main=main, mtp=mtp, params=sorted(n for n, _ in model.named_parameters()))
        if directory == latent_eps_control:
            from recipes import models

            original = models.exact_mla_latent_norms
            models.exact_mla_latent_norms = lambda spec, config, eps: original(spec, config, config.layernorm_epsilon)
            try:
                _, control = _build(directory, 1)
            finally:
                models.exact_mla_latent_norms = original
            _import(control, directory)
            out["latent_eps_control"], _, _ = _logits(control, ids)
        del model
    parallel_state.destroy_model_parallel()
    return out


def random_configs(count: int, seed: int) -> list[dict]:
    """``count`` config.json of DeepSeek-V3's architecture drawn over the fields a published config
    may vary (layer counts, first_k_dense_replace, heads and head widths, a query LoRA or none,
    experts, top-k and group routing, shared experts, YaRN or plain rope, eps, rope_interleave),
    within what Megatron-Core reproduces (check_deepseek_group_routing) and tiny enough for CPU."""
    import random

    rng = random.Random(seed)
    configs = []
    while len(configs) < count:
        experts = rng.choice([4, 8, 16])
        groups = rng.choice([g for g in (1, 2, 4) if experts // g >= 2])
        topk = rng.choice([k for k in (1, 2, 4) if k <= experts])
        # group routing Megatron shares with DeepSeek-V3: all groups kept, or topk // topk_group == 2
        kept = rng.choice([t for t in range(1, groups + 1) if t == groups or (topk % t == 0 and topk // t == 2)])
        if groups * (experts // groups) < topk or kept * (experts // groups) < topk:
            continue
        layers = rng.randint(1, 3)
        rope = rng.choice([4, 8])
        mtp = rng.choice([0, 1])
        fields = dict(  # at least one MoE layer (the MTP layer's spec is the last decoder layer's, MoE as in the release)
            num_hidden_layers=layers, first_k_dense_replace=rng.randint(0, layers - 1),
            hidden_size=rng.choice([32, 48, 64]), intermediate_size=rng.choice([48, 96]),
            moe_intermediate_size=rng.choice([16, 24]), num_attention_heads=(heads := rng.choice([1, 2, 4])),
            num_key_value_heads=heads, q_lora_rank=rng.choice([None, 16, 24]), kv_lora_rank=rng.choice([8, 16]),
            qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rope, v_head_dim=rng.choice([8, 12, 16]),
            n_routed_experts=experts, n_shared_experts=rng.choice([1, 2]), num_experts_per_tok=topk,
            n_group=groups, topk_group=kept, norm_topk_prob=topk > 1,
            routed_scaling_factor=rng.choice([1.0, 2.5]), rms_norm_eps=rng.choice([1e-6, 1e-5]),
            num_nextn_predict_layers=mtp, rope_theta=rng.choice([10000.0, 50000.0]),
            max_position_embeddings=512,
        )
        if rng.random() < 0.5:
            fields["rope_scaling"] = dict(type="yarn", factor=rng.choice([4.0, 40.0]), original_max_position_embeddings=128,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=rng.choice([0.0, 1.0]))
        else:
            fields["rope_scaling"] = None  # plain rope
        configs.append(tiny_hf_config(rope_interleave=rng.random() < 0.5, **fields))
    return configs


def run_random(rank: int, world: int, cases: list) -> list:
    """One rank, EP = 1: each (directory, ids) imported; its main logits and MTP logits (None
    without an MTP layer)."""
    from megatron.core import parallel_state

    from recipes.runtime.logits import lm_and_mtp_logits, lm_logits

    out = []
    for directory, ids in cases:
        recipe, model = _build(directory, 1)
        _import(model, directory)
        model.eval()
        with torch.no_grad():
            if recipe.config.mtp_num_layers:
                main, (mtp,) = lm_and_mtp_logits(model, ids)
            else:
                main, mtp = lm_logits(model, ids), None
        out.append(dict(main=main, mtp=mtp))
    parallel_state.destroy_model_parallel()
    return out
