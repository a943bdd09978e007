"""Dequantization of the quantized weights in the released Hugging Face checkpoints.

The published gpt-oss checkpoints store their expert weights as MXFP4 (``*_blocks`` + ``*_scales``)
and the published DeepSeek-V3 checkpoint stores its linear weights as block-scaled FP8
(``weight`` + ``weight_scale_inv``). Megatron-Core trains in bf16/fp32, so the importers
(:mod:`recipes.hf.tables.gpt_oss`, :mod:`recipes.hf.tables.deepseek_v3`) turn them into plain floating-point
tensors here. Pure torch (no triton, no GPU needed), and bit for bit what transformers loads:

- MXFP4: ``transformers/integrations/mxfp4.py:_convert_moe_packed_tensors`` (called through
  ``convert_moe_packed_tensors`` by ``Mxfp4Dequantize``), itself taken from the gpt-oss reference
  ``gpt_oss/torch/weights.py:Checkpoint._get_mxfp4_tensor``: the same FP4 lookup table, nibble order
  and ``torch.ldexp`` in the output dtype, so the rounding is the same.
- FP8: ``transformers/integrations/finegrained_fp8.py:Fp8Dequantize._dequantize_one`` and DeepSeek's
  ``inference/kernel.py:weight_dequant``: ``fp8.float() * scale_inv`` in float32, rounded once to the
  output dtype (which also equals ``_dequantize_fp8_weight`` when the output dtype is float32).

Both work in row chunks so that the peak memory is the output plus one small chunk, not several
copies of a full (gpt-oss-120b or DeepSeek-V3 sized) weight.

Export goes the other way (:func:`quantize_mxfp4`, :func:`quantize_fp8_blockwise`,
:class:`ExportQuantizer`), block by block, by the rule that errs least. A block's scale is not
determined by its values (MXFP4: any smaller power of two that still holds the block's values;
FP8: ``fp8 * scale_inv`` is rounded in float32, so a recomputed ``amax / 448`` is not the stored
scale), so only the source's scale can give the source's bits back. Given it, the codes are
unique (distinct codes dequantize to distinct values, in bf16 as in float32: E2M1 values times a
power of two are exact in both; two e4m3 neighbours differ by at least 1/16 relative, far above
bf16's 2**-9 rounding). Each block therefore weighs candidate scales by the squared error of the
codes rounded to nearest under them (float64) and keeps the source's where nothing errs less:

- MXFP4: the source's exponent, the OCP MX exponent floor(log2(amax)) - 2 (values above 6 x the
  scale saturate) and its two neighbours; the smallest error wins, the earlier on a tie. An
  untouched block has error 0 under its source scale, so it comes back bit for bit; a trained
  one keeps the source scale unless training moved it out of reach (where the MX rule alone
  saturates a block whose amax fell just under a power of two, and a fresh "amax / scale <= 6"
  rule doubles the scale of one whose amax rose just above 6 x the source scale).
- FP8: the source's ``scale_inv`` where its codes give back exactly the held values (bit for bit,
  in the held dtype or, for values held in float32, in bf16), else the source's or DeepSeek's
  ``amax / 448``, whichever errs less (the source's on a tie).

A checkpoint imported in bf16 or float32 and exported untrained is therefore the source bit for
bit; fp16 would not hold every block's values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "FP4_E2M1_VALUES",
    "MXFP4_BLOCK",
    "dequantize_mxfp4",
    "gpt_oss_expert_weight_from_mxfp4",
    "dequantize_fp8_blockwise",
    "quantize_mxfp4",
    "quantize_fp8_blockwise",
    "QuantStats",
    "ExportQuantizer",
    "error_report",
]

# E2M1 code -> value; index = the 4-bit code (bit 3 = sign). Same table as transformers' FP4_VALUES.
FP4_E2M1_VALUES: tuple[float, ...] = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
MXFP4_BLOCK = 32  # values sharing one E8M0 scale: 16 bytes, two codes per byte
_MXFP4_BYTES = MXFP4_BLOCK // 2
_E8M0_BIAS = 127
_MXFP4_ROWS_PER_CHUNK = 1 << 16  # blocks (32 values each) per chunk: 2M values, 8 MB in float32
_FP8_ROWS_PER_CHUNK = 1024  # weight rows per chunk (x 7168 columns in DeepSeek-V3: 29 MB in float32)


def _check_float_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")


def _e8m0_as_uint8(scales: torch.Tensor) -> torch.Tensor:
    """The released scales are uint8 bytes; torch's float8_e8m0fnu holds the very same bytes."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None and scales.dtype == e8m0:
        return scales.view(torch.uint8)
    return scales


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(blocks, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise ValueError("blocks and scales must be torch.Tensors")
    if blocks.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks must be uint8 of shape [..., G, {_MXFP4_BYTES}] (two E2M1 codes per byte), "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    if blocks.dim() < 2 or blocks.shape[-1] != _MXFP4_BYTES:
        raise ValueError(f"MXFP4 blocks must have shape [..., G, {_MXFP4_BYTES}] ({MXFP4_BLOCK} values per block), "
                         f"got {tuple(blocks.shape)}")
    scales = _e8m0_as_uint8(scales)
    if scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 E8M0 exponents of shape {tuple(blocks.shape[:-1])} "
                         f"(= blocks.shape[:-1]), got {scales.dtype} {tuple(scales.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 scales must have shape {tuple(blocks.shape[:-1])} (= blocks.shape[:-1] for blocks "
                         f"{tuple(blocks.shape)}), got {tuple(scales.shape)}")
    if scales.device != blocks.device:
        raise ValueError(f"blocks ({blocks.device}) and scales ({scales.device}) must be on the same device")
    _check_float_dtype(dtype)
    return scales


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                     rows_per_chunk: int = _MXFP4_ROWS_PER_CHUNK) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., G, 16] (uint8, two E2M1 codes per byte, low nibble first) and
    ``scales`` [..., G] (uint8 E8M0, value ``2**(s - 127)``) -> ``dtype`` [..., G*32], in the stored
    (row) layout, i.e. the gpt-oss reference's ``_get_mxfp4_tensor`` (no transpose).

    Each value is ``FP4_E2M1_VALUES[code] * 2**(scale - 127)`` computed exactly as transformers does
    (lookup in ``dtype``, then ``torch.ldexp`` in place), so the result is bit-identical to it in any
    dtype. The blocks are decoded ``rows_per_chunk`` at a time into the preallocated output, so peak
    memory is the output plus one chunk's index/value temporaries (a few tens of MB by default),
    whatever the size of the weight (gpt-oss-120b's gate_up_proj is 2.1G values per layer).
    """
    scales = _check_mxfp4(blocks, scales, dtype)
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    *prefix, groups, nbytes = blocks.shape
    rows_total = math.prod(prefix) * groups
    flat_blocks = blocks.reshape(rows_total, nbytes)
    exponents = scales.reshape(rows_total, 1)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(rows_total, nbytes * 2, dtype=dtype, device=blocks.device)
    for r0 in range(0, rows_total, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, rows_total)
        blk, sub = flat_blocks[r0:r1], out[r0:r1]
        sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]  # low nibble = the earlier value
        sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
        torch.ldexp(sub, exponents[r0:r1].to(torch.int32) - _E8M0_BIAS, out=sub)
    return out.view(*prefix, groups * nbytes * 2)


def gpt_oss_expert_weight_from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                                     dtype: torch.dtype = torch.float32, *,
                                     rows_per_chunk: int = _MXFP4_ROWS_PER_CHUNK) -> torch.Tensor:
    """A released gpt-oss expert weight -> exactly the tensor transformers' ``GptOssExperts`` holds.

    The release stores ``gate_up_proj_blocks`` [E, 2*I, H/32, 16] / ``down_proj_blocks``
    [E, H, I/32, 16] (rows = output features, like ``nn.Linear``), while ``GptOssExperts`` holds
    ``gate_up_proj`` [E, H, 2*I] and ``down_proj`` [E, I, H] (``x @ W``; gate/up columns still
    interleaved). transformers' ``Mxfp4Dequantize`` loads ``convert_moe_packed_tensors(blocks,
    scales, dtype=param.dtype)``, which dequantizes to [E, out, in] and returns
    ``.transpose(1, 2).contiguous()``: [E, in, out]. Same values and layout here (contiguous), but
    each chunk of rows is written straight into its transposed place, so no second full-size copy
    is made: peak memory is the output plus one chunk.
    """
    scales = _check_mxfp4(blocks, scales, dtype)
    if blocks.dim() != 4:
        raise ValueError(f"gpt-oss expert blocks must have shape [E, out, in/{MXFP4_BLOCK}, {_MXFP4_BYTES}] "
                         f"(scales [E, out, in/{MXFP4_BLOCK}]), got {tuple(blocks.shape)}")
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, groups * MXFP4_BLOCK, rows, dtype=dtype, device=blocks.device)
    step = max(1, rows_per_chunk // max(groups, 1))  # output rows per chunk
    for e in range(experts):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            values = dequantize_mxfp4(blocks[e, r0:r1], scales[e, r0:r1], dtype, rows_per_chunk=rows_per_chunk)
            out[e, :, r0:r1] = values.t()
    return out


def _fp8_block_size(block_size: Sequence[int]) -> tuple[int, int]:
    try:
        bm, bn = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}") from None
    if bm < 1 or bn < 1:
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
    return bm, bn


def dequantize_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor,
                             block_size: Sequence[int] = (128, 128), dtype: torch.dtype = torch.float32, *,
                             rows_per_chunk: int = _FP8_ROWS_PER_CHUNK) -> torch.Tensor:
    """DeepSeek-V3's block FP8 -> ``dtype``: ``weight`` [..., rows, cols] float8_e4m3fn,
    ``scale_inv`` [..., ceil(rows/bm), ceil(cols/bn)] (float32 in the release) with ``block_size``
    = (bm, bn) = ``quantization_config.weight_block_size``; value = ``weight.float() * scale_inv``
    of its block, the edge blocks being partial when rows/cols are not multiples of the block
    (e.g. ``kv_a_proj_with_mqa``, 576 rows).

    The product is taken in float32 and rounded once to ``dtype``, as DeepSeek's ``weight_dequant``
    kernel and transformers' ``Fp8Dequantize`` do (for bf16 that differs from multiplying in bf16).
    Rows are processed ``rows_per_chunk`` at a time into the preallocated output, so peak memory is
    the output plus one chunk, not float32 copies of the whole weight and of its expanded scales.
    """
    if not isinstance(weight, torch.Tensor) or not isinstance(scale_inv, torch.Tensor):
        raise ValueError("weight and scale_inv must be torch.Tensors")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() < 2:
        raise ValueError(f"FP8 weight must be torch.float8_e4m3fn of shape [..., rows, cols], "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    bm, bn = _fp8_block_size(block_size)
    *lead, rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // bm), -(-cols // bn)
    expected = (*lead, row_blocks, col_blocks)
    if not scale_inv.dtype.is_floating_point:
        raise ValueError(f"scale_inv must be a floating-point tensor (float32 in DeepSeek-V3) of shape {expected}, "
                         f"got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv must have shape {expected} (= weight.shape[:-2] + (ceil({rows}/{bm}), "
                         f"ceil({cols}/{bn})) for weight {tuple(weight.shape)}), got {tuple(scale_inv.shape)}")
    if scale_inv.device != weight.device:
        raise ValueError(f"weight ({weight.device}) and scale_inv ({scale_inv.device}) must be on the same device")
    _check_float_dtype(dtype)
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")

    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if weight.numel() == 0:
        return out
    w3 = weight.reshape(-1, rows, cols)
    s3 = scale_inv.reshape(-1, row_blocks, col_blocks)
    o3 = out.view(-1, rows, cols)
    step = max(1, rows_per_chunk // bm) * bm  # whole row blocks per chunk
    for i in range(w3.shape[0]):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            scale = s3[i, r0 // bm: -(-r1 // bm)].to(torch.float32)
            scale = scale.repeat_interleave(bm, dim=0)[: r1 - r0].repeat_interleave(bn, dim=1)[:, :cols]
            o3[i, r0:r1] = w3[i, r0:r1].to(torch.float32) * scale
    return out


# ---------------------------------------------------------------------------------------------
# quantization (export)
# ---------------------------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0
_E2M1_EMAX = 2  # the largest E2M1 exponent: 6 = 1.5 * 2**2


@dataclass
class QuantStats:
    """Quantization error of some tensors: blocks, where their scales came from (``reused``: the
    source's; ``neighbours``: MXFP4 exponents one off the OCP MX one), the largest absolute error,
    the sums of squares of the errors, of the values and of the plain round-to-nearest errors
    (OCP MX scale / DeepSeek's ``amax / 448`` for every block, the yardstick of the chosen ones)."""

    blocks: int = 0
    reused: int = 0
    neighbours: int = 0
    max_abs: float = 0.0
    err_sq: float = 0.0
    ref_sq: float = 0.0
    plain_err_sq: float = 0.0

    def add(self, values: torch.Tensor, dequantized: torch.Tensor, blocks: int, reused: int = 0, neighbours: int = 0,
            plain_err_sq: float = 0.0) -> None:
        err = (dequantized.double() - values.double())
        self.blocks += blocks
        self.reused += reused
        self.neighbours += neighbours
        if err.numel():
            self.max_abs = max(self.max_abs, float(err.abs().max()))
        self.err_sq += float(err.square().sum())
        self.ref_sq += float(values.double().square().sum())
        self.plain_err_sq += plain_err_sq

    def _relative(self, err_sq: float) -> float:
        return math.sqrt(err_sq / self.ref_sq) if self.ref_sq else math.sqrt(err_sq)

    @property
    def relative(self) -> float:
        """||dequantized - values|| / ||values|| (0 for all-zero values)."""
        return self._relative(self.err_sq)

    @property
    def plain_relative(self) -> float:
        """The same for plain round-to-nearest (every block under its OCP MX / ``amax / 448`` scale)."""
        return self._relative(self.plain_err_sq)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that equality also tells -0.0 from +0.0."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def _held_exactly(dequantized_fp32: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per element: does the float32 dequantization, rounded to ``values``' dtype (or, for float32
    values, through bf16: a model imported in bf16, loaded in float32), give ``values`` bit for bit?"""
    same = _bits(dequantized_fp32.to(values.dtype)) == _bits(values)
    if values.dtype == torch.float32:
        same |= _bits(dequantized_fp32.to(torch.bfloat16).to(torch.float32)) == _bits(values)
    return same


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """float32 values (already divided by the block scale) -> 4-bit E2M1 codes: nearest magnitude,
    ties to the even code, saturating at 6; the sign bit from the float's sign (-0.0 -> code 8).
    Codes 0..4 are the magnitudes 0..2 in steps of 0.5 and 4..6 the magnitudes 2..4 in steps of 1,
    so torch.round's ties to even on 2 x or x + 2 is the even code; above 4 only 4 (code 6) and 6
    (code 7) remain, the tie 5 going to 6."""
    mag = scaled.abs()
    code = torch.where(mag < 2, torch.round(mag * 2),
                       torch.where(mag < 4, torch.round(mag) + 2, (mag > 5).to(mag.dtype) + 6))
    return code.to(torch.uint8) | (torch.signbit(scaled).to(torch.uint8) << 3)


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The OCP MX shared exponent floor(log2(amax)) - 2 (E2M1's largest exponent), from frexp
    (amax = m * 2**k with m in [0.5, 1): floor(log2(amax)) = k - 1), clamped to E8M0's
    [-127, 127]; an all-zero block gets -127."""
    _, exponent = torch.frexp(amax)
    e = exponent.to(torch.int32) - 1 - _E2M1_EMAX
    e = torch.where(amax > 0, e, torch.full_like(e, -_E8M0_BIAS))
    return e.clamp(-_E8M0_BIAS, _E8M0_BIAS)


def _first_smallest(errors: list[torch.Tensor]) -> torch.Tensor:
    """Per block, the index of the candidate with the smallest error, the earliest on a tie."""
    return torch.stack(errors).argmin(dim=0)  # torch.argmin returns the first minimal index


def quantize_mxfp4(values: torch.Tensor, source_scales: Optional[torch.Tensor] = None, *,
                   stats: Optional[QuantStats] = None,
                   rows_per_chunk: int = _MXFP4_ROWS_PER_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` [..., N] (N % 32 == 0) -> MXFP4 ``(blocks [..., N/32, 16] uint8, scales [..., N/32]
    uint8)``, the layout :func:`dequantize_mxfp4` reads.

    Each block takes, of its candidate exponents, the one whose codes (nearest E2M1, ties to the
    even code, saturating at 6) give the smallest squared error (float64), the earliest on a tie:
    ``source_scales``' (the scales of the checkpoint the values were imported from, if given),
    the OCP MX exponent floor(log2(amax)) - 2, then the two around it. An untouched block keeps
    its source scale and codes (error 0; module docstring); a block training moved keeps the
    source scale while nothing represents it better, where the MX rule alone saturates (amax just
    under a power of two) or a fresh "amax / scale <= 6" rule doubles the scale (amax just over
    6 x the source scale). ``stats`` accumulates the error, the sources of the scales and plain
    MX round-to-nearest's error. Works ``rows_per_chunk`` blocks at a time, so peak memory is the
    output plus one chunk."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.dim() < 1 \
            or values.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 quantization needs floating-point values of shape [..., N] with N % {MXFP4_BLOCK} "
                         f"== 0, got {getattr(values, 'dtype', type(values))} {tuple(getattr(values, 'shape', ()))}")
    *lead, n = values.shape
    groups = n // MXFP4_BLOCK
    if source_scales is not None:
        source_scales = _e8m0_as_uint8(source_scales)
        if source_scales.dtype != torch.uint8 or tuple(source_scales.shape) != (*lead, groups):
            raise ValueError(f"source MXFP4 scales must be uint8 of shape {(*lead, groups)} for values "
                             f"{tuple(values.shape)}, got {source_scales.dtype} {tuple(source_scales.shape)}")
    rows_total = math.prod(lead) * groups
    flat = values.reshape(rows_total, MXFP4_BLOCK)
    blocks = torch.empty(rows_total, _MXFP4_BYTES, dtype=torch.uint8, device=values.device)
    scales = torch.empty(rows_total, dtype=torch.uint8, device=values.device)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float64, device=values.device)
    for r0 in range(0, rows_total, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, rows_total)
        x32 = flat[r0:r1].to(torch.float32)
        x64 = flat[r0:r1].to(torch.float64)
        mx = _mx_exponent(x32.abs().amax(dim=1))
        candidates = [mx, (mx + 1).clamp(max=_E8M0_BIAS), (mx - 1).clamp(min=-_E8M0_BIAS)]
        if source_scales is not None:
            candidates.insert(0, source_scales.reshape(rows_total)[r0:r1].to(torch.int32) - _E8M0_BIAS)
        codes, errors = [], []
        for exponent in candidates:
            code = _e2m1_codes(torch.ldexp(x32, -exponent[:, None]))
            dequantized = torch.ldexp(lut[code.to(torch.int64)], exponent[:, None].to(torch.float64))
            codes.append(code)
            errors.append((dequantized - x64).square().sum(dim=1))
        pick = _first_smallest(errors)
        rows = torch.arange(r1 - r0, device=values.device)
        chosen_codes = torch.stack(codes)[pick, rows]
        chosen = torch.stack(candidates)[pick, rows]
        blocks[r0:r1] = chosen_codes[:, 0::2] | (chosen_codes[:, 1::2] << 4)  # low nibble = the earlier value
        scales[r0:r1] = (chosen + _E8M0_BIAS).to(torch.uint8)
        if stats is not None:
            first_mx = 1 if source_scales is not None else 0  # the index of the MX candidate
            reused = int((pick == 0).sum()) if source_scales is not None else 0
            dequantized = torch.ldexp(lut[chosen_codes.to(torch.int64)], chosen[:, None].to(torch.float64))
            stats.add(x64, dequantized, r1 - r0, reused, int((pick > first_mx).sum()), float(errors[first_mx].sum()))
    return blocks.view(*lead, groups, _MXFP4_BYTES), scales.view(*lead, groups)


def quantize_fp8_blockwise(weight: torch.Tensor, block_size: Sequence[int] = (128, 128),
                           source_scale_inv: Optional[torch.Tensor] = None, *,
                           stats: Optional[QuantStats] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [rows, cols] -> ``(float8_e4m3fn [rows, cols], float32 scale_inv [ceil(rows/bm),
    ceil(cols/bn)])``, the layout :func:`dequantize_fp8_blockwise` reads. Codes are ``weight /
    scale`` rounded to nearest, clamped to +-448. A block keeps its ``source_scale_inv`` where the
    codes under it give back exactly its values (bit for bit in the held dtype: the untouched
    round trip), else takes of the source's and DeepSeek's ``amax / 448`` (an all-zero block: 1.0)
    the one with the smaller squared error (float64), the source's on a tie. Works one row of
    blocks at a time."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError(f"FP8 quantization needs a floating-point [rows, cols] weight, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    bm, bn = _fp8_block_size(block_size)
    rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // bm), -(-cols // bn)
    if source_scale_inv is not None and (not source_scale_inv.is_floating_point()
                                         or tuple(source_scale_inv.shape) != (row_blocks, col_blocks)):
        raise ValueError(f"source scale_inv must be float of shape {(row_blocks, col_blocks)} for weight "
                         f"{tuple(weight.shape)} and blocks {(bm, bn)}, got {source_scale_inv.dtype} "
                         f"{tuple(source_scale_inv.shape)}")
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=weight.device)
    scale_inv = torch.empty(row_blocks, col_blocks, dtype=torch.float32, device=weight.device)
    padded_cols = col_blocks * bn

    for rb in range(row_blocks):
        r0, r1 = rb * bm, min(rb * bm + bm, rows)
        x = weight[r0:r1]
        x32 = torch.zeros(r1 - r0, padded_cols, dtype=torch.float32, device=weight.device)
        x32[:, :cols] = x
        x32 = x32.view(r1 - r0, col_blocks, bn)
        x64 = x32.to(torch.float64)  # the padding is zero under every scale: it adds no error
        amax = x32.abs().amax(dim=(0, 2))
        candidates = [torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))]
        if source_scale_inv is not None:
            candidates.insert(0, source_scale_inv[rb].to(torch.float32))
        codes, errors, backs = [], [], []
        for scale in candidates:
            code = (x32 / scale[None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            back = code.to(torch.float32) * scale[None, :, None]  # as dequantize_fp8_blockwise computes it
            codes.append(code.view(torch.uint8))
            backs.append(back)
            errors.append((back.to(torch.float64) - x64).square().sum(dim=(0, 2)))
        pick = _first_smallest(errors)
        reused = 0
        if source_scale_inv is not None:
            held = torch.ones(r1 - r0, padded_cols, dtype=torch.bool, device=weight.device)
            held[:, :cols] = _held_exactly(backs[0].view(r1 - r0, padded_cols)[:, :cols], x)
            pick = torch.where(held.view(r1 - r0, col_blocks, bn).all(dim=2).all(dim=0), 0, pick)
            reused = int((pick == 0).sum())
        columns = torch.arange(col_blocks, device=weight.device)
        chosen_codes = torch.stack(codes).permute(0, 2, 1, 3)[pick, columns].permute(1, 0, 2).contiguous()  # [rows, blocks, bn]
        chosen = torch.stack(candidates)[pick, columns]
        out[r0:r1] = chosen_codes.reshape(r1 - r0, padded_cols)[:, :cols].view(torch.float8_e4m3fn)
        scale_inv[rb] = chosen
        if stats is not None:
            dequantized = (chosen_codes.view(torch.float8_e4m3fn).to(torch.float32) * chosen[None, :, None])
            stats.add(x32.view(r1 - r0, padded_cols)[:, :cols], dequantized.view(r1 - r0, padded_cols)[:, :cols],
                      col_blocks, reused, plain_err_sq=float(errors[-1].sum()))
    return out, scale_inv


MXFP4_EXPERTS = "mxfp4_experts"  # a fused [E, in, out] expert weight stored as MXFP4 of its [E, out, in] transpose
FP8_BLOCK = "fp8_block"  # a [rows, cols] weight stored as e4m3 + float32 ``weight_scale_inv`` per block
FORMATS = (MXFP4_EXPERTS, FP8_BLOCK)


class ExportQuantizer:
    """The published precision on export: which HF tensors are stored quantized, and how.

    ``rules`` is a family's ``QUANTIZED_HF`` data: ``(regex over HF names, format, report group)``.
    With ``source`` (an :class:`~recipes.hf.checkpoint.HFCheckpoint` of the quantized checkpoint
    the model was imported from) the source decides which tensors are quantized (those stored so
    there) and lends its block scales (see the module docstring); without it every matching tensor
    is quantized with the MX / ``amax / 448`` candidates only. ``stats`` holds the error per report
    group. ``device``: where to quantize (e.g. rank 0's GPU: the export holds its tensors on the
    CPU), one expert or one weight at a time; the results come back to the CPU."""

    def __init__(self, rules: Sequence[tuple[str, str, str]], hf_config: dict, source=None,
                 device: Optional[torch.device] = None) -> None:
        self.rules = [(re.compile(pattern), fmt, group) for pattern, fmt, group in rules]
        for _, fmt, _ in self.rules:
            if fmt not in FORMATS:
                raise ValueError(f"QUANTIZED_HF format {fmt!r} is not one of {', '.join(FORMATS)}")
        quant = hf_config.get("quantization_config") or {}
        self.block_size = tuple(int(b) for b in (quant.get("weight_block_size") or (128, 128)))
        self.source = source
        self.device = device
        self.stats: dict[str, QuantStats] = {}

    def _rule(self, name: str) -> Optional[tuple[str, str]]:
        return next(((fmt, group) for pattern, fmt, group in self.rules if pattern.search(name)), None)

    def _source_tensor(self, name: str) -> Optional[torch.Tensor]:
        if self.source is None or not self.source.has(name):
            return None
        try:
            return self._on_device(self.source.get(name))
        finally:
            self.source.release()  # scales are read once: keep no shard mapped

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device is None else tensor.to(self.device)

    def _plan(self, name: str) -> Optional[tuple[str, str, tuple[str, str]]]:
        """(format, report group, stored names) of HF tensor ``name``, or None if it stays plain."""
        found = self._rule(name)
        if found is None:
            return None
        fmt, group = found
        stored = (name + "_blocks", name + "_scales") if fmt == MXFP4_EXPERTS else (name, name + "_scale_inv")
        if self.source is not None and not self.source.has(stored[1]) and self.source.has(name):
            return None  # plain in the source checkpoint: plain in the export
        return fmt, group, stored

    def encode(self, name: str, tensor: torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
        """``{stored name: tensor}`` for HF tensor ``name`` in the published precision, or None
        where it stays a plain tensor."""
        plan = self._plan(name)
        if plan is None:
            return None
        fmt, group, stored = plan
        stats = self.stats.setdefault(group, QuantStats())
        if fmt == MXFP4_EXPERTS:
            if tensor.dim() != 3:
                raise ValueError(f"{name}: expected a fused [experts, in, out] expert weight, got {tuple(tensor.shape)}")
            source_scales = self._source_tensor(stored[1])
            parts = [quantize_mxfp4(self._on_device(tensor[e]).t(), None if source_scales is None else source_scales[e],
                                    stats=stats) for e in range(tensor.shape[0])]
            return {stored[0]: torch.stack([b.cpu() for b, _ in parts]),
                    stored[1]: torch.stack([s.cpu() for _, s in parts])}
        weight, scale_inv = quantize_fp8_blockwise(self._on_device(tensor), self.block_size,
                                                   self._source_tensor(stored[1]), stats=stats)
        return {name: weight.cpu(), stored[1]: scale_inv.cpu()}

    def round_trip(self, name: str, tensor: torch.Tensor, expert: Optional[int] = None) -> Optional[torch.Tensor]:
        """What a checkpoint written by :meth:`encode` loads for ``name`` (float32, same layout),
        or None where the tensor stays plain; ``expert``: ``tensor`` is that expert's row of a
        fused ``[E, ...]`` tensor."""
        plan = self._plan(name)
        if plan is None:
            return None
        fmt, _, stored = plan
        source = self._source_tensor(stored[1])
        if source is not None:
            source = source.to(tensor.device)
        if fmt == MXFP4_EXPERTS:
            if expert is None or tensor.dim() != 2:
                raise ValueError(f"{name}: expected one expert's [in, out] row of a fused expert weight")
            blocks, scales = quantize_mxfp4(tensor.t(), None if source is None else source[expert])
            return dequantize_mxfp4(blocks, scales, torch.float32).t()
        weight, scale_inv = quantize_fp8_blockwise(tensor, self.block_size, source)
        return dequantize_fp8_blockwise(weight, scale_inv, self.block_size, torch.float32)


def error_report(stats: dict[str, QuantStats]) -> list[str]:
    """One line per tensor group: max abs and relative error, plain round-to-nearest's relative
    error beside it, and where the blocks' scales came from."""
    return [f"quantization error {group}: max abs {s.max_abs:.3e}, relative {s.relative:.3e} (plain round-to-nearest "
            f"{s.plain_relative:.3e}); {s.reused}/{s.blocks} blocks kept their source scale"
            + (f", {s.neighbours} took a neighbour of the MX scale" if s.neighbours else "") for group, s in stats.items()]
