"""Export in the published precision (recipes.hf.quantization.quantize_* / ExportQuantizer, the export
path of recipes.hf.exporting): gpt-oss's MXFP4 experts and DeepSeek-V3's block FP8 weights.

References are independent of the code under test: quantizers written here in float64 (and
DeepSeek's amax / 448 rule as tests/hf/test_hf_quant.py writes it), transformers' own dequantizers and
model classes loading the exported directories, and the source checkpoints' raw bits. Negative
controls: a flipped nibble, a scale one exponent off, a doubled scale_inv fail the comparisons.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
from typing import Optional

import pytest
import torch


import hf_deepseek_v3_worker as D  # noqa: E402
import hf_gpt_oss_worker as W  # noqa: E402
import hf_quant_export_worker as Q  # noqa: E402
from test_hf_quant import quantize_fp8, same_bits  # noqa: E402

from megatron_llep.testing.distributed import run_distributed  # noqa: E402
from recipes.hf.quantization import (QuantStats, dequantize_fp8_blockwise, dequantize_mxfp4, quantize_fp8_blockwise,  # noqa: E402
                              quantize_mxfp4)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)  # codes 0..126: 0 .. 448


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _nearest(magnitudes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float64 magnitudes -> index of the nearest ``table`` entry by distance to every one (above
    the last: the last), ties to the even index (the even code: E2M1, e4m3)."""
    dist = (magnitudes[..., None] - table).abs()
    ties = dist == dist.min(-1, keepdim=True).values
    even_tied = torch.where(ties[..., 0::2], torch.arange(0, table.numel(), 2), table.numel()).min(-1).values
    return torch.where(ties.sum(-1) > 1, even_tied, dist.argmin(-1))


def reference_mxfp4(x: torch.Tensor, source_scales: Optional[torch.Tensor] = None) -> dict:
    """float64 re-implementation of the export's MXFP4 rule, from its definition: per 32 values the
    candidate exponents are the source's, the OCP MX one floor(log2(amax)) - 2 (log2 here, not
    frexp) and its two neighbours; under each, codes = the nearest E2M1 magnitude (ties to the even
    code, saturating at 6) with the value's sign; the block takes the smallest squared error, the
    earliest candidate on a tie. Returns blocks, scales, the dequantized values (float64) and the
    squared errors of the choice and of plain MX round-to-nearest."""
    *lead, n = x.shape
    g = x.double().reshape(-1, 32)
    amax = g.abs().amax(1)
    mx = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0)).clamp(-127, 127)
    candidates = [mx, (mx + 1).clamp(max=127), (mx - 1).clamp(min=-127)]
    if source_scales is not None:
        candidates.insert(0, source_scales.reshape(-1).double() - 127)
    sign = torch.where(torch.signbit(g), -1.0, 1.0)
    best = None
    for e in candidates:
        index = _nearest((g / torch.exp2(e)[:, None]).abs(), E2M1)
        values = E2M1[index] * sign * torch.exp2(e)[:, None]
        err = (values - g).square().sum(1)
        code = index | (torch.signbit(g).long() << 3)
        if best is None:
            best = dict(err=err, e=e, code=code, values=values)
        else:
            better = err < best["err"]
            for key, new in dict(err=err, e=e, code=code, values=values).items():
                best[key] = torch.where(better[:, None] if new.dim() == 2 else better, new, best[key])
        if e is mx:
            plain = float(err.sum())
    code = best["code"]
    return dict(blocks=(code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).reshape(*lead, n // 32, 16),
                scales=(best["e"] + 127).to(torch.uint8).reshape(*lead, n // 32),
                values=best["values"].reshape(*lead, n), err=float(best["err"].sum()), plain=plain)


def reference_fp8(w: torch.Tensor, block: tuple, source_scale_inv: torch.Tensor) -> dict:
    """float64 re-implementation of the export's FP8 rule: per block, codes = w / scale (float32, as
    DeepSeek divides) clamped to +-448, nearest e4m3 value (ties to the even code) from the decoded
    code table; a block keeps the source scale where the float32 dequantization rounded to w's dtype
    is w bit for bit, else the scale (source's, then amax / 448) with the smaller squared error."""
    bm, bn = block
    rows, cols = w.shape
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    scale_inv = torch.empty(source_scale_inv.shape, dtype=torch.float32)
    values = torch.empty(rows, cols, dtype=torch.float32)
    err_total = plain = 0.0
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            x = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            amax = float(x.float().abs().max())
            options = []
            for scale in (source_scale_inv[i, j].float(), torch.tensor(amax / 448.0 if amax else 1.0)):
                scaled = (x.float() / scale).double().clamp(-448.0, 448.0)
                index = _nearest(scaled.abs(), E4M3)
                code = index.to(torch.uint8) | (torch.signbit(scaled).to(torch.uint8) << 7)
                back = (E4M3[index] * torch.where(torch.signbit(scaled), -1.0, 1.0)).float() * scale
                options.append((float((back.double() - x.double()).square().sum()), scale, code, back))
            exact = torch.equal(options[0][3].to(w.dtype).view(torch.uint8), x.contiguous().view(torch.uint8))
            err, scale, code, back = options[0] if exact or options[0][0] <= options[1][0] else options[1]
            codes[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn], values[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = code, back
            scale_inv[i, j] = scale
            err_total, plain = err_total + err, plain + options[1][0]
    return dict(weight=codes.view(torch.float8_e4m3fn), scale_inv=scale_inv, values=values, err=err_total, plain=plain)


def _trained(values: torch.Tensor, step: float, gen: torch.Generator) -> torch.Tensor:
    """``values`` after a pretend fine-tuning: every value moved by ``step`` up or down (Adam's
    first steps move each weight by about the learning rate)."""
    signs = torch.randint(0, 2, values.shape, generator=gen).to(values.dtype) * 2 - 1
    return values + step * signs


# ---------------------------------------------------------------------------------------------
# the quantizers against independent ones and transformers' dequantization
# ---------------------------------------------------------------------------------------------


def test_mxfp4_export_rule_is_the_float64_reference_and_transformers_loads_it():
    """Without a source (every E8M0 exponent, an all-zero block, every E2M1 tie) and with one
    (a fine-tuned copy of random MXFP4 weights): bits = the float64 reference's; transformers'
    ``convert_moe_packed_tensors`` loads the reference's values; the error of the trained copy is
    the training change (each value back on its source code), below 2x plain MX round-to-nearest.
    Negative controls: a scale one exponent off and a flipped nibble change what transformers loads
    and raise the error."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    def loaded(blocks, scales):  # what GptOssExperts holds is the transpose: back to the stored layout
        return convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t()

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=gen) * torch.exp2(torch.randint(-20, 20, (6, 1), generator=gen).float())
    x[0, :32] = 0.0
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # every tie, amax 6
    x[1, 32:64] = -x[1, :32]
    source_blocks, source_scales = W.random_mxfp4((64, 128), gen)  # the gpt-oss test checkpoints' weights
    trained = _trained(dequantize_mxfp4(source_blocks, source_scales), 1e-3, gen)
    for values, source in ((x, None), (trained, source_scales)):
        stats = QuantStats()
        blocks, scales = quantize_mxfp4(values, source, stats=stats)
        ref = reference_mxfp4(values, source)
        assert torch.equal(blocks, ref["blocks"]) and torch.equal(scales, ref["scales"])
        assert same_bits(loaded(blocks, scales), ref["values"].float())
        assert stats.err_sq == pytest.approx(ref["err"], rel=1e-12)
        assert stats.plain_err_sq == pytest.approx(ref["plain"], rel=1e-12)
    change = float((trained.double() - dequantize_mxfp4(source_blocks, source_scales).double()).square().sum())
    assert stats.relative <= 2 * stats.plain_relative and ref["err"] == pytest.approx(change, rel=1e-9)
    assert stats.reused == stats.blocks  # 1e-3 is far below half an E2M1 step: every block keeps its source scale
    # negative controls, on the trained copy
    off = scales.clone()
    off[5, 2] += 1  # one exponent off
    flipped = blocks.clone()
    flipped[7, 1, 3] ^= 0x10  # one nibble (the high one: the later value)
    for blocks_, scales_ in ((blocks, off), (flipped, scales)):
        wrong = loaded(blocks_, scales_)
        assert not torch.equal(wrong, ref["values"].float())
        assert float((wrong.double() - trained.double()).square().sum()) > 2 * ref["err"]


def test_mxfp4_blocks_training_moved_take_the_scale_that_errs_least():
    """The two blocks each single rule gets wrong, worked by hand: a block whose top value training
    pushed 1 % above 6 x its source scale 2**-2 keeps that scale (saturating it errs 0.015; a fresh
    "amax / scale <= 6" scale 2**-1 would put its 0.375s on 0.5, 0.125 off each), and without a
    source a block whose amax fell just under 4 x 2**-2 takes the MX exponent's neighbour -2 (the
    MX exponent -3 saturates 0.999 to 0.75), and an outlier 4 over 31 values 0.25 takes the other
    neighbour -1 (saturating 4 to 3 errs 1; the MX exponent 0 rounds each 0.25, a tie, to the even
    code 0: 31 x 0.25**2 = 1.94)."""
    top = torch.full((1, 32), 0.375)  # 1.5 x 2**-2
    top[0, 0] = 1.5 * 1.01  # 6 x 2**-2, 1 % up
    stats = QuantStats()
    blocks, scales = quantize_mxfp4(top, torch.tensor([[125]], dtype=torch.uint8), stats=stats)
    assert scales.tolist() == [[125]] and stats.reused == 1
    assert dequantize_mxfp4(blocks, scales)[0, 0] == 1.5 and stats.max_abs == pytest.approx(0.015, rel=1e-6)
    under = torch.full((1, 32), 0.25)
    under[0, 0] = 0.999  # 4 x 2**-2 x (1 - 2.5e-4)
    stats = QuantStats()
    blocks, scales = quantize_mxfp4(under, stats=stats)
    assert scales.tolist() == [[125]] and stats.neighbours == 1
    assert dequantize_mxfp4(blocks, scales)[0, 0] == 1.0
    assert stats.plain_relative > 50 * stats.relative  # the MX exponent alone: 0.999 -> 0.75
    outlier = torch.full((1, 32), 0.25)
    outlier[0, 0] = 4.0
    stats = QuantStats()
    blocks, scales = quantize_mxfp4(outlier, stats=stats)
    assert scales.tolist() == [[126]] and stats.neighbours == 1
    assert stats.err_sq == 1.0 and stats.plain_err_sq == 31 * 0.25**2


def test_fp8_export_rule_is_the_float64_reference_and_transformers_loads_it():
    """A fine-tuned copy of DeepSeek-rule FP8 weights (bf16, as imported on a GPU), one block
    grown 3x (its source scale would saturate it): bits = the float64 reference's, transformers'
    ``Fp8Dequantize`` loads its values, untouched blocks keep the source's bits, the error is at
    most 2x plain amax / 448 round-to-nearest. Negative control: a scale_inv doubled."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(4)
    fp8, source = quantize_fp8(torch.randn(256, 384, generator=gen) * 0.05, (128, 128))
    weight = dequantize_fp8_blockwise(fp8, source, dtype=torch.bfloat16)
    trained = weight.clone()
    trained[:128] = _trained(weight[:128].float(), 5e-4, gen).to(torch.bfloat16)  # row block 0 trained
    trained[128:, 256:] *= 3  # block (1, 2) grown beyond its source scale's range
    stats = QuantStats()
    got, scale_inv = quantize_fp8_blockwise(trained, (128, 128), source, stats=stats)
    ref = reference_fp8(trained, (128, 128), source)
    assert torch.equal(_raw(got), _raw(ref["weight"])) and same_bits(scale_inv, ref["scale_inv"])
    assert same_bits(Fp8Dequantize(None)._dequantize_one(got, scale_inv, output_dtype=torch.float32), ref["values"])
    assert torch.equal(_raw(got[128:, :256]), _raw(fp8[128:, :256])) and same_bits(scale_inv[1, :2], source[1, :2])
    assert not same_bits(scale_inv[1, 2:], source[1, 2:])  # the grown block: amax / 448
    assert stats.reused == 5 and stats.err_sq == pytest.approx(ref["err"], rel=1e-12)
    assert stats.relative <= 2 * stats.plain_relative
    doubled = scale_inv.clone()
    doubled[0, 1] *= 2
    assert not same_bits(Fp8Dequantize(None)._dequantize_one(got, doubled, output_dtype=torch.float32), ref["values"])


def test_fresh_fp8_is_deepseeks_rule():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(300, 200, generator=gen) * 0.05
    weight, scale_inv = quantize_fp8_blockwise(w, (128, 128))
    ref_weight, ref_scale_inv = quantize_fp8(w, (128, 128))
    assert same_bits(scale_inv, ref_scale_inv) and torch.equal(_raw(weight), _raw(ref_weight))
    # negative control: one scale for the whole tensor instead of one per block
    whole = w.abs().max() / 448.0
    assert not torch.equal(_raw(weight), _raw((w / whole).to(torch.float8_e4m3fn)))


@pytest.mark.parametrize("held", ["float32", "bfloat16", "bfloat16 in float32"])
def test_source_scales_give_back_the_source_bits(held):
    """Imported values (dequantized in the import dtype) + the source scales -> the source's bits,
    for every block, including -0.0 codes and a wide range of scales; without the source, the
    same values but not the same bits."""
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (4, 64, 4, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    blocks[0, 0] = 0x08  # -0.0 codes
    blocks[0, 1] &= 0x33  # magnitudes <= 1.5: an ambiguous block (a smaller scale holds it too)
    scales = torch.randint(90, 160, (4, 64, 4), generator=gen, dtype=torch.int32).to(torch.uint8)
    fp8, scale_inv = quantize_fp8(torch.randn(260, 300, generator=gen) * 0.02, (128, 128))
    dtype = torch.float32 if held == "float32" else torch.bfloat16
    values = dequantize_mxfp4(blocks, scales, dtype)
    weight = dequantize_fp8_blockwise(fp8, scale_inv, dtype=dtype)
    if held == "bfloat16 in float32":  # imported on a GPU in bf16, exported from CPU in fp32
        values, weight = values.float(), weight.float()
    stats = QuantStats()
    got_blocks, got_scales = quantize_mxfp4(values, scales, stats=stats)
    assert torch.equal(got_blocks, blocks) and torch.equal(got_scales, scales)
    assert stats.reused == stats.blocks == scales.numel() and stats.max_abs == 0.0
    got_fp8, got_scale_inv = quantize_fp8_blockwise(weight, (128, 128), scale_inv)
    assert torch.equal(_raw(got_fp8), _raw(fp8)) and same_bits(got_scale_inv, scale_inv)
    # without the source: the same MXFP4 values but not the same bits (the ambiguity the source settles)
    fresh_blocks, fresh_scales = quantize_mxfp4(values)
    assert torch.equal(dequantize_mxfp4(fresh_blocks, fresh_scales), values.float())
    assert not torch.equal(fresh_scales, scales)
    if values.dtype == torch.bfloat16:  # amax / 448 of bf16-rounded values is not the source's scale
        assert not same_bits(quantize_fp8_blockwise(weight, (128, 128))[1], scale_inv)
    # negative control: one value one ulp off comes back as the source's value, its error counted
    nudged = values.clone()
    nudged[2, 3, 40] = torch.nextafter(nudged[2, 3, 40], torch.tensor(float("inf"), dtype=nudged.dtype))
    stats = QuantStats()
    got_blocks, got_scales = quantize_mxfp4(nudged, scales, stats=stats)
    assert torch.equal(got_blocks, blocks) and torch.equal(got_scales, scales)
    assert stats.reused == stats.blocks and stats.max_abs == float((nudged[2, 3, 40] - values[2, 3, 40]).abs())



# ---------------------------------------------------------------------------------------------
# import -> export through Megatron-Core (EP = 2), against the source checkpoints and transformers
# ---------------------------------------------------------------------------------------------


def _tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in glob.glob(os.path.join(directory, "*.safetensors")):
        out.update(load_file(file))
    return out


def _same_checkpoint(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape and
                                          torch.equal(_raw(a[n]).view(-1).view(torch.uint8),
                                                      _raw(b[n]).view(-1).view(torch.uint8))
                                          for n in a)


def _shard_by_layer(directory: str) -> None:
    """Rewrite ``directory``'s safetensors as a release lays them out: one shard per decoder layer,
    the rest (embedding, final norm, head) in the last, listed by a new index (a layout no size
    bound gives)."""
    tensors = _tensors(directory)
    for file in glob.glob(os.path.join(directory, "model*.safetensors*")):
        os.remove(file)
    layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")})
    count = len(layers) + 1
    shard_of = {n: f"model-{(int(n.split('.')[2]) if n.startswith('model.layers.') else len(layers)) + 1:05d}-of-"
                   f"{count:05d}.safetensors" for n in tensors}
    from safetensors.torch import save_file

    for file in sorted(set(shard_of.values())):
        save_file({n: t for n, t in tensors.items() if shard_of[n] == file}, os.path.join(directory, file),
                  metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": shard_of}, f)


def _source_layout(directory: str) -> tuple[dict, dict]:
    """The source's own ``weight_map`` and each shard file's tensor names read from its safetensors
    header (an independent reference: the files, not the code's reader)."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    return weight_map, _header_names(directory)


def _header_names(directory: str) -> dict:
    """Shard file -> sorted tensor names, from each safetensors file's JSON header."""
    out = {}
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        out[os.path.basename(file)] = sorted(n for n in header if n != "__metadata__")
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_export")
    gpt_bf16, gpt_mxfp4 = str(root / "gpt_oss_bf16"), str(root / "gpt_oss_mxfp4")
    gpt_model = W.save_tiny_model(gpt_bf16, gpt_mxfp4)
    _shard_by_layer(gpt_mxfp4)
    ds_bf16, ds_fp8 = str(root / "deepseek_bf16"), str(root / "deepseek_fp8")
    D.build_reference(ds_bf16, D.tiny_hf_config(rope_interleave=True))
    # several blocks per weight, all full: transformers' Fp8Dequantize infers the block from the scale grid (the
    # 24-row weight in 16-row blocks would come out in 12-row ones); partial edges: the CLI test
    dequantized = D.fp8_checkpoint(ds_bf16, ds_fp8, (8, 16))
    (results, _) = run_distributed(Q.run, 2, gpt_mxfp4, ds_fp8, str(root), timeout_s=300)
    return dict(root=root, gpt_mxfp4=gpt_mxfp4, gpt_model=gpt_model, ds_bf16=ds_bf16, ds_fp8=ds_fp8,
                ds_dequantized=dequantized, results=results)


def _edited_copy(directory: str, out: str, suffix: str, edit) -> str:
    """A copy of the export ``directory`` at ``out`` with ``edit`` applied in place to the first
    tensor whose name ends with ``suffix``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(directory, out)
    for file in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        tensors = load_file(file)
        name = next((n for n in sorted(tensors) if n.endswith(suffix)), None)
        if name:
            edit(tensors[name])
            save_file(tensors, file, metadata={"format": "pt"})
            return out
    raise AssertionError(f"no tensor ending with {suffix} in {directory}")


def _gpt_oss_logits(directory: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = GptOssForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    return W.reference_logits(model, ids)


def test_gpt_oss_mxfp4_round_trip_is_bit_identical(exported):
    out = os.path.join(exported["root"], "gpt_oss_round_trip")
    source, mine = _tensors(exported["gpt_mxfp4"]), _tensors(out)
    assert _same_checkpoint(source, mine)
    assert any(n.endswith("_blocks") for n in mine) and any(n.endswith("_scales") for n in mine)
    with open(os.path.join(exported["gpt_mxfp4"], "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)  # quantization_config included
    stats = exported["results"]["gpt-oss"]["round_trip"].quantization
    assert sorted(stats) == ["experts down_proj (fc2)", "experts gate_up_proj (fc1)"]
    assert all(s.max_abs == 0.0 and s.reused == s.blocks > 0 for s in stats.values())


def _assert_source_layout(source: str, out: str) -> None:
    """``out``'s index and every shard file's tensor set are the source's."""
    weight_map, headers = _source_layout(source)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert json.load(f)["weight_map"] == weight_map
    assert _header_names(out) == headers
    assert len(headers) > 1


@pytest.mark.parametrize("family, prefix, source", [("gpt-oss", "gpt_oss", "gpt_mxfp4"),
                                                    ("deepseek-v3", "deepseek", "ds_fp8")])
def test_export_with_a_source_keeps_its_shard_layout(exported, family, prefix, source):
    """--quant-source's shards: the round trip and the trained export have the source's index and
    shard files; without a source (fresh scales, fp32) the 64 KiB size bound lays them out, which
    differs (the negative control)."""
    weight_map, headers = _source_layout(exported[source])
    for name in ("round_trip", "tuned"):
        _assert_source_layout(exported[source], os.path.join(exported["root"], f"{prefix}_{name}"))
        assert exported["results"][family][name].notes == []
    fresh = os.path.join(exported["root"], f"{prefix}_fresh")
    with open(os.path.join(fresh, "model.safetensors.index.json")) as f:
        fresh_map = json.load(f)["weight_map"]
    assert sorted(fresh_map) == sorted(weight_map) and fresh_map != weight_map
    assert _header_names(fresh) != headers


def test_writer_layout_single_file_and_tensors_outside_the_source(tmp_path):
    """A single-file source gives one model.safetensors (no index); a tensor the source lacks goes
    to an extra shard with a note; a source tensor that never arrives is named in a note."""
    from safetensors.torch import load_file

    from recipes.hf.checkpoint import EXTRA_SHARD, HFCheckpointWriter

    single = str(tmp_path / "single")
    writer = HFCheckpointWriter(single, layout={"a": "model.safetensors", "b": "model.safetensors"})
    writer.add("b", torch.ones(3))
    writer.add("a", torch.zeros(2))
    assert writer.close() == ["model.safetensors"] and writer.notes == []
    assert sorted(os.listdir(single)) == ["model.safetensors"]
    assert sorted(load_file(os.path.join(single, "model.safetensors"))) == ["a", "b"]

    extra = str(tmp_path / "extra")
    writer = HFCheckpointWriter(extra, layout={"a": "model.safetensors", "gone": "model.safetensors"})
    writer.add("a", torch.zeros(2))
    writer.add("mtp", torch.zeros(2))
    assert sorted(writer.close()) == sorted(["model.safetensors", EXTRA_SHARD])
    assert len(writer.notes) == 2 and "gone" in writer.notes[0] and "mtp" in writer.notes[1]
    with open(os.path.join(extra, "model.safetensors.index.json")) as f:
        assert json.load(f)["weight_map"] == {"a": "model.safetensors", "mtp": EXTRA_SHARD}


def test_transformers_loads_the_mxfp4_export_and_a_flipped_nibble_fails(exported, tmp_path):
    ids = W.token_ids()
    reference = W.reference_logits(exported["gpt_model"], ids)  # the bf16 model of the MXFP4 values
    out = os.path.join(exported["root"], "gpt_oss_round_trip")
    assert torch.equal(_gpt_oss_logits(out, ids), reference)
    assert torch.equal(_gpt_oss_logits(os.path.join(exported["root"], "gpt_oss_fresh"), ids), reference)
    # negative control: one nibble flipped in a copy of the export
    broken = _edited_copy(out, str(tmp_path / "flipped"), "down_proj_blocks",
                          lambda t: t.view(-1)[:1].bitwise_xor_(0x07))
    assert not _same_checkpoint(_tensors(exported["gpt_mxfp4"]), _tensors(broken))
    assert not torch.equal(_gpt_oss_logits(broken, ids), reference)


def _deepseek_fp8_logits(directory: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of an FP8 DeepSeek-V3 directory, dequantized by transformers as it loads
    (each FP8 weight times its block's ``weight_scale_inv``, in float32: the model's dtype)."""
    from transformers import DeepseekV3ForCausalLM, FineGrainedFP8Config
    from transformers.utils import logging

    logging.set_verbosity_error()  # it lists the MTP layer's tensors, which transformers does not load
    model = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                  quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    with torch.no_grad():
        return model(ids).logits


def test_deepseek_fp8_round_trip_is_bit_identical_and_transformers_loads_it(exported, tmp_path):
    out = os.path.join(exported["root"], "deepseek_round_trip")
    source, mine = _tensors(exported["ds_fp8"]), _tensors(out)
    assert _same_checkpoint(source, mine)
    with open(os.path.join(exported["ds_fp8"], "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)
    stats = exported["results"]["deepseek-v3"]["round_trip"].quantization
    assert sorted(stats) == ["attention", "dense mlp", "mtp eh_proj", "routed experts", "shared experts"]
    assert all(s.max_abs == 0.0 and s.reused == s.blocks > 0 for s in stats.values())
    # transformers loading the export = transformers running the source's dequantized values (float32)
    ids = torch.randint(2, D.tiny_hf_config()["vocab_size"], (D.BATCH, D.SEQ), generator=torch.Generator().manual_seed(0))
    with open(os.path.join(exported["ds_bf16"], "config.json")) as f:
        config = json.load(f)
    plain = {**_tensors(exported["ds_bf16"]), **exported["ds_dequantized"]}
    D.write_checkpoint(str(tmp_path / "reference"), config, plain)
    reference = D.hf_logits(str(tmp_path / "reference"), ids)
    assert torch.equal(_deepseek_fp8_logits(out, ids), reference)
    # negative control: one scale_inv doubled (transformers does not load the MTP layer: a layer-0 one)
    broken = _edited_copy(out, str(tmp_path / "doubled"), "model.layers.0.self_attn.o_proj.weight_scale_inv",
                          lambda t: t.view(-1)[:1].mul_(2))
    assert not _same_checkpoint(source, _tensors(broken))
    assert not torch.equal(_deepseek_fp8_logits(broken, ids), reference)


# ---------------------------------------------------------------------------------------------
# after training: the error report and the logit check, against transformers
# ---------------------------------------------------------------------------------------------


def _check_report(stats: dict, groups: dict, quantized: dict, plain: dict, dequantize) -> None:
    """The reported max abs / relative error of each group = this test's own, computed from the
    written files (``dequantize(quantized, name)`` by transformers' functions or the formula)."""
    for group, member in groups.items():
        names = [n for n in plain if member(n)]
        assert names, group
        errors = [dequantize(quantized, n).double() - plain[n].double() for n in names]
        max_abs = max(float(e.abs().max()) for e in errors)
        relative = float(sum(e.square().sum() for e in errors).sqrt() /
                         sum(plain[n].double().square().sum() for n in names).sqrt())
        assert stats[group].max_abs == pytest.approx(max_abs, rel=1e-12), group
        assert stats[group].relative == pytest.approx(relative, rel=1e-9), group
        assert 0 < stats[group].relative <= 2 * stats[group].plain_relative, group


def test_gpt_oss_error_report_and_logit_check_after_training(exported):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root, res = exported["root"], exported["results"]["gpt-oss"]
    quantized, plain = _tensors(os.path.join(root, "gpt_oss_tuned")), _tensors(os.path.join(root, "gpt_oss_tuned_fp32"))
    groups = {"experts gate_up_proj (fc1)": lambda n: n.endswith("experts.gate_up_proj"),
              "experts down_proj (fc2)": lambda n: n.endswith("experts.down_proj")}

    def dequantize(tensors, name):
        return convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"], dtype=torch.float32)

    _check_report(res["tuned"].quantization, groups, quantized, plain, dequantize)
    # negative control: the groups swapped do not match the report
    with pytest.raises(AssertionError):
        _check_report(res["tuned"].quantization, dict(zip(groups, reversed(list(groups.values())))), quantized, plain,
                      dequantize)
    # the logit check's two models are the two exported checkpoints as transformers runs them
    from transformers import GptOssForCausalLM

    from recipes.hf.__main__ import LOGIT_CHECK_PROMPTS, LOGIT_CHECK_SEED

    ids = torch.randint(0, W.VOCAB, LOGIT_CHECK_PROMPTS, generator=torch.Generator().manual_seed(LOGIT_CHECK_SEED))
    as_exported = _gpt_oss_logits(os.path.join(root, "gpt_oss_tuned"), ids)
    fp32 = GptOssForCausalLM.from_pretrained(os.path.join(root, "gpt_oss_tuned_fp32"), attn_implementation="eager",
                                             dtype=torch.float32)
    as_trained = W.reference_logits(fp32, ids)
    assert W.rel_err(res["trained_logits"], as_trained) < 1e-5
    assert W.rel_err(res["exported_logits"], as_exported) < 1e-5
    change = W.rel_err(as_exported, as_trained)
    assert 1e-4 < change < 1.0, change  # the quantization moves the logits (tiny random model: a lot)
    assert W.rel_err(res["exported_logits"], as_trained) > 1e-4  # (negative control: the check tells them apart)


def test_deepseek_error_report_after_training(exported):
    root, res = exported["root"], exported["results"]["deepseek-v3"]
    quantized, plain = _tensors(os.path.join(root, "deepseek_tuned")), _tensors(os.path.join(root, "deepseek_tuned_fp32"))
    mtp_layer = D.tiny_hf_config()["num_hidden_layers"]
    groups = {"attention": lambda n: ".self_attn." in n and n.endswith(("proj.weight", "proj_with_mqa.weight")),
              "dense mlp": lambda n: (".mlp." in n and n.endswith("proj.weight") and ".experts." not in n
                                      and ".shared_experts." not in n),
              "routed experts": lambda n: ".mlp.experts." in n and n.endswith("proj.weight"),
              "shared experts": lambda n: ".shared_experts." in n and n.endswith("proj.weight"),
              "mtp eh_proj": lambda n: n == f"model.layers.{mtp_layer}.eh_proj.weight"}
    with open(os.path.join(root, "deepseek_tuned", "config.json")) as f:
        bm, bn = json.load(f)["quantization_config"]["weight_block_size"]

    def dequantize(tensors, name):  # DeepSeek's weight_dequant formula, written here
        rows, cols = tensors[name].shape
        scale = tensors[name + "_scale_inv"].repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
        return tensors[name].to(torch.float32) * scale

    _check_report(res["tuned"].quantization, groups, quantized, plain, dequantize)
    assert W.rel_err(res["exported_logits"], res["trained_logits"]) > 1e-5



def test_an_export_below_the_logit_check_threshold_is_removed_unless_accepted(tmp_path, capsys):
    """``python -m recipes.hf export``'s verdict on its logit check: at the threshold the export
    stays; below it, with --accept-logit-difference, it stays with one warning line; without, its
    files (and only its files) are removed, one error line, exit status 1."""
    from recipes.hf.__main__ import LOGIT_CHECK_MIN_AGREEMENT, finish_logit_check
    from recipes.hf.checkpoint import HFCheckpointWriter

    out = str(tmp_path / "export")
    writer = HFCheckpointWriter(out, config={"model_type": "gpt_oss"}, max_shard_bytes=16)
    writer.add("a", torch.zeros(8))
    writer.add("b", torch.ones(8))
    files = writer.close()
    (tmp_path / "export" / "README.md").write_text("the user's own file")
    written = sorted(os.listdir(out))
    assert len(files) == 2 and len(written) == 5
    finish_logit_check(LOGIT_CHECK_MIN_AGREEMENT, out, files, False, 0)
    assert sorted(os.listdir(out)) == written and capsys.readouterr().err == ""
    finish_logit_check(0.95, out, files, True, 0)
    assert sorted(os.listdir(out)) == written
    assert capsys.readouterr().err == ("[recipes.hf] warning: logit check: the exported model's top-1 agreement with the "
                                       "model as trained is 0.9500, below 0.99 (docs/finetune.md, export in the "
                                       "published precision); the export is kept (--accept-logit-difference)\n")
    with pytest.raises(SystemExit) as info:
        finish_logit_check(0.95, out, files, False, 0)
    assert info.value.code == 1 and os.listdir(out) == ["README.md"]
    err = capsys.readouterr().err
    assert err.startswith("[recipes.hf] error: logit check: ") and err.count("\n") == 1
    assert f"removed the exported files from {out}; pass --accept-logit-difference" in err


def _export_args(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"quant_source": None, "fresh_scales": False, "dequantized": False, **flags})


def test_export_flags_are_refused_where_the_round_trip_cannot_hold(exported):
    """``python -m recipes.hf export``: a model imported from a quantized checkpoint needs a scale
    source, fresh scales or --dequantized; flags that contradict the checkpoint are one line."""
    from recipes.hf.tables import gpt_oss
    from recipes.hf.__main__ import export_quantizer
    from recipes.hf.checkpoint import HFCheckpoint

    quantized = HFCheckpoint(exported["gpt_mxfp4"]).config
    plain = {k: v for k, v in quantized.items() if k != "quantization_config"}
    with pytest.raises(ValueError, match=r"imported from a mxfp4 checkpoint: pass --quant-source DIR .* --fresh-scales"):
        export_quantizer(_export_args(), quantized, gpt_oss)
    with pytest.raises(ValueError, match=r"^--fresh-scales: the checkpoint's config.json has no quantization_config"):
        export_quantizer(_export_args(fresh_scales=True), plain, gpt_oss)
    with pytest.raises(ValueError, match=r"^--quant-source .*quant_method is 'fp8', the model's 'mxfp4'"):
        export_quantizer(_export_args(quant_source=exported["ds_fp8"]), quantized, gpt_oss)
    assert export_quantizer(_export_args(dequantized=True), quantized, gpt_oss) is None
    assert export_quantizer(_export_args(), plain, gpt_oss) is None
    assert export_quantizer(_export_args(quant_source=exported["gpt_mxfp4"]), quantized, gpt_oss).source is not None


def _cli(args: list) -> "subprocess.CompletedProcess":
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    return subprocess.run([sys.executable, "-m", "recipes.hf", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_fp8_import_then_export_gives_the_source_back(exported, tmp_path):
    """``python -m recipes.hf import`` of an FP8 checkpoint in 16 x 16 blocks with partial edges
    (the release's kv_a_proj_with_mqa: 576 rows in 128-row blocks), then ``export --quant-source``:
    the source bit for bit, the error report and the logit check printed once, both zero (the
    refusal without a precision flag: test_export_flags_are_refused_where_the_round_trip_cannot_hold)."""
    source, ckpt, out = str(tmp_path / "source"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    D.fp8_checkpoint(exported["ds_bf16"], source, (16, 16))
    assert any(t.shape[0] % 16 for n, t in _tensors(source).items() if n.endswith("kv_a_proj_with_mqa.weight"))
    result = _cli(["import", "--hf", source, "--recipe", "deepseek-v3-tiny", "--out", ckpt])
    assert result.returncode == 0, result.stderr[-3000:]
    result = _cli(["export", "--load", ckpt, "--out", out, "--quant-source", source])
    assert result.returncode == 0, result.stderr[-3000:]
    assert _same_checkpoint(_tensors(source), _tensors(out))
    _assert_source_layout(source, out)
    lines = [line for line in result.stdout.splitlines() if "quantization error" in line]
    assert len(lines) == 5 and all("max abs 0.000e+00, relative 0.000e+00" in line for line in lines), result.stdout
    assert result.stdout.count("logit difference, exported vs as trained") == 1
    assert "max abs 0.000e+00, relative 0.000e+00, top-1 agreement 1.0000" in result.stdout
