"""Decoding two-level FP4 (E2M1 codes, two a byte) with a scale per group: ModelOpt's NVFP4 and DeepSeek-V4's
routed experts. Decode only (the writer's encoder is `quant.nvfp4_encode`).

    packed [..., G*group/2] uint8 or int8 (low nibble: the even value, high nibble: the odd one)
    scale  [..., G]         float8_e4m3fn (NVFP4, group 16) or float8_e8m0fnu (DeepSeek-V4, group 32)
    global                  fp32, one value (NVFP4's `weight_scale_2`; none for DeepSeek-V4)
    ->     [..., G*group]   in `dtype`: (FP4[code] * (scale.float() * global)).to(dtype)

The order of the fp32 products, and the sign of zero, are the references': nvidia-modelopt 0.47.0's
`NVFP4QTensor.dequantize` multiplies the block scale by the global scale first (one fp32 rounding), then the
FP4 values (its table decodes code 8 as +0.0) by that, then casts once; transformers 5.24.0's
`Fp8Dequantize._dequantize_one` multiplies the FP4 values (code 8: -0.0) by the fp32 of the E8M0 scale
(exact) and casts once.
"""

from __future__ import annotations

import torch

from ckptconv.quant.mxfp4 import byte_values

NVFP4_GROUP = 16  # values per float8_e4m3fn scale
DSV4_GROUP = 32  # values per E8M0 scale of DeepSeek-V4's FP4 experts


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    group: int,
    global_scale: torch.Tensor | None = None,
    negative_zero: bool = True,
) -> torch.Tensor:
    """packed [..., G*group/2] (uint8 / int8) and scale [..., G] -> values [..., G*group] in `dtype`;
    `global_scale` (fp32, broadcastable to scale) multiplies each scale first. A last group may be partial:
    values past packed's end are not returned. Code 8 (E2M1's -0) is -0.0 as transformers decodes it, or
    +0.0 (`negative_zero=False`) as ModelOpt's table has it."""
    width = packed.shape[-1] * 2
    table = byte_values() if negative_zero else byte_values() + 0.0  # -0.0 + 0.0 is +0.0
    pairs = table[packed.view(torch.uint8).to(torch.int64)]  # [..., P, 2]
    values = pairs.reshape(*packed.shape[:-1], width)
    s = scale.to(torch.float32)
    if global_scale is not None:
        s = s * global_scale.to(torch.float32)
    s = s.repeat_interleave(min(group, width), -1)[..., :width]  # a group wider than the values: one scale
    return (values * s).to(dtype)
