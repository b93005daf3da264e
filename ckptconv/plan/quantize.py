"""Planning `--quantize fp8`: the output tensors of dcp-to-hf with the chosen weights made block FP8. Pure.

    X.weight [R, C] bf16 (say)  ->  X.weight            [R, C] float8_e4m3fn        (quant = "fp8")
                                    X.weight_scale_inv  [ceil(R/128), ceil(C/128)] float32  (op "fp8_scale")

Both read the same source parts. The scale is written together with its weight (one read, one quantization:
`convert.write_files`), so it is never assembled on its own, and it always lands in its weight's file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.errors import CkptconvError
from ckptconv.plan.types import SCALE_OP, OutTensor, is_scale
from ckptconv.quant import fp8
from ckptconv.quant.policy import QuantPolicy, scale_key


def quantize_outs(
    outs: Sequence[OutTensor], quantize: QuantPolicy, policy: DtypePolicy
) -> tuple[list[OutTensor], dict[str, Any], list[str]]:
    """`outs` with every tensor `quantize` selects made FP8 and followed by its scale; the release's
    `quantization_config`; warnings (stacked expert tensors, which block FP8 leaves alone)."""
    result: list[OutTensor] = []
    quantized, kept, stacked = [], [], []
    for t in outs:
        if len(t.shape) == 3 and "experts" in t.hf_key and t.src.dtype.is_floating_point:
            stacked.append(t.hf_key)
        if not quantize.selects(t.hf_key, t.shape, t.src.dtype, policy.forces_fp32(t.hf_key)):
            result.append(t)
            if len(t.shape) == 2 and t.hf_key.endswith(".weight"):
                kept.append(t.hf_key)
            continue
        if t.offset is not None:
            raise CkptconvError(
                f"--quantize fp8: {t.hf_key!r} is shifted by its mapping rule's offset, which is not "
                "quantized; pass --quantize-skip with a pattern matching it"
            )
        quantized.append(t.hf_key)
        result.append(dataclasses.replace(t, dtype=fp8.FP8, quant="fp8"))
        shape = fp8.scale_shape(t.shape)
        result.append(
            dataclasses.replace(
                t,
                hf_key=scale_key(t.hf_key),
                shape=shape,
                dtype=torch.float32,
                op=SCALE_OP,
                layout=None,
                padded=False,
            )
        )
    warnings = []
    if stacked:
        warnings.append(
            f"--quantize fp8: {len(stacked)} stacked expert tensors ({stacked[0]}, ...) stay in --dtype; FP8 "
            "releases and transformers' loader hold experts per expert (--hf-experts per_expert)"
        )
    return result, quantize.config(quantized, kept), warnings


__all__ = ["SCALE_OP", "is_scale", "quantize_outs"]
