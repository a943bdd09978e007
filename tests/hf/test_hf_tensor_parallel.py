"""Hugging Face import and export under tensor parallelism (CPU, gloo): tiny random gpt-oss and
DeepSeek-V3 transformers models imported at TP = 2 and TP = 2 x EP = 2 (LLEP layers), logits
against transformers' (fp32, the parity tests' tolerance), every rank reading only its own
parameters' bytes (the embedding and output layer as vocabulary shards); export bit-identical to
the original bf16 tensors; the MXFP4 export's logit check. Negative controls: one parameter's
partition dim flipped (row vs column) is refused on import and makes that tensor differ on export;
DeepSeek-V3's gate/up rank-block layout dropped breaks the logits. Transformer Engine parameter names (listed from
Megatron-Core's TE specs) map to the same Hugging Face tensors as the local spec's."""

import re

import pytest
import torch

import hf_deepseek_v3_worker as DS
import hf_gpt_oss_worker as GO
import hf_tensor_parallel_worker as W
from megatron_llep.testing.distributed import run_distributed

GPT_OSS_TOLERANCE = 1e-5  # tests/hf/test_hf_gpt_oss.py
DEEPSEEK_TOLERANCE = 1e-5  # tests/hf/test_hf_deepseek_v3.py
LAYOUTS = {"tp2": (2, 1), "tp2_ep2": (2, 2)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp")
    gpt_oss_dir, deepseek_dir = str(root / "gpt_oss"), str(root / "deepseek_v3")
    gpt_oss_model = GO.save_tiny_model(gpt_oss_dir, str(root / "gpt_oss_mxfp4"))
    gpt_oss_ids = GO.token_ids()
    deepseek_ref = DS.build_reference(deepseek_dir, DS.tiny_hf_config())
    return dict(root=root, mxfp4=str(root / "gpt_oss_mxfp4"), refs={
        "gpt-oss": (gpt_oss_dir, gpt_oss_ids, GO.reference_logits(gpt_oss_model, gpt_oss_ids), GPT_OSS_TOLERANCE),
        "deepseek-v3": (deepseek_dir, deepseek_ref["ids"], deepseek_ref["logits"], DEEPSEEK_TOLERANCE)})


@pytest.fixture(scope="module")
def launches(checkpoints):
    """One launch per layout, both families in it (each import and export once)."""
    results = {}
    for layout, (tp, ep) in LAYOUTS.items():
        jobs = []
        for family, (hf_dir, ids, reference, _) in checkpoints["refs"].items():
            root = checkpoints["root"] / f"{family}_{layout}"
            jobs.append(W.Job(family, hf_dir, ids, reference, tp, ep, str(root / "export"),
                              str(root / "export_wrong_dim"), checkpoints["mxfp4"] if family == "gpt-oss" else None))
        per_rank = run_distributed(W.run, tp * ep, jobs, timeout_s=300)
        for k, job in enumerate(jobs):
            results[job.family, layout] = [rank_results[k] for rank_results in per_rank]
    return results


@pytest.fixture(params=[(f, l) for f in ("gpt-oss", "deepseek-v3") for l in LAYOUTS], ids=lambda p: f"{p[0]}-{p[1]}")
def launch(request, checkpoints, launches):
    family, layout = request.param
    tp, ep = LAYOUTS[layout]
    root = checkpoints["root"] / f"{family}_{layout}"
    return dict(job=W.Job(family, checkpoints["refs"][family][0], None, None, tp, ep, str(root / "export"),
                          str(root / "export_wrong_dim")),
                results=launches[family, layout], tolerance=checkpoints["refs"][family][3])


def test_logits_match_transformers(launch):
    for rank, res in enumerate(launch["results"]):
        assert res["err"] <= launch["tolerance"], (rank, res["err"])
        assert res["err_after_controls"] <= launch["tolerance"], (rank, res["err_after_controls"])


def test_vocabulary_matrices_are_read_as_shards(launch):
    """Each rank reads 1/TP of the embedding and of the output layer (bf16 on disk), not all."""
    job = launch["job"]
    original = W.checkpoint_tensors(job.hf_dir)
    for res in launch["results"]:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            whole = original[name].numel() * original[name].element_size()
            assert res["bytes_by_tensor"][name] == whole // job.tp, (name, res["bytes_by_tensor"][name], whole)


def test_export_reproduces_the_checkpoint(launch):
    original = W.checkpoint_tensors(launch["job"].hf_dir)
    assert W.first_difference(original, W.checkpoint_tensors(launch["job"].export_dir)) is None


def test_the_quantized_exports_logit_check_runs_on_vocabulary_shards(launches):
    """gpt-oss's MXFP4 export check at TP = 2 and TP = 2 x EP = 2 (the embedding and output layer
    read back as vocabulary shards): the untouched import's quantized round trip computes exactly
    its logits (the tiny DeepSeek-V3 here is bf16; its FP8 check: tests/hf/test_hf_quant_export.py)."""
    for layout in LAYOUTS:
        for res in launches["gpt-oss", layout]:
            assert res["logit_check_max_abs"] == 0.0, layout


def test_wrong_partition_dim_fails(launch):
    for res in launch["results"]:
        assert "(TP partition)" in (res["wrong_dim_import_error"] or ""), res["wrong_dim_import_error"]
    original = W.checkpoint_tensors(launch["job"].hf_dir)
    exported = W.checkpoint_tensors(launch["job"].wrong_dim_export_dir)
    assert W.first_difference(original, exported) == W.WRONG_DIM_HF_TENSOR
    if launch["job"].family == "deepseek-v3":
        for res in launch["results"]:
            assert res["gate_up_unblocked_err"] > 1e-2, res["gate_up_unblocked_err"]


# ---------------------------------------------------------------------------------------------
# Transformer Engine parameter names (TE cannot run here: the names are checked, not the modules)
# ---------------------------------------------------------------------------------------------

EXPERTS, EP_RANK, LOCAL_EXPERTS = 8, 1, 4  # this rank holds global experts 4..7 as local 0..3

# One layer's parameters as Megatron-Core's Transformer Engine specs name them
# (models/gpt/gpt_layer_specs.py with extensions/transformer_engine_spec_provider.py, 0.16-0.19:
# TELayerNormColumnParallelLinear adds ``layer_norm_weight`` to linear_qkv / linear_fc1 /
# linear_q_up_proj / linear_kv_up_proj, TEGroupedMLP names ``linear_fc1.weight{local expert}``).
TE_GPT_OSS_LAYER = [
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias", "self_attention.core_attention.softmax_offset",
    "pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.router.bias",
    *(f"mlp.experts.linear_fc{n}.{kind}{j}" for n in (1, 2) for kind in ("weight", "bias") for j in range(LOCAL_EXPERTS)),
]
TE_MLA_ATTENTION = [
    "input_layernorm.weight", "self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.weight",
    "self_attention.linear_proj.weight",
]
TE_DEEPSEEK_DENSE_LAYER = [*TE_MLA_ATTENTION, "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
                           "mlp.linear_fc2.weight"]
TE_DEEPSEEK_MOE_LAYER = [
    *TE_MLA_ATTENTION, "pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.router.expert_bias",
    *(f"mlp.experts.linear_fc{n}.weight{j}" for n in (1, 2) for j in range(LOCAL_EXPERTS)),
    "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
]
TOP_LEVEL = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
MTP = ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
       "mtp.layers.0.final_layernorm.weight"]

# the Hugging Face tensors the fused norms and grouped experts stand for (the released layouts)
TE_ONLY_EXPECTED = {
    ("gpt-oss", "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"): ("model.layers.1.input_layernorm.weight",),
    ("gpt-oss", "decoder.layers.1.mlp.experts.linear_fc1.weight0"): ("model.layers.1.mlp.experts.gate_up_proj",),
    ("gpt-oss", "decoder.layers.1.mlp.experts.linear_fc2.bias3"): ("model.layers.1.mlp.experts.down_proj_bias",),
    ("deepseek-v3", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"):
        ("model.layers.0.post_attention_layernorm.weight",),
    ("deepseek-v3", "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight"):
        ("model.layers.1.self_attn.q_a_layernorm.weight",),
    ("deepseek-v3", "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight"):
        ("model.layers.1.self_attn.kv_a_layernorm.weight",),
    ("deepseek-v3", "decoder.layers.1.mlp.experts.linear_fc1.weight2"):
        ("model.layers.1.mlp.experts.6.gate_proj.weight", "model.layers.1.mlp.experts.6.up_proj.weight"),
    ("deepseek-v3", "mtp.layers.0.transformer_layer.mlp.experts.linear_fc2.weight1"):
        ("model.layers.2.mlp.experts.5.down_proj.weight",),
}
# the fused norms and grouped experts; every other TE name is the local spec's name
TE_TO_LOCAL = [
    (r"self_attention\.linear_qkv\.layer_norm_weight$", "input_layernorm.weight"),
    (r"mlp\.linear_fc1\.layer_norm_weight$", "pre_mlp_layernorm.weight"),
    (r"linear_q_up_proj\.layer_norm_weight$", "q_layernorm.weight"),
    (r"linear_kv_up_proj\.layer_norm_weight$", "kv_layernorm.weight"),
    (r"experts\.(linear_fc[12])\.(weight|bias)(\d+)$", r"experts.local_experts.\3.\1.\2"),
]


def _te_names(family: str) -> list:
    if family == "gpt-oss":  # two MoE layers (the second is layer 1)
        layers = [f"decoder.layers.{i}.{n}" for i in range(2) for n in TE_GPT_OSS_LAYER]
        return TOP_LEVEL + layers
    layers = [f"decoder.layers.0.{n}" for n in TE_DEEPSEEK_DENSE_LAYER]
    layers += [f"decoder.layers.1.{n}" for n in TE_DEEPSEEK_MOE_LAYER]
    return TOP_LEVEL + layers + MTP + [f"mtp.layers.0.transformer_layer.{n}" for n in TE_DEEPSEEK_MOE_LAYER]


def _local_name(te_name: str) -> str:
    for pattern, local in TE_TO_LOCAL:
        te_name = re.sub(pattern, local, te_name)
    return te_name


def _chunk_with(names: list) -> torch.nn.Module:
    """A module tree holding a one-element parameter under each name (the router's expert_bias
    a buffer), with the attributes canonical names read: each decoder layer's layer_number and
    each MoE layer's local_expert_indices (this EP rank's experts)."""
    root = torch.nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        if leaf == "expert_bias":
            module.register_buffer(leaf, torch.zeros(1))
        else:
            module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(1)))
    for name, module in root.named_modules():
        layer = re.fullmatch(r"decoder\.layers\.(\d+)", name)
        if layer:
            module.layer_number = int(layer[1]) + 1
        if name.endswith(".mlp") and hasattr(module, "experts"):
            module.local_expert_indices = list(range(EP_RANK * LOCAL_EXPERTS, (EP_RANK + 1) * LOCAL_EXPERTS))
    return root


def _hf_names_by_parameter(family: str, names: list) -> dict:
    """Megatron name -> the HF names import reads and export writes for it (None: no rule)."""
    from recipes.hf.rules import canonical_entries, _Family

    table = _Family(family)
    hf_config = {"num_hidden_layers": 2}
    out = {}
    for entry in canonical_entries(_chunk_with(names)):
        found = table.find(entry.canonical)
        out[entry.local_name] = None if found is None else table.hf_names(*found, hf_config)
    return out


@pytest.mark.parametrize("family", ["gpt-oss", "deepseek-v3"])
def test_transformer_engine_names_map_like_the_local_spec(family):
    te_names = _te_names(family)
    te = _hf_names_by_parameter(family, te_names)
    local = _hf_names_by_parameter(family, [_local_name(n) for n in te_names])
    assert sorted(te) == sorted(te_names)  # every TE parameter (and the bias buffer) has an entry
    for name in te_names:
        assert te[name] is not None, f"{name}: no rule"
        assert te[name] == local[_local_name(name)], name
    for (fam, name), expected in TE_ONLY_EXPECTED.items():
        if fam == family:
            assert te[name] == expected, name


def test_a_transformer_engine_name_without_its_rule_is_refused(monkeypatch, tmp_path):
    """Negative control: the fused input norm's rule taken out of the gpt-oss table; import and
    export both refuse the parameter."""
    from safetensors.torch import save_file

    from recipes.hf.tables import gpt_oss
    from recipes.hf.exporting import export_hf_checkpoint
    from recipes.hf.importing import import_hf_checkpoint
    from recipes.hf.rules import ConversionError

    monkeypatch.setattr(gpt_oss, "MAPPING", [r for r in gpt_oss.MAPPING if not r.megatron.endswith(
        "linear_qkv.layer_norm_weight")])
    assert _hf_names_by_parameter("gpt-oss", _te_names("gpt-oss"))[
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] is None
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    save_file({"lm_head.weight": torch.zeros(1)}, str(hf_dir / "model.safetensors"))
    refused = r"decoder\.layers\.0\.self_attention\.linear_qkv\.layer_norm_weight .*has no rule"
    with pytest.raises(ConversionError, match=refused):
        import_hf_checkpoint(_chunk_with(_te_names("gpt-oss")), str(hf_dir), "gpt-oss", verbose=False)
    with pytest.raises(ConversionError, match=refused):
        export_hf_checkpoint(_chunk_with(_te_names("gpt-oss")), "gpt-oss", str(tmp_path / "out"), {}, verbose=False)
