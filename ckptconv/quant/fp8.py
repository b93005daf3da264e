"""Block FP8, as DeepSeek-V3 releases and transformers' "fp8" quantization store it.

A 2-D weight [R, C] is stored as `float8_e4m3fn` [R, C] plus `weight_scale_inv` [ceil(R/128), ceil(C/128)]:
the dequantization multiplier of each 128x128 block (edge blocks are the part that exists), `w ~ q * s`.

    quantize   (DeepSeek's `act_quant`, xtuner, Megatron-Bridge; not transformers' own, which multiplies by
               448/amax and rounds differently): s = amax(|block|) / 448 in fp32 (1.0 for an all-zero
               block; the smallest normal fp32 where amax / 448 underflows to 0, which would give NaN),
               q = (w / s).clamp(-448, 448).to(float8_e4m3fn)
    dequantize (torch's QuantizedHuggingFaceStorageReader): (q.float() * s.float()).to(dtype), the fp32
               product rounded once; also MXFP8's 1x32 blocks with E8M0 scales (transformers 5.24.0's
               `Fp8Dequantize._dequantize_one` computes the same fp32 product)

Both work on any rows [lo, hi) of a weight whose bounds are multiples of the block (or the end), so a weight
is quantized one row slab at a time and a reader dequantizes only the rows it needs.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
TINY = torch.finfo(torch.float32).smallest_normal


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """[R, C] -> [ceil(R/block), ceil(C/block)]."""
    rows, cols = shape
    return (-(-rows // block), -(-cols // block))


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a weight [r, C] (r a multiple of `block`, or the weight's last rows) -> (fp8 [r, C],
    fp32 scales [ceil(r/block), ceil(C/block)])."""
    rows, cols = w.shape
    sr, sc = scale_shape((rows, cols), block)
    x = torch.nn.functional.pad(w.to(torch.float32), (0, sc * block - cols, 0, sr * block - rows))
    x = x.view(sr, block, sc, block)
    amax = x.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # a block of values so small that amax / 448 underflows to 0 would divide 0 by 0 (NaN): the smallest
    # normal scale quantizes it to zeros instead (its values are below fp8's resolution at any scale)
    scale = torch.where(scale > 0, scale, TINY)
    q = (x / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(sr * block, sc * block)[:rows, :cols].contiguous(), scale


def quantize_into(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> None:
    """`quantize` a whole weight [R, C] into `q` (fp8 [R, C]) and `scale`, one slab of `block` rows at a time
    (the fp32 working copy is one slab, not the weight)."""
    for i, lo in enumerate(range(0, w.shape[0], block)):
        q_rows, s_row = quantize(w[lo : lo + block], block)
        q[lo : lo + block] = q_rows
        scale[i] = s_row[0]


def quantize_whole(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_into` new tensors: a whole weight [R, C] -> (fp8 [R, C], fp32 scales)."""
    q = torch.empty(w.shape, dtype=FP8)
    scale = torch.empty(scale_shape(tuple(w.shape), block), dtype=torch.float32)
    quantize_into(w, q, scale, block)
    return q, scale


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block: int = BLOCK,
    cols_block: int | None = None,
    skip: int = 0,
) -> torch.Tensor:
    """Rows of a weight (fp8 [r, C], starting `skip` rows into the first scale row's block of `block` rows)
    and their scale rows [ceil((skip + r)/block), ceil(C/cols_block)] (any float dtype, E8M0 included; the
    blocks are `block` x `cols_block`, square when that is None: MXFP8's are 1 x 32) -> [r, C] in `dtype`."""
    rows, cols = q.shape
    cb = block if cols_block is None else cols_block
    # a block larger than the rows (columns) has one scale row (column) for them: repeated only as often as
    # there are rows (columns), so the temporaries are the weight's size whatever the block
    s = scale.to(torch.float32).repeat_interleave(min(block, skip + rows), 0)[skip : skip + rows]
    s = s.repeat_interleave(min(cb, cols), 1)[:, :cols]
    return (q.to(torch.float32) * s).to(dtype)


def scale_rows(lo: int, hi: int, block: int = BLOCK) -> tuple[int, int]:
    """The scale rows that cover weight rows [lo, hi)."""
    return lo // block, -(-hi // block)
