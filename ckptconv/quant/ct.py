"""compressed-tensors' dequantization, value for value: its unpacking of int and FP4 codes and its products.

Each function is the order of operations and dtypes of compressed-tensors 0.20.0's decompress (the
compressor's `decompress`, then `quantization.lifecycle.forward.dequantize` -> `forward_helpers._dequantize`)
followed by the `.to(dtype)` of `entrypoints.convert.converters.ct_dequantizer.CompressedTensorsDequantizer`:

    float-quantized       w = ((q.to(sd) [- zp.to(sd)]) * s).to(dtype)              sd = the scale's dtype
    pack-quantized        w = ((int.to(sd) [- zp.to(sd)]) * s).to(dtype)             int: unpack_from_int32
    nvfp4-pack-quantized  w = ((fp4.to(g) * g).to(bf16)).to(dtype), g = s.to(bf16) / global_scale
    mxfp4-pack-quantized  w = ((fp4 * 2**(e - 127) in bf16).to(bf16)).to(dtype)

where fp4 is the E2M1 value in bf16 (exact) and `g`'s dtype is torch's promotion of bf16 and the global
scale's (fp32 for the [1]-shaped fp32 scale releases store). Scales here are already laid out as the values
(one per value): the products are elementwise, so a block of a weight is the same block of the whole.
"""

from __future__ import annotations

import sys

import torch

from ckptconv.quant import mxfp4

MX_BIAS = 127


def unpack_int(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[n, k] int32 words (starting at a 32-value group: bits words a group) -> [n, count] int8 values:
    value i at bits [i*bits, (i+1)*bits) of the little-endian stream, less 2**(bits - 1)
    (pack_quantized.helpers.unpack_from_int32)."""
    n, k = words.shape
    if bits in (4, 8):  # whole bytes: split them (values never straddle one) instead of shifting words
        # reshape(-1) first: a [n, 1] block of a transposed tensor is "contiguous" with a stride torch's
        # byte view refuses (torch ignores the strides of size-1 dims)
        data = words.contiguous().reshape(-1).view(torch.uint8).view(n, k, 4)
        if sys.byteorder == "big":
            data = data.flip(-1)
        if bits == 4:
            data = torch.stack((data & 0x0F, data >> 4), dim=-1)
        values = data.reshape(n, -1)[:, :count].to(torch.int16) - (1 << (bits - 1))
        return values.to(torch.int8)
    groups = -(-k // bits)
    stream = torch.zeros((n, groups * bits), dtype=torch.int64)
    stream[:, :k] = words.to(torch.int64) & 0xFFFFFFFF  # each word as its unsigned 32 bits
    stream = stream.view(n, groups, bits)
    out = torch.empty((n, groups, 32), dtype=torch.int64)
    mask = (1 << bits) - 1
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        value = stream[:, :, word] >> shift
        if shift + bits > 32:  # the value runs on into the next word
            value = value | (stream[:, :, word + 1] << (32 - shift))
        out[:, :, i] = value & mask
    return (out.view(n, groups * 32)[:, :count] - (1 << (bits - 1))).to(torch.int8)


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """[n, k] uint8 (low nibble first) -> [n, 2k] bf16 E2M1 values, -0.0 kept (unpack_fp4_from_uint8)."""
    pairs = mxfp4.byte_values()[packed.to(torch.int64)]  # [n, k, 2] fp32: the values are exact in bf16
    return pairs.flatten(-2).to(torch.bfloat16)


def mx_scales(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> bf16 2**(e - 127) (mx_utils.decompress_mx_scale: 255 is inf)."""
    return _MX_TABLE[exponents.to(torch.int64)]


def _mx_table() -> torch.Tensor:
    """The 256 bf16 powers of two: exact (2**-127 is a bf16 subnormal, 2**128 overflows to inf)."""
    exps = torch.arange(256, dtype=torch.float64) - MX_BIAS
    return torch.exp2(exps).to(torch.bfloat16)


_MX_TABLE = _mx_table()


def scaled(
    values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """float- and pack-quantized: values (fp8 or int8) and zero points to the scale's dtype, the difference
    times the scale in that dtype, then `dtype`."""
    out = values.to(scale.dtype)
    if zero is not None:
        out = out - zero.to(scale.dtype)
    return (out * scale).to(dtype)


def nvfp4(
    values: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """nvfp4-pack-quantized: `values` bf16 FP4, `scale` float8_e4m3fn, `global_scale` as stored (its shape
    and dtype decide the dtype of the quotient, as in `_dequantize`); rounded to bf16, then `dtype`."""
    quotient = scale.to(torch.bfloat16) / global_scale
    return (values.to(quotient.dtype) * quotient).to(torch.bfloat16).to(dtype)


def mxfp4_pack(values: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mxfp4-pack-quantized: `values` bf16 FP4, `exponents` uint8 E8M0; the bf16 product, then `dtype`."""
    scale = mx_scales(exponents)
    return (values.to(scale.dtype) * scale).to(torch.bfloat16).to(dtype)
