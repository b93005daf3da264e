"""DeepSeek-V4's quantized weights (quant_method "fp8", scale_fmt "ue8m0", `expert_dtype` "fp4"): the scale of
`X.weight` is `X.scale`, an E8M0 power of two. No torch.

    dense (scheme "dsv4-fp8")          X.weight [O, I] float8_e4m3fn + X.scale [ceil(O/128), ceil(I/128)]
    routed experts ("dsv4-fp4")        X.weight [O, I/2] int8 (two E2M1 codes a byte, the low nibble first)
                                       + X.scale [O, ceil(I/32)]                               ->  [O, I]

This is what transformers 5.24.0 loads (`FineGrainedFP8HfQuantizer` renames `.scale` to `weight_scale_inv`
and `Fp8Dequantize._dequantize_one` dequantizes both, the fp32 product rounded once). The FP4 reading needs
config.json to say `expert_dtype` "fp4" (top level, as V4 ships it, or in quantization_config, as V4.1 does):
without it transformers allocates FP8 experts, and int8 bytes are no FP8 weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptconv.core.specs import Quantized, StoredTensor
from ckptconv.errors import CkptconvError
from ckptconv.formats.quant_base import logical

SCALE = ".scale"
WEIGHT = ".weight"
FP4_GROUP = 32
SCALE_DTYPES = ("float8_e8m0fnu", "float32", "bfloat16")


def weight_key(scale_key: str) -> str:
    """ "X.scale" -> "X.weight"."""
    return scale_key[: -len(SCALE)] + WEIGHT


def is_scale(tensors: Mapping[str, StoredTensor], key: str) -> bool:
    """Whether `key` ("X.scale") is the scale of a quantized "X.weight" (fp8 or int8); a norm's `.scale` (of a
    float weight, or with none) is a tensor of its own."""
    weight = tensors.get(weight_key(key))
    return weight is not None and weight.dtype_name in ("float8_e4m3fn", "int8")


def logical_weight(
    tensors: Mapping[str, StoredTensor],
    key: str,
    config: Mapping[str, Any],
    nominal: str,
    block: tuple[int, int],
) -> StoredTensor:
    """The logical tensor of the weight whose scale is `key`: "dsv4-fp8" of an fp8 weight (in the config's
    `block`), "dsv4-fp4" of an int8 one."""
    scale, name = tensors[key], weight_key(key)
    weight = tensors[name]
    if scale.dtype_name not in SCALE_DTYPES:
        raise CkptconvError(f"{scale.file}: {key!r} is {scale.dtype_name}, not an E8M0 or float scale")
    if len(weight.shape) != 2:
        raise CkptconvError(f"{weight.file}: {name!r} is {list(weight.shape)}; DeepSeek-V4 weights are 2-D")
    rows, cols = weight.shape
    if weight.dtype_name == "int8":
        if expert_dtype(config) != "fp4":
            raise CkptconvError(
                f"{weight.file}: {name!r} is int8 with a scale {key!r}, but config.json does not say "
                'expert_dtype "fp4" (DeepSeek-V4\'s FP4 experts): cannot tell how its bytes are stored'
            )
        shape = (rows, cols * 2)
        want = (rows, -(-shape[1] // FP4_GROUP))
        quant = Quantized(
            "dsv4-fp4", (weight, scale), FP4_GROUP, (("stored", "fp4"), ("block_size", (1, FP4_GROUP)))
        )
        what = f"1x{FP4_GROUP}"
    else:
        shape = (rows, cols)
        want = (-(-rows // block[0]), -(-cols // block[1]))
        quant = Quantized("dsv4-fp8", (weight, scale), block[1], (("block_size", block),))
        what = f"{block[0]}x{block[1]}"
    if scale.shape != want:
        raise CkptconvError(
            f"{scale.file}: {key!r} is {list(scale.shape)}, but {name!r} {list(weight.shape)} "
            f"({weight.dtype_name}, {what} blocks) needs {list(want)}"
        )
    return logical(weight, name, shape, nominal, quant)


def expert_dtype(config: Mapping[str, Any]) -> object:
    qc = config.get("quantization_config")
    inner = qc.get("expert_dtype") if isinstance(qc, dict) else None
    return inner if inner is not None else config.get("expert_dtype")
