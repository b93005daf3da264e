"""Planning `--quantize`: the output tensors of dcp-to-hf with the chosen weights quantized. Pure.

    X.weight [R, C] bf16 (say)  ->  X.weight            its stored form            (quant = the scheme)
                                    X.weight_scale_inv  (fp8), X.weight_scale ...  (op "fp8_scale", scale_of)

(the tensors of each scheme: `quant.policy.QuantPolicy.stored`). All read the weight's source parts. The
scales are written together with their weight (one read, one quantization: `hf_write.write_files`), so they
are never assembled on their own, and they always land in their weight's file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.errors import CkptconvError
from ckptconv.plan.types import SCALE_OP, OutTensor, is_scale
from ckptconv.quant.policy import QuantPolicy


def quantize_outs(
    outs: Sequence[OutTensor], quantize: QuantPolicy, policy: DtypePolicy
) -> tuple[list[OutTensor], dict[str, Any], list[str]]:
    """`outs` with every tensor `quantize` selects quantized and followed by its scales; the release's
    `quantization_config`; warnings (stacked expert tensors, which are left alone)."""
    scheme = quantize.scheme
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
                f"--quantize {scheme}: {t.hf_key!r} is shifted by its mapping rule's offset, which is not "
                "quantized; pass --quantize-skip with a pattern matching it"
            )
        quantized.append(t.hf_key)
        weight, *scales = quantize.stored(t.hf_key, t.shape, t.dtype)
        result.append(
            dataclasses.replace(
                t,
                dtype=weight.dtype,
                quant=scheme,
                quant_dtype=None if scheme == "fp8" else t.dtype,  # fp8 quantizes the source values
                stored_shape=weight.shape if weight.shape != t.shape else None,
            )
        )
        for scale in scales:
            result.append(
                dataclasses.replace(
                    t,
                    hf_key=scale.key,
                    shape=scale.shape,
                    dtype=scale.dtype,
                    op=SCALE_OP,
                    layout=None,
                    padded=False,
                    scale_of=t.hf_key,
                )
            )
    warnings = []
    if stacked:
        warnings.append(
            f"--quantize {scheme}: {len(stacked)} stacked expert tensors ({stacked[0]}, ...) stay in "
            f"--dtype; {'FP8' if scheme == 'fp8' else 'quantized'} releases and transformers' loader hold "
            "experts per expert (--hf-experts per_expert)"
        )
    return result, quantize.config(quantized, kept), warnings


__all__ = ["SCALE_OP", "is_scale", "quantize_outs"]
