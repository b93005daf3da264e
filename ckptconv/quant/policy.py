"""`--quantize fp8`: which output tensors become block FP8, and the `quantization_config` that says so. Pure.

Quantized: every 2-D floating `*.weight` (linear layers: attention, MLP, shared and routed experts written per
expert), except

  embeddings, `lm_head`, norms, MoE router gates (`*.gate.weight`, `*router*`)   stay in --dtype
  keys matching a `--quantize-skip REGEX`                                        stay in --dtype
  keys matching an `--fp32 REGEX`                                                stay fp32 (--fp32 wins)

A quantized weight `X.weight` [R, C] is written as `float8_e4m3fn` [R, C] plus `X.weight_scale_inv` float32
[ceil(R/128), ceil(C/128)] (quant/fp8.py). A stacked or fused tensor (3-D experts) is not quantized: HF FP8
releases, and transformers' CPU loader, hold experts per expert (`--hf-experts per_expert`).

transformers reads `modules_to_not_convert` as the complete list of linear layers to leave alone (given a
list, it adds no defaults of its own), so every 2-D weight left unquantized names its module there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ckptconv.core.dtypes import CASTABLE
from ckptconv.core.user_regex import UserRegex
from ckptconv.quant import fp8
from ckptconv.quant.schemes import check_scheme

DEFAULT_SKIP = (
    r"embed",
    r"(^|\.)lm_head\.",
    r"norm",
    r"(^|\.)gate\.weight$",
    r"router",
    r"(^|\.)wte\.",
    r"(^|\.)wpe\.",
)


@dataclass
class QuantPolicy:
    """`scheme` is "fp8"; `skip` are `--quantize-skip` regexes (searched in the output key)."""

    scheme: str = "fp8"
    skip: Sequence[str] = ()
    _compiled: list[UserRegex] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_scheme(self.scheme)
        self._compiled = [UserRegex(pattern, "--quantize-skip") for pattern in self.skip]
        self._compiled += [UserRegex(p, "quantize's default skip") for p in DEFAULT_SKIP]

    def selects(self, key: str, shape: tuple[int, ...], source: torch.dtype, fp32: bool) -> bool:
        """Whether the output tensor `key` ([R, C], stored as `source`; `fp32`: an --fp32 pattern matches it)
        is quantized."""
        if len(shape) != 2 or not key.endswith(".weight") or source not in CASTABLE or 0 in shape or fp32:
            return False
        return not any(p.search(key) for p in self._compiled)

    def config(self, quantized: Iterable[str], kept: Iterable[str]) -> dict[str, object]:
        """The `quantization_config` of a release whose weights `quantized` are FP8 and whose other 2-D
        weights `kept` are not (module names: the keys without `.weight`)."""
        del quantized
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
            "modules_to_not_convert": sorted({k.removesuffix(".weight") for k in kept}),
        }


def scale_key(weight_key: str) -> str:
    """`X.weight` -> `X.weight_scale_inv`."""
    return weight_key + fp8.SCALE_SUFFIX
