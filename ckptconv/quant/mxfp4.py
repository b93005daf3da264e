"""MXFP4, as gpt-oss stores its experts: two FP4 (E2M1) codes a byte, one E8M0 scale byte per 32 values.

    blocks [..., G, 16] uint8 (low nibble: the even value, high nibble: the odd one)
    scales [..., G]     uint8 (the power of two 2**(s - 127))
    ->     [..., G*32]  in `dtype`: FP4[code] * 2**(s - 127), the exact product rounded once

Bit-identical to transformers' `convert_moe_packed_tensors` (which uses `torch.ldexp` in the target dtype)
for every code, every scale byte (255 included: infinities, zeros stay zeros) and bf16 / fp16 / fp32 targets.
That function also transposes the last two dims of [E, O, G*32] to transformers' [E, in, out] layout: a
caller does that (`formats.dequant`).
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale
BYTES = 16  # bytes per group
BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G*32] in `dtype`.

    In fp32 every product is exact or overflows (FP4 values have 2 significant bits, 2**(s - 127) spans
    2**-127..2**128): the power of two is applied as two halves of at most 2**64 each, so no intermediate
    overflows or underflows, and the only rounding is the final cast."""
    pairs = byte_values()[blocks.to(torch.int64)]  # [..., G, 16, 2]: (low nibble, high nibble)
    values = pairs.reshape(*blocks.shape[:-1], GROUP)  # [..., G, 32]
    exponent = scales.to(torch.int32) - BIAS
    half = torch.div(exponent, 2, rounding_mode="floor")
    values *= torch.exp2(half.to(torch.float32)).unsqueeze(-1)
    values *= torch.exp2((exponent - half).to(torch.float32)).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def byte_values() -> torch.Tensor:
    """[256, 2] fp32: the two FP4 values of every byte, the low nibble's first."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)
