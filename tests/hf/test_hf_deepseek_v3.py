"""DeepSeek-V3 from and to Hugging Face: a tiny random transformers DeepseekV3ForCausalLM (every
weight random, norms and the selection bias included, plus an MTP layer at HF layer
``num_hidden_layers`` as the release has it) imported into Megatron-Core gives transformers'
logits (fp32, rel err <= 1e-5) at EP=2 with LLEP spilling and at the smallest layout (EP=1), MTP
logits included; negative controls show the comparison fails when one convention is broken;
import-then-export reproduces the bf16 checkpoint bit for bit and transformers loads it; an FP8
(e4m3, block ``weight_scale_inv``) checkpoint imports to the dequantized values; config.json <->
recipe translation, including the group-routing rule Megatron-Core shares with DeepSeek-V3 only
when ``topk // group_topk == 2``."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hf_deepseek_v3_worker import (build_reference, fp8_checkpoint, hf_logits, random_configs, run_ep, run_random,
                                   run_single, run_variants, tiny_hf_config)
from megatron_llep.testing.distributed import run_distributed
from recipes.hf.rules import ConversionError
from recipes.hf.tables.deepseek_v3 import hf_config_from_recipe, recipe_from_hf_config
from recipes.models import DEEPSEEK_V3_SIZES, check_deepseek_group_routing, config_fields, deepseek_v3

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max())


def _tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, file)))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    interleaved, plain = str(root / "hf"), str(root / "hf_plain_rope")
    ref = build_reference(interleaved, tiny_hf_config(rope_interleave=True))
    plain_ref = build_reference(plain, tiny_hf_config(rope_interleave=False), seed=4321)
    # the non-interleaved checkpoint under a config.json that claims the interleaved layout
    flipped = str(root / "hf_plain_rope_claimed_interleaved")
    shutil.copytree(plain, flipped)
    with open(os.path.join(flipped, "config.json"), "w") as f:
        json.dump(tiny_hf_config(rope_interleave=True), f)
    fp8 = {}
    for block in ((128, 128), (16, 16)):  # the release's blocks (one partial block here), and several per weight
        directory = str(root / f"hf_fp8_{block[0]}")
        fp8[directory] = fp8_checkpoint(interleaved, directory, block)
    return dict(root=root, interleaved=interleaved, plain=plain, flipped=flipped, ref=ref, plain_ref=plain_ref, fp8=fp8)


@pytest.fixture(scope="module")
def ep2(checkpoints):
    export_dir = str(checkpoints["root"] / "export")
    per_rank = run_distributed(run_ep, 2, checkpoints["interleaved"], checkpoints["ref"]["ids"], export_dir,
                               timeout_s=300)
    return per_rank, export_dir


@pytest.fixture(scope="module")
def single(checkpoints):
    (out,) = run_distributed(run_single, 1, checkpoints["interleaved"], checkpoints["plain"], checkpoints["flipped"],
                             checkpoints["plain_ref"]["ids"], sorted(checkpoints["fp8"]), timeout_s=300)
    return out


def test_logits_match_transformers_at_ep2_with_llep_spilling(checkpoints, ep2):
    per_rank, _ = ep2
    ref = checkpoints["ref"]
    for rank, out in enumerate(per_rank):
        main_err = rel_err(out["main"], ref["logits"][rank:rank + 1])
        mtp_err = rel_err(out["mtp"], ref["mtp_logits"][rank:rank + 1])
        print(f"EP=2 rank {rank}: logits rel err {main_err:.2e}, MTP logits rel err {mtp_err:.2e}")
        assert main_err <= TOL and mtp_err <= TOL
        assert torch.equal(out["alone"], out["main"])  # MTP skipped: the same main logits
        # 3 decoder MoE layers + the MTP layer's, routing naturally imbalanced by the selection bias
        assert out["modes"] == ["llep"] * 4, out["modes"]


def test_logits_match_transformers_at_the_smallest_layout(checkpoints, single):
    ref = checkpoints["plain_ref"]
    main_err, mtp_err = rel_err(single["main"], ref["logits"]), rel_err(single["mtp"], ref["mtp_logits"])
    print(f"EP=1, rope_interleave=false: logits rel err {main_err:.2e}, MTP logits rel err {mtp_err:.2e}")
    assert main_err <= TOL and mtp_err <= TOL
    assert torch.equal(single["alone"], single["main"])
    # the interleaved checkpoint at EP=1 too (on the other checkpoint's ids)
    assert rel_err(single["interleaved_main"], hf_logits(checkpoints["interleaved"], ref["ids"])) <= TOL


def test_mtp_layer_can_be_left_out(single):
    """recipe_from_hf_config(..., drop_mtp=True): the checkpoint's MTP layer is ignored, and the
    model, called plainly without labels, gives the same main logits."""
    assert not single["no_mtp_has_mtp"]
    assert torch.equal(single["no_mtp_main"], single["interleaved_main"])


def test_negative_controls_fail_the_comparison(checkpoints, ep2, single):
    per_rank, _ = ep2
    errors = {
        "selection bias dropped": max(rel_err(out["no_bias_main"], checkpoints["ref"]["logits"][r:r + 1])
                                      for r, out in enumerate(per_rank)),
        "rope layout claimed wrong": rel_err(single["rope_claim_flipped"], checkpoints["plain_ref"]["logits"]),
        "rope/nope split swapped": rel_err(single["rope_nope_swapped"], single["interleaved_main"]),
    }
    print("negative controls:", {k: f"{v:.2e}" for k, v in errors.items()})
    for name, err in errors.items():
        assert err > 1e-2, f"{name}: rel err {err:.2e} — the parity test would not notice"


def test_export_reproduces_the_checkpoint_and_transformers_loads_it(checkpoints, ep2):
    _, export_dir = ep2
    original, exported = _tensors(checkpoints["interleaved"]), _tensors(export_dir)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, (name, exported[name].dtype, tensor.dtype)
        assert torch.equal(exported[name], tensor), name
    with open(os.path.join(export_dir, "config.json")) as f, \
            open(os.path.join(checkpoints["interleaved"], "config.json")) as g:
        assert json.load(f) == json.load(g) == tiny_hf_config()
    ref = checkpoints["ref"]
    assert rel_err(hf_logits(export_dir, ref["ids"]), ref["logits"]) <= TOL


def test_fp8_checkpoint_imports_dequantized(checkpoints, single):
    from recipes.hf.rules import TRANSFORMS, Context, _Family

    family = _Family("deepseek-v3")
    originals = _tensors(checkpoints["interleaved"])
    for directory, dequantized in checkpoints["fp8"].items():
        with open(os.path.join(directory, "config.json")) as f:
            hf_config = json.load(f)
        values = {**originals, **dequantized}

        class Read:
            def __call__(self, name):
                return values[name].float()

            def has(self, name):
                return name in values

        params = single[directory]
        checked = 0
        for canonical, tensor in params.items():
            found = family.find(canonical)
            if found is None:
                continue
            rule, groups = found
            names = family.hf_names(rule, groups, hf_config)
            ctx = Context(config=None, hf_config=hf_config, dtype=torch.float32, megatron_name=canonical,
                          hf_names=names, groups=groups)
            expected = TRANSFORMS[rule.transform_name].to_megatron(Read(), names, ctx)
            assert torch.equal(tensor, expected), canonical
            checked += any(n in dequantized for n in names)
        assert checked >= 30  # the MLA projections, dense/expert/shared MLPs and eh_proj of every layer
        quantized = sum(t.dtype == torch.float8_e4m3fn for t in _tensors(directory).values())
        assert quantized == len(dequantized)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Configs of shapes other than the recipe's: rms_norm_eps 1e-5 (MLA's latent norms keep
    DeepSeek's fixed 1e-6) and no query LoRA (q_lora_rank null, DeepSeek-V2-Lite style)."""
    root = tmp_path_factory.mktemp("deepseek_v3_variants")
    configs = {"eps": tiny_hf_config(rms_norm_eps=1e-5), "no_q_lora": tiny_hf_config(q_lora_rank=None)}
    refs = {}
    for name, config in configs.items():
        # latent activations of RMS ~ 1/32: 1e-5 vs 1e-6 in their norms shows in the logits
        refs[name] = build_reference(str(root / name), config, seed=99, latent_scale=1 / 32 if name == "eps" else 1.0)
    (out,) = run_distributed(run_variants, 1, [(str(root / n), refs[n]["ids"]) for n in configs],
                             str(root / "eps"), timeout_s=300)
    return {name: (refs[name], out[str(root / name)]) for name in configs} | {"control": out["latent_eps_control"]}


@pytest.mark.parametrize("name", ["eps", "no_q_lora"])
def test_other_config_shapes_match_transformers(variants, name):
    ref, out = variants[name]
    main_err, mtp_err = rel_err(out["main"], ref["logits"]), rel_err(out["mtp"], ref["mtp_logits"])
    print(f"{name}: logits rel err {main_err:.2e}, MTP logits rel err {mtp_err:.2e}")
    assert main_err <= TOL and mtp_err <= TOL
    if name == "no_q_lora":  # one plain q_proj, no query norm
        attention = [p for p in out["params"] if p.startswith("decoder.layers.0.self_attention.")]
        assert "decoder.layers.0.self_attention.linear_q_proj.weight" in attention
        assert not any("q_layernorm" in p or "linear_q_up_proj" in p or "q_down" in p for p in attention), attention


def test_latent_norm_eps_control_fails_the_comparison(variants):
    """Negative control: MLA's latent norms at Megatron's default (rms_norm_eps = 1e-5) differ."""
    ref, _ = variants["eps"]
    err = rel_err(variants["control"], ref["logits"])
    print(f"latent norms at rms_norm_eps: logits rel err {err:.2e}")
    assert err > 1e-3


RANDOM_CONFIGS = 4  # drawn per run (seeded: the same every run)


@pytest.fixture(scope="module")
def random_shapes(tmp_path_factory):
    """Property-based parity: configs drawn over the fields a published DeepSeek-V3-family
    config.json may vary (hf_deepseek_v3_worker.random_configs), each a random transformers model
    imported at EP = 1."""
    root = tmp_path_factory.mktemp("deepseek_v3_random")
    configs = random_configs(RANDOM_CONFIGS, seed=2027)
    refs, cases = [], []
    for k, config in enumerate(configs):
        directory = str(root / f"c{k}")
        refs.append(build_reference(directory, config, seed=100 + k, mtp_tensors=bool(config["num_nextn_predict_layers"])))
        cases.append((directory, refs[-1]["ids"]))
    outs = run_distributed(run_random, 1, cases, timeout_s=300)[0]
    return configs, refs, outs


@pytest.mark.parametrize("k", range(RANDOM_CONFIGS))
def test_random_config_shapes_match_transformers(random_shapes, k):
    configs, refs, outs = random_shapes
    config, ref, out = configs[k], refs[k], outs[k]
    shown = {f: config.get(f) for f in ("num_hidden_layers", "first_k_dense_replace", "num_attention_heads",
                                         "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group",
                                         "topk_group", "rms_norm_eps", "rope_interleave", "num_nextn_predict_layers")}
    shown["rope"] = (config.get("rope_scaling") or {}).get("type", "default")
    main_err = rel_err(out["main"], ref["logits"])
    mtp_err = rel_err(out["mtp"], ref["mtp_logits"]) if out["mtp"] is not None else 0.0
    print(f"config {k} {shown}: logits rel err {main_err:.2e}, MTP {mtp_err:.2e}")
    assert main_err <= TOL and mtp_err <= TOL, shown


def test_random_configs_vary_the_fields():
    """The draw is not vacuous: over a larger seeded sample every varied field takes several values."""
    configs = random_configs(24, seed=2027)
    for field in ("num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "q_lora_rank",
                  "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "rms_norm_eps",
                  "rope_interleave", "num_nextn_predict_layers", "v_head_dim"):
        assert len({c[field] for c in configs}) >= 2, field
    assert {bool(c.get("rope_scaling")) for c in configs} == {True, False}
    assert any(c["topk_group"] < c["n_group"] for c in configs)  # group limiting exercised
    for c in configs:
        recipe_from_hf_config(c, cpu=True)  # each is one Megatron-Core reproduces


# ---------------------------------------------------------------------------------------------
# config translation (no processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant, recipe", [("tiny", "deepseek-v3-tiny"), ("671b", "deepseek-v3")])
def test_config_round_trip(variant, recipe):
    original = deepseek_v3(variant, cpu=True)
    rebuilt = recipe_from_hf_config(hf_config_from_recipe(original), recipe=recipe, cpu=True)
    a, b = config_fields(original.config), config_fields(rebuilt.config)
    assert {k for k in a if a[k] != b[k]} <= {"init_method", "output_layer_init_method", "embedding_init_method"}
    assert (rebuilt.vocab_size, rebuilt.max_sequence_length) == (original.vocab_size, original.max_sequence_length)


RELEASE_CONFIG = {  # deepseek-ai/DeepSeek-V3 config.json (the fields that matter here)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}


def test_release_config_is_the_deepseek_v3_recipe():
    recipe = recipe_from_hf_config(RELEASE_CONFIG, recipe="deepseek-v3", ep_size=64)
    spec = deepseek_v3("671b", ep_size=64)
    a, b = config_fields(recipe.config), config_fields(spec.config)
    assert {k for k in a if a[k] != b[k]} <= {"init_method", "output_layer_init_method", "embedding_init_method"}


def test_contradictions_are_one_error_naming_the_fields():
    bad = dict(RELEASE_CONFIG, num_hidden_layers=4, rope_scaling=dict(RELEASE_CONFIG["rope_scaling"], factor=8))
    with pytest.raises(ConversionError) as err:
        recipe_from_hf_config(bad, recipe="deepseek-v3")
    assert "num_hidden_layers = 4" in str(err.value) and "rope_scaling.factor = 8" in str(err.value)
    with pytest.raises(ConversionError, match="num_experts_per_tok = 8 contradicts the explicit value moe_router_topk"):
        recipe_from_hf_config(RELEASE_CONFIG, moe_router_topk=6)
    with pytest.raises(ConversionError, match="norm_topk_prob = false") as err:
        recipe_from_hf_config(dict(RELEASE_CONFIG, norm_topk_prob=False, hidden_act="gelu"))
    assert "hidden_act = 'gelu'" in str(err.value)
    # DeepSeek-V2-style group scoring Megatron-Core cannot reproduce: 8 // 2 = 4 experts per group score
    with pytest.raises(ConversionError, match="num_experts_per_tok // topk_group = 8 // 2 = 4"):
        recipe_from_hf_config(dict(RELEASE_CONFIG, topk_group=2))
    # another head of the same model_type; a config.json without architectures is taken by its model_type
    with pytest.raises(ConversionError, match=r"architectures = \['DeepseekV3Model'\], expected "
                                              r"\['DeepseekV3ForCausalLM'\]"):
        recipe_from_hf_config(dict(RELEASE_CONFIG, architectures=["DeepseekV3Model"]), recipe="deepseek-v3")
    unnamed = {k: v for k, v in RELEASE_CONFIG.items() if k != "architectures"}
    assert recipe_from_hf_config(unnamed, recipe="deepseek-v3").config.num_layers == 61
    # deepseek-v3-tiny takes any size from config.json (as gpt-oss-tiny does)
    assert recipe_from_hf_config(RELEASE_CONFIG, recipe="deepseek-v3-tiny").config.num_layers == 61
    # transformers 5's rope_parameters form reads the same
    modern = {k: v for k, v in RELEASE_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    modern["rope_parameters"] = dict(RELEASE_CONFIG["rope_scaling"], rope_type="yarn", rope_theta=10000)
    assert recipe_from_hf_config(modern, recipe="deepseek-v3").config.rotary_scaling_factor == 40


def test_group_routing_rule_is_asserted():
    with pytest.raises(ValueError, match="moe_router_topk // moe_router_group_topk = 2 // 2 = 1"):
        deepseek_v3("tiny", sizes=dict(DEEPSEEK_V3_SIZES["tiny"], moe_router_num_groups=4, moe_router_group_topk=2))
    check_deepseek_group_routing(8, 8, 4, 256)  # DeepSeek-V3
    tiny = deepseek_v3("tiny", cpu=True).config
    check_deepseek_group_routing(tiny.moe_router_topk, tiny.moe_router_num_groups, tiny.moe_router_group_topk,
                                 tiny.num_moe_experts)
    assert tiny.moe_router_group_topk < tiny.moe_router_num_groups  # the rule is exercised, not vacuous


def test_gated_fc1_is_laid_out_per_tensor_parallel_rank():
    """TP = 2 and expert TP = 2: rank r's contiguous half of linear_fc1 is [gate_r; up_r] (the whole
    model at TP = 2 against transformers: tests/hf/test_hf_tensor_parallel.py)."""
    from types import SimpleNamespace

    from recipes.hf.rules import TRANSFORMS, Context

    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    values = {"g": gate, "u": up}

    class Read:
        def __call__(self, name):
            return values[name]

        def has(self, name):
            return name in values

    transform = TRANSFORMS["deepseek_gate_up"]
    for groups, config in (({"layer": 0}, SimpleNamespace(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)),
                           ({"layer": 1, "expert": 3}, SimpleNamespace(tensor_model_parallel_size=1,
                                                                       expert_tensor_parallel_size=2))):
        ctx = Context(config=config, hf_config={}, dtype=torch.float32, megatron_name="x", hf_names=("g", "u"),
                      groups=groups)
        full = transform.to_megatron(Read(), ("g", "u"), ctx)
        for r, local in enumerate(full.chunk(2)):
            assert torch.equal(local, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]))
        back = transform.to_hf(full, ctx)
        assert torch.equal(back["g"], gate) and torch.equal(back["u"], up)


# ---------------------------------------------------------------------------------------------
# python -m recipes.hf import / export, and damaged checkpoints
# ---------------------------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _no_warnings(result):
    """Only the entry point's own lines: no Python warning, no traceback."""
    text = result.stdout + result.stderr
    assert "Warning" not in text and "warnings.warn" not in text and "Traceback" not in text, text[-3000:]


def test_cli_round_trip_keeps_the_source_config(tmp_path):
    """import -> export of a checkpoint with rope_interleave false and a non-recipe
    initializer_range: the same config.json, the same tensors bit for bit, transformers' logits;
    the CLI prints its own lines only (Megatron's CPU warnings quieted)."""
    source, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    config = tiny_hf_config(rope_interleave=False, initializer_range=0.02)
    ref = build_reference(source, config, seed=7)
    result = _run(["-m", "recipes.hf", "import", "--hf", source, "--recipe", "deepseek-v3-tiny", "--out", ckpt])
    assert result.returncode == 0, result.stderr[-3000:]
    _no_warnings(result)
    result = _run(["-m", "recipes.hf", "export", "--load", ckpt, "--out", out, "--dtype", "bf16"])
    assert result.returncode == 0, result.stderr[-3000:]
    _no_warnings(result)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == config
    original, exported = _tensors(source), _tensors(out)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], t) and exported[n].dtype == t.dtype for n, t in original.items())
    assert rel_err(hf_logits(out, ref["ids"]), ref["logits"]) <= TOL


def test_cli_import_without_mtp_tensors_needs_hf_drop_mtp(tmp_path, capsys):
    """transformers' save_pretrained keeps num_nextn_predict_layers but writes no MTP layer: the
    import names --hf-drop-mtp in one line (exit 2), and imports with it; the flag is also one of
    every --hf-checkpoint entry point's."""
    from recipes import evaluate, finetune, generate

    source, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    build_reference(source, tiny_hf_config(), seed=8, mtp_tensors=False)
    base = ["-m", "recipes.hf", "import", "--hf", source, "--recipe", "deepseek-v3-tiny", "--out", ckpt]
    result = _run(base)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line.startswith("[recipes.hf] error:") and "model.layers.4.enorm.weight" in line and "--hf-drop-mtp" in line
    result = _run([*base, "--hf-drop-mtp"])
    assert result.returncode == 0, result.stderr[-3000:]
    _no_warnings(result)
    assert "--hf-drop-mtp" not in result.stdout  # resuming needs no flag: the checkpoint records no MTP layer
    for module in (finetune, evaluate, generate):
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        assert "--hf-drop-mtp" in capsys.readouterr().out, module.__name__


def _damage(directory: str, case: str) -> str:
    """Damage one shard of a two-shard checkpoint; returns the damaged file."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shard = os.path.join(directory, "model-00002-of-00002.safetensors")
    if case == "truncated":
        os.truncate(shard, os.path.getsize(shard) - 100)
    elif case == "header overwritten":
        with open(shard, "r+b") as f:
            f.seek(8)
            f.write(b"#" * 32)
    else:  # the index names a tensor the shard lacks
        index["weight_map"]["model.layers.0.self_attn.q_a_proj.weight"] = os.path.basename(shard)
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    return shard


DAMAGE = ("truncated", "header overwritten", "index names a tensor the shard lacks")


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_safetensors_are_one_error_naming_the_file(checkpoints, tmp_path, case):
    from recipes.hf.checkpoint import HFCheckpoint, HFCheckpointError

    directory = str(tmp_path / "hf")
    shutil.copytree(checkpoints["interleaved"], directory)
    shard = _damage(directory, case)
    with pytest.raises(HFCheckpointError) as err:
        with HFCheckpoint(directory) as ckpt:
            for name in ckpt.names():
                ckpt.get(name)
    message = str(err.value)
    assert message.startswith(shard) and "\n" not in message, message


def test_damaged_checkpoint_at_an_entry_point_is_one_line_from_rank_0(checkpoints, tmp_path):
    """evaluate.py --hf-checkpoint on 2 ranks with a shard its index misdescribes: one line, exit 2."""
    directory = str(tmp_path / "hf")
    shutil.copytree(checkpoints["interleaved"], directory)
    shard = _damage(directory, DAMAGE[2])
    data = tmp_path / "valid.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * 20}) + "\n" for i in range(8)))
    result = _run(["launch/torchrun.py", "--nproc_per_node", "2", "recipes/evaluate.py", "--recipe",
                   "deepseek-v3-tiny", "--hf-checkpoint", directory, "--data", str(data), "--seq-length", "32"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if shard in ln]
    assert len(errors) == 1 and "lacks 1 tensor(s)" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
