"""`--quantize fp8-block`: compressed-tensors' `float-quantized` block FP8, as llm-compressor's FP8_BLOCK
scheme saves it and vLLM's compressed-tensors loader reads it. Pure math.

A 2-D weight [R, C] in the release's dtype D (bf16 unless --dtype says otherwise: the dtype the model would be
quantized in) is stored as `weight` float8_e4m3fn [R, C] plus `weight_scale` in D [ceil(R/128), ceil(C/128)],
the multiplier of each 128x128 block (edge blocks are the part that exists), `w ~ q.to(D) * s`.

Bit-identical to compressed-tensors 0.20.0, every step in D as it computes it:

    scale   `quantization.utils.helpers.calculate_qparams` (symmetric FLOAT 8 bits, BLOCK [128, 128]) from
            the block's min and max (what llm-compressor's min-max observer gives it):
            amax / (896.to(D) / 2), an all-zero block's 0 replaced by torch.finfo(D).eps
    values  `quantization.lifecycle.forward.quantize` (`_process_block`, `_quantize`): the weight padded
            with zeros to whole blocks, x / scale in D, clamped to [-448, 448], cast to float8_e4m3fn
            (through D and back, which changes no value), the padding cut off again

Blocks never straddle 128-row slabs, so a weight is quantized one slab at a time (the working copies are a
slab, not the weight).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max: compressed-tensors' FP8_E4M3_DATA.max
BLOCK = 128
SCALE_SUFFIX = "_scale"  # "X.weight" -> "X.weight_scale"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """[R, C] -> [ceil(R/128), ceil(C/128)]."""
    rows, cols = shape
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def _slab(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a weight [r, C] (r <= 128) in its dtype D -> (fp8 [r, C], scales in D [1, ceil(C/128)])."""
    rows, cols = w.shape
    sc = -(-cols // BLOCK)
    x = torch.nn.functional.pad(w, (0, sc * BLOCK - cols, 0, BLOCK - rows))
    blocks = x.view(1, BLOCK, sc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))  # = max(|min(block, 0)|, |max(block, 0)|), exact in D
    # calculate_qparams: bit_range (896, fp32) cast to D, halved, then the division in D
    scale = amax / (torch.tensor(2 * FP8_MAX).to(w.dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scale)
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(BLOCK, sc * BLOCK)[:rows, :cols], scale


def quantize(w: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole weight [R, C], cast to `dtype` (default: its own; the dtype it is quantized in) one slab at a
    time -> (fp8 [R, C], scales [ceil(R/128), ceil(C/128)] in that dtype), one 128-row slab at a time."""
    rows, _ = w.shape
    dtype = dtype or w.dtype
    q = torch.empty(w.shape, dtype=FP8)
    scale = torch.empty(scale_shape(tuple(w.shape)), dtype=dtype)
    for i, lo in enumerate(range(0, rows, BLOCK)):
        q_rows, s_row = _slab(w[lo : lo + BLOCK].to(dtype))
        q[lo : lo + BLOCK] = q_rows
        scale[i] = s_row[0]
    return q, scale
