"""Dequantization of the quantized weights in the released Hugging Face checkpoints.

The published gpt-oss checkpoints store their expert weights as MXFP4 (``*_blocks`` + ``*_scales``)
and the published DeepSeek-V3 checkpoint stores its linear weights as block-scaled FP8
(``weight`` + ``weight_scale_inv``). Megatron-Core trains in bf16/fp32, so the importers
(:mod:`recipes.hf.gpt_oss`, :mod:`recipes.hf.deepseek_v3`) turn them into plain floating-point
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
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "FP4_E2M1_VALUES",
    "MXFP4_BLOCK",
    "dequantize_mxfp4",
    "gpt_oss_expert_weight_from_mxfp4",
    "dequantize_fp8_blockwise",
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
    try:
        bm, bn = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}") from None
    if bm < 1 or bn < 1:
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
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
