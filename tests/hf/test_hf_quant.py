"""recipes.hf.quantization: the released checkpoints' MXFP4 (gpt-oss) and block-FP8 (DeepSeek-V3) weights
dequantize bit for bit as transformers loads them.

Nothing is downloaded: the tests quantize random tensors with small quantizers written here, then
compare our dequantization with transformers' own pure-torch functions (``torch.equal`` and the raw
bits, so -0.0 vs +0.0 counts too), with the reference formulas of the gpt-oss / DeepSeek code, and
with the E2M1 / E8M0 / e4m3 value tables independently of transformers. Negative controls show the
comparisons can fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from recipes.hf.quantization import (FP4_E2M1_VALUES, dequantize_fp8_blockwise, dequantize_mxfp4,
                              gpt_oss_expert_weight_from_mxfp4)

# transformers' pure-torch implementations (CPU, no triton):
#   transformers/integrations/mxfp4.py: convert_moe_packed_tensors (-> _convert_moe_packed_tensors),
#       Mxfp4Dequantize.convert (the load op used with Mxfp4Config(dequantize=True) / on CPU)
#   transformers/integrations/finegrained_fp8.py: Fp8Dequantize._dequantize_one (the load op with
#       FineGrainedFP8Config(dequantize=True)), _dequantize_fp8_weight (the backward-pass dequant)
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight  # noqa: E402
from transformers.integrations.mxfp4 import FP4_VALUES, Mxfp4Dequantize, convert_moe_packed_tensors  # noqa: E402

pytestmark = pytest.mark.release_independent  # .ci/run tests it on one Megatron-Core release

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
FP8_MAX = 448.0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality: shape, dtype, values (``torch.equal``) and the raw bits (sign of zero)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
        return False
    as_int = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


# ---------------------------------------------------------------------------------------------
# test-side quantizers
# ---------------------------------------------------------------------------------------------


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., N] (N % 32 == 0) -> (blocks [..., N/32, 16] uint8, scales [..., N/32] uint8, the
    dequantized values in float64). Per 32 values one power-of-two scale 2**e with
    e = floor(log2(amax)) - 2 (OCP MX: amax lands in [4, 8)), codes = nearest E2M1 magnitude + sign."""
    *lead, n = x.shape
    g = x.double().reshape(*lead, n // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2, torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    scaled = g / torch.exp2(e)[..., None]
    mag = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)  # nearest magnitude (ties: smaller)
    codes = mag | ((scaled < 0).long() << 3)
    values = E2M1_MAGNITUDES[mag] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(e)[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # low nibble = even value
    scales = (e + 127).to(torch.uint8)
    return blocks, scales, values.reshape(*lead, n)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] -> (float8_e4m3fn weight, float32 scale_inv [..., ceil(rows/bm), ceil(cols/bn)]):
    per block scale_inv = amax / 448 (edge blocks partial), like DeepSeek's weight_quant."""
    bm, bn = block
    rows, cols = w.shape[-2:]
    rb, cb = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(*w.shape[:-2], rb * bm, cb * bn, dtype=torch.float32)
    padded[..., :rows, :cols] = w
    amax = padded.unflatten(-1, (cb, bn)).unflatten(-3, (rb, bm)).abs().amax(dim=(-3, -1))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12).to(torch.float32)
    expand = scale_inv.repeat_interleave(bm, -2).repeat_interleave(bn, -1)[..., :rows, :cols]
    return (w.float() / expand).to(torch.float8_e4m3fn), scale_inv


def deepseek_weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-V3's reference, deepseek-ai/DeepSeek-V3 inference/kernel.py:weight_dequant (a triton
    kernel, reproduced block by block): y = x.to(float32) * s[block] stored into a tensor of the
    default dtype (``dtype`` here), masked at the edges."""
    y = torch.empty(x.shape, dtype=dtype)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rs, cs = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            y[rs, cs] = x[rs, cs].to(torch.float32) * s[i, j]
    return y


# ---------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------


def test_e2m1_codes_and_e8m0_scales_decode_to_the_known_table():
    codes = torch.arange(16)
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(2)[None]  # [1, 16]: codes 0..15 twice
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0] * 2
    assert list(FP4_E2M1_VALUES) == expected[:16] == FP4_VALUES
    for byte, factor in [(127, 1.0), (128, 2.0), (126, 0.5), (130, 8.0), (0, 2.0 ** -127), (254, 2.0 ** 127)]:
        got = dequantize_mxfp4(blocks, torch.tensor([byte], dtype=torch.uint8))
        assert got.shape == (32,) and got.dtype == torch.float32  # blocks [G=1, 16] -> [32]
        want = torch.tensor([v * factor for v in expected], dtype=torch.float32)
        assert same_bits(got, want), byte
    got = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8))
    assert torch.signbit(got[8]) and not torch.signbit(got[0])  # code 8 is -0.0
    # one byte 0x71: low nibble 1 (+0.5) comes first, high nibble 7 (+6.0) second
    one = torch.full((1, 16), 0x71, dtype=torch.uint8)
    assert dequantize_mxfp4(one, torch.tensor([127], dtype=torch.uint8))[:2].tolist() == [0.5, 6.0]


def test_mxfp4_quantizer_roundtrip_independent_of_transformers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=gen) * torch.logspace(-3, 3, 5)[:, None]
    x[0, 0, :32] = 0.0  # an all-zero block (scale byte 0)
    blocks, scales, values = quantize_mxfp4(x)
    assert blocks.shape == (3, 5, 3, 16) and scales.shape == (3, 5, 3)
    for dtype in (torch.float32, torch.float64):
        assert same_bits(dequantize_mxfp4(blocks, scales, dtype), values.to(dtype))
    err = (dequantize_mxfp4(blocks, scales).double() - x.double()).abs()
    amax = x.double().reshape(3, 5, 3, 32).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 32).reshape(3, 5, 96)
    assert bool((err <= amax / 4 + 1e-30).all())  # E2M1 step at the top of the range is 2 (of 8 * 2**e)


def _random_mxfp4(shape: tuple, gen: torch.Generator, lo: int = 100, hi: int = 150):
    """Every byte value, scales over a spread of exponents."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows_per_chunk", [7, 1 << 16])
def test_mxfp4_matches_transformers_convert_moe_packed_tensors(dtype, rows_per_chunk):
    gen = torch.Generator().manual_seed(1)
    lo, hi = (100, 150) if dtype != torch.float16 else (115, 135)  # float16: stay in range
    for experts, out_rows, groups in [(3, 40, 2), (4, 64, 3), (1, 5, 1)]:
        blocks, scales = _random_mxfp4((experts, out_rows, groups), gen, lo, hi)
        qb, qs, _ = quantize_mxfp4(torch.randn(experts, out_rows, groups * 32, generator=gen))
        for b, s in [(blocks, scales), (qb, qs)]:
            ref = convert_moe_packed_tensors(b, s, dtype=dtype)  # [E, in, out], what GptOssExperts holds
            ours = gpt_oss_expert_weight_from_mxfp4(b, s, dtype, rows_per_chunk=rows_per_chunk)
            assert ref.shape == (experts, groups * 32, out_rows) and ours.is_contiguous()
            assert same_bits(ours, ref)
            rows = dequantize_mxfp4(b, s, dtype, rows_per_chunk=rows_per_chunk)  # stored layout [E, out, in]
            assert same_bits(rows, ref.transpose(1, 2).contiguous())


def test_mxfp4_leading_dims():
    gen = torch.Generator().manual_seed(2)
    blocks, scales = _random_mxfp4((2, 3, 8, 2), gen)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16, rows_per_chunk=5)
    assert ours.shape == (2, 3, 8, 64)
    ref = convert_moe_packed_tensors(blocks.reshape(6, 8, 2, 16), scales.reshape(6, 8, 2), dtype=torch.bfloat16)
    assert same_bits(ours, ref.transpose(1, 2).reshape(2, 3, 8, 64))
    # and 2-D blocks (no prefix), the same rows
    assert same_bits(dequantize_mxfp4(blocks[1, 2], scales[1, 2], torch.bfloat16), ours[1, 2])
    # E8M0 scales typed as torch.float8_e8m0fnu hold the same bytes
    if hasattr(torch, "float8_e8m0fnu"):
        assert same_bits(dequantize_mxfp4(blocks, scales.view(torch.float8_e8m0fnu), torch.bfloat16), ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_transformers_load_op_into_gpt_oss_experts(dtype):
    """transformers' Mxfp4Dequantize.convert (the op loading ``*_blocks``/``*_scales`` into
    GptOssExperts) gives our tensor, in the parameter's shape: gate_up_proj [E, D, 2H], down_proj [E, H, D]."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts, hidden, ffn = 4, 64, 96
    cfg = GptOssConfig(num_local_experts=experts, hidden_size=hidden, intermediate_size=ffn)
    root = torch.nn.Module()
    root.experts = GptOssExperts(cfg).to(dtype)
    gen = torch.Generator().manual_seed(3)
    stored_shapes = {"gate_up_proj": (experts, 2 * ffn, hidden // 32), "down_proj": (experts, hidden, ffn // 32)}
    for proj, stored in stored_shapes.items():
        blocks, scales = _random_mxfp4(stored, gen)
        loaded = Mxfp4Dequantize(None).convert({f"{proj}_blocks": blocks, f"{proj}_scales": scales},
                                               model=root, full_layer_name=f"experts.{proj}")[f"experts.{proj}"]
        param = getattr(root.experts, proj)
        assert loaded.shape == param.shape and loaded.dtype == param.dtype
        ours = gpt_oss_expert_weight_from_mxfp4(blocks, scales, dtype)
        assert same_bits(ours, loaded.data)


def test_mxfp4_negative_controls():
    gen = torch.Generator().manual_seed(4)
    blocks, scales = _random_mxfp4((2, 32, 1), gen)  # square per expert: [2, 32, 32] either way
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert same_bits(gpt_oss_expert_weight_from_mxfp4(blocks, scales), ref)
    swapped = (blocks << 4) | (blocks >> 4)  # high nibble first
    assert not same_bits(gpt_oss_expert_weight_from_mxfp4(swapped, scales), ref)
    assert not same_bits(dequantize_mxfp4(blocks, scales), ref)  # stored layout, not transposed
    assert not same_bits(gpt_oss_expert_weight_from_mxfp4(blocks, scales + 1), ref)  # scale bias off by one
    # a single flipped sign bit is caught, down to -0.0 vs +0.0
    zero_blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    one = torch.ones(1, 1, 1, dtype=torch.uint8)
    plus = gpt_oss_expert_weight_from_mxfp4(zero_blocks, one)
    minus = gpt_oss_expert_weight_from_mxfp4(zero_blocks | 8, one)
    assert torch.equal(plus, minus) and not same_bits(plus, minus)


@pytest.mark.parametrize("call, match", [
    (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, dtype=torch.uint8)),
     r"uint8 of shape \[..., G, 16\]"),
    (lambda: dequantize_mxfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)),
     r"shape \[..., G, 16\].*got \(4, 8\)"),
    (lambda: dequantize_mxfp4(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)),
     r"scales must have shape \(2, 4\)"),
    (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4)),
     r"uint8 E8M0 exponents of shape \(4,\)"),
    (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), torch.int32),
     r"floating-point"),
    (lambda: gpt_oss_expert_weight_from_mxfp4(torch.zeros(4, 2, 16, dtype=torch.uint8),
                                              torch.zeros(4, 2, dtype=torch.uint8)),
     r"\[E, out, in/32, 16\].*got \(4, 2, 16\)"),
])
def test_mxfp4_rejects_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# block FP8
# ---------------------------------------------------------------------------------------------

FP8_SHAPES = [(256, 384), (300, 200), (576, 260), (1, 1), (129, 127), (3, 200, 300)]


def _fp8_case(shape: tuple, gen: torch.Generator, block=(128, 128)):
    w = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape, generator=gen).float())
    return quantize_fp8(w, block)


def test_fp8_known_values_independent_of_transformers():
    # every block (partial edges included) gets its own scale: a weight of ones comes back as its block's scale
    rows, cols = 300, 200  # 3 x 2 blocks, the last row/column blocks partial
    scale_inv = torch.tensor([[1.0, 2.0], [0.5, 3.0], [-4.0, 2.0 ** -20]])
    got = dequantize_fp8_blockwise(torch.ones(rows, cols).to(torch.float8_e4m3fn), scale_inv)
    want = scale_inv.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    assert same_bits(got, want)
    assert got[299, 199] == 2.0 ** -20 and got[0, 127] == 1.0 and got[0, 128] == 2.0 and got[256, 0] == -4.0
    # e4m3 extremes: 448, -448, the smallest subnormal 2**-9, -0.0
    w = torch.tensor([[448.0, -448.0, 2.0 ** -9, -0.0]]).to(torch.float8_e4m3fn)
    got = dequantize_fp8_blockwise(w, torch.tensor([[0.25]]))
    assert same_bits(got, torch.tensor([[112.0, -112.0, 2.0 ** -11, -0.0]]))


@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("rows_per_chunk", [1, 1024])
def test_fp8_matches_transformers_and_deepseek_float32(shape, rows_per_chunk):
    gen = torch.Generator().manual_seed(sum(shape))
    weight, scale_inv = _fp8_case(shape, gen)
    ours = dequantize_fp8_blockwise(weight, scale_inv, rows_per_chunk=rows_per_chunk)
    assert ours.shape == weight.shape and ours.dtype == torch.float32
    # transformers' backward-pass dequant handles partial edge blocks; in float32 it is the same product
    assert same_bits(ours, _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.float32))
    if all(n % 128 == 0 for n in shape[-2:]):  # Fp8Dequantize infers the block from the grid: full blocks only
        assert same_bits(ours, Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=torch.float32))
    if len(shape) == 2:
        assert same_bits(ours, deepseek_weight_dequant(weight, scale_inv, 128, torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_low_precision_rounds_once_like_deepseek_and_transformers_load(dtype):
    gen = torch.Generator().manual_seed(5)
    for shape in [(256, 384), (2, 128, 256), (300, 200), (576, 260)]:
        weight, scale_inv = _fp8_case(shape, gen)
        ours = dequantize_fp8_blockwise(weight, scale_inv, dtype=dtype)
        assert same_bits(ours, dequantize_fp8_blockwise(weight, scale_inv).to(dtype))
        if all(n % 128 == 0 for n in shape[-2:]):
            assert same_bits(ours, Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=dtype))
        if len(shape) == 2:
            assert same_bits(ours, deepseek_weight_dequant(weight, scale_inv, 128, dtype))


def test_fp8_other_block_size():
    gen = torch.Generator().manual_seed(6)
    weight, scale_inv = _fp8_case((200, 100), gen, block=(64, 32))
    assert scale_inv.shape == (4, 4)
    ours = dequantize_fp8_blockwise(weight, scale_inv, block_size=(64, 32))
    assert same_bits(ours, _dequantize_fp8_weight(weight, scale_inv, [64, 32], torch.float32))


def test_fp8_negative_controls():
    gen = torch.Generator().manual_seed(7)
    weight, scale_inv = _fp8_case((256, 256), gen)
    ref = _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.float32)
    assert same_bits(dequantize_fp8_blockwise(weight, scale_inv), ref)
    assert not same_bits(dequantize_fp8_blockwise(weight, scale_inv.t().contiguous()), ref)  # scale grid transposed
    assert not same_bits(dequantize_fp8_blockwise(weight, scale_inv * (1 + 2 ** -20)), ref)  # one-ulp-ish scale change
    # the bf16 product rounded twice (scale to bf16, then product in bf16) is NOT what we (or DeepSeek) compute
    low = dequantize_fp8_blockwise(weight, scale_inv, dtype=torch.bfloat16)
    assert not same_bits(low, _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.bfloat16))


def _f8(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("call, match", [
    (lambda: dequantize_fp8_blockwise(torch.zeros(4, 4), torch.ones(1, 1)),
     r"float8_e4m3fn of shape \[..., rows, cols\]"),
    (lambda: dequantize_fp8_blockwise(_f8(4), torch.ones(1)), r"got torch.float8_e4m3fn \(4,\)"),
    (lambda: dequantize_fp8_blockwise(_f8(300, 200), torch.ones(2, 2)), r"scale_inv must have shape \(3, 2\)"),
    (lambda: dequantize_fp8_blockwise(_f8(2, 300, 200), torch.ones(3, 2)), r"scale_inv must have shape \(2, 3, 2\)"),
    (lambda: dequantize_fp8_blockwise(_f8(128, 128), torch.ones(1, 1, dtype=torch.int32)),
     r"floating-point tensor .* of shape \(1, 1\)"),
    (lambda: dequantize_fp8_blockwise(_f8(128, 128), torch.ones(1, 1), (128,)), r"block_size must be two positive"),
    (lambda: dequantize_fp8_blockwise(_f8(128, 128), torch.ones(1, 1), (0, 128)), r"block_size must be two positive"),
    (lambda: dequantize_fp8_blockwise(_f8(128, 128), torch.ones(1, 1), dtype=torch.int8), r"floating-point"),
])
def test_fp8_rejects_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_deepseek_v3_kv_a_proj_shape():
    """kv_a_proj_with_mqa is [576, 7168] in DeepSeek-V3: 4.5 row blocks, scale_inv [5, 56] (a
    smaller copy here: [576, 260] -> [5, 3]); the partial last block uses its own scale."""
    gen = torch.Generator().manual_seed(8)
    weight, scale_inv = _fp8_case((576, 260), gen)
    assert scale_inv.shape == (5, 3) and math.ceil(576 / 128) == 5
    ours = dequantize_fp8_blockwise(weight, scale_inv, dtype=torch.bfloat16)
    assert same_bits(ours[512:, 256:], (weight[512:, 256:].float() * scale_inv[4, 2]).to(torch.bfloat16))
