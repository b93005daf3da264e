"""The quantized schemes by name, without torch: those `--quantize` writes (the flag is checked before
anything imports torch) and those read dequantized (`READ`: what reports and notes call each one)."""

from __future__ import annotations

from typing import NamedTuple

from ckptconv.errors import CkptconvError

SCHEMES = ("fp8", "fp8-block", "nvfp4")
# quantization_config.quant_method read dequantized (formats/hf_quant.READERS)
METHODS = ("fp8", "mxfp4", "compressed-tensors", "modelopt")


class ReadScheme(NamedTuple):
    """A scheme read dequantized: what notes call its weights, where its scales are, and how its values are
    computed (docs/quantized.md has the reference each is bit-identical to)."""

    label: str
    keys: str
    product: str


READ: dict[str, ReadScheme] = {  # Quantized.scheme -> how it is described
    "fp8": ReadScheme("block-FP8 weights", "*_scale_inv", "the fp32 product rounded once"),
    "mxfp4": ReadScheme("MXFP4 expert tensors", "*_blocks, *_scales", "the fp32 product rounded once"),
    "ct-fp8": ReadScheme(
        "compressed-tensors FP8 weights", "*.weight_scale", "compressed-tensors' product in the scale's dtype"
    ),
    "ct-int": ReadScheme(
        "compressed-tensors packed int weights",
        "*.weight_packed, *.weight_scale, *.weight_shape, *.weight_zero_point",
        "compressed-tensors' product in the scale's dtype",
    ),
    "ct-nvfp4": ReadScheme(
        "compressed-tensors NVFP4 weights",
        "*.weight_packed, *.weight_scale, *.weight_global_scale",
        "compressed-tensors' product rounded to bf16",
    ),
    "ct-mxfp4": ReadScheme(
        "compressed-tensors MXFP4 weights",
        "*.weight_packed, *.weight_scale",
        "compressed-tensors' bf16 product",
    ),
    "mxfp8": ReadScheme("MXFP8 weights", "*_scale_inv E8M0", "the fp32 product rounded once"),
    "nvfp4": ReadScheme(
        "NVFP4 weights", "*weight_scale, *weight_scale_2", "FP4 * (scale * scale_2) in fp32 rounded once"
    ),
    "modelopt-fp8": ReadScheme(
        "ModelOpt FP8 weights", "*weight_scale", "the product in the dtype asked (ModelOpt's)"
    ),
    "dsv4-fp8": ReadScheme("DeepSeek-V4 FP8 weights", "*.scale E8M0", "the fp32 product rounded once"),
    "dsv4-fp4": ReadScheme("DeepSeek-V4 FP4 expert weights", "*.scale E8M0", "the fp32 product rounded once"),
}


def described(scheme: str, count: int, blocks: str = "") -> str:
    """ "14 block-FP8 weights (128x128 blocks, *_scale_inv)": `count` weights of `scheme`."""
    r = READ[scheme]
    return f"{count} {r.label} ({blocks + ' blocks, ' if blocks else ''}{r.keys})"


def check_scheme(scheme: str) -> str:
    """`scheme` when ckptconv writes it; refused with one line otherwise."""
    if scheme not in SCHEMES:
        raise CkptconvError(f"--quantize {scheme!r} is not one of {', '.join(SCHEMES)}")
    return scheme
