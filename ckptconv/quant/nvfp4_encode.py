"""`--quantize nvfp4`: NVIDIA ModelOpt's NVFP4, as ModelOpt exports it and vLLM's / sglang's ModelOpt loaders
read it. Pure math.

A 2-D weight [O, I] (I a multiple of 16) in the release's dtype is stored as

    weight          uint8 [O, I/2]           two FP4 E2M1 codes a byte, the even column in the low nibble
    weight_scale    float8_e4m3fn [O, I/16]  each 16-value group's scale
    weight_scale_2  float32 []               the weight's global scale
    w ~ e2m1 * weight_scale * weight_scale_2

Bit-identical to nvidia-modelopt 0.47.0's `NVFP4QTensor.quantize(w, 16)` (the dynamic path of
`modelopt.torch.quantization.qtensor.nvfp4_tensor`), in fp32 as it computes it:

    weight_scale_2  amax(|w|).float() / (6 * 448)                           (get_weights_scaling_factor_2)
    weight_scale    amax(|group|).float() / (6 * weight_scale_2), 0 -> 1.0,
                    clamped to [2**-9, 448], cast to float8_e4m3fn          (get_weights_scaling_factor)
    codes           w / (weight_scale.float() * weight_scale_2), rounded to the nearest E2M1 value (ties to
                    the even code; past 6 -> 6), the sign bit set for every negative value (`_cast_fp4`)

One deviation: an all-zero weight (amax 0), where ModelOpt divides 0 by 0 and stores NaN scales, gets
weight_scale_2 0 and group scales 1.0, so it reads back as zeros.

The groups run along a row, so after the global amax (one pass over the weight) a weight is quantized one
slab of rows at a time.
"""

from __future__ import annotations

import torch

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
SLAB_ROWS = 256
# the midpoints between neighbouring E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); a value on one of
# 0.75, 1.75, 3.5 rounds up (to the even code), on one of 0.25, 1.25, 2.5, 5 down
BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
ODD_BOUNDS = torch.tensor([0.75, 1.75, 3.5])


def quantizable(shape: tuple[int, ...]) -> bool:
    """Whether a weight of `shape` has NVFP4's layout: 2-D, its input dim a multiple of 16."""
    return len(shape) == 2 and shape[1] % GROUP == 0 and shape[1] > 0


def global_scale(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight_scale_2 of `w` cast to `dtype`: amax(|w|) / (6 * 448), fp32 0-d. The amax is taken before the
    cast (a rounding never reorders values, so the cast amax is the amax of the cast values); |w|'s max is
    max(-min, max), so no |w| copy of the weight is made."""
    lo, hi = torch.aminmax(w)
    return torch.maximum(-lo, hi).to(dtype or w.dtype).float() / (E2M1_MAX * E4M3_MAX)


def _codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scales) -> E2M1 codes (uint8, sign in bit 3), as ModelOpt's
    `_cast_fp4` rounds them."""
    sign = (x < 0).to(torch.uint8)
    mag = x.abs()
    code = torch.searchsorted(BOUNDS, mag, out_int32=True).to(torch.uint8)
    code += (mag.unsqueeze(-1) == ODD_BOUNDS).any(dim=-1).to(torch.uint8)
    return (sign << 3) + code


def _slab(w: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a weight [r, I] -> (packed uint8 [r, I/2], float8_e4m3fn scales [r, I/16])."""
    rows, cols = w.shape
    groups = w.view(rows, cols // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).float()
    scale = amax / (E2M1_MAX * scale_2)
    scale[scale == 0] = 1.0
    scale = scale.clamp(min=2**-9, max=E4M3_MAX).to(FP8)
    scaled = groups / (scale.to(torch.float32) * scale_2).unsqueeze(-1)
    codes = _codes(scaled.view(rows, cols))
    return (codes[:, 1::2] << 4) | codes[:, 0::2], scale


def quantize(
    w: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole weight [O, I] (I a multiple of 16), cast to `dtype` (default: its own; the dtype it is
    quantized in) one slab at a time -> (uint8 [O, I/2], float8_e4m3fn [O, I/16], fp32 weight_scale_2 0-d),
    a slab of rows at a time."""
    rows, cols = w.shape
    dtype = dtype or w.dtype
    scale_2 = global_scale(w, dtype)
    zero = bool(scale_2 == 0)
    if zero:  # ModelOpt's 0 / 0: NaN scales; 1.0 instead (codes 0, weight_scale_2 0)
        scale_2 = torch.tensor(1.0)
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scale = torch.empty(rows, cols // GROUP, dtype=FP8)
    for lo in range(0, rows, SLAB_ROWS):
        slab = w[lo : lo + SLAB_ROWS].to(dtype)
        packed[lo : lo + SLAB_ROWS], scale[lo : lo + SLAB_ROWS] = _slab(slab, scale_2)
    return packed, scale, torch.zeros(()) if zero else scale_2
