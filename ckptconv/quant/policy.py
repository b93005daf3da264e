"""`--quantize`: which output tensors are quantized, the tensors each is stored as, and the
`quantization_config` that says so. Pure.

Quantized: every 2-D floating `*.weight` (linear layers: attention, MLP, shared and routed experts written per
expert), except

  embeddings, `lm_head`, norms, MoE router gates (`*.gate.weight`, `*router*`)   stay in --dtype
  keys matching a `--quantize-skip REGEX`                                        stay in --dtype
  keys matching an `--fp32 REGEX`                                                stay fp32 (--fp32 wins)
  nvfp4: a weight whose input dim is not a multiple of 16                       stays in --dtype

What a quantized weight `X.weight` [R, C] is written as (D: the dtype it would have been written in, --dtype):

  fp8        X.weight float8_e4m3fn [R, C] + X.weight_scale_inv float32 [ceil(R/128), ceil(C/128)]
             (DeepSeek-V3's layout, quant/fp8.py)
  fp8-block  X.weight float8_e4m3fn [R, C] + X.weight_scale D [ceil(R/128), ceil(C/128)]
             (compressed-tensors' float-quantized block layout, quant/ct_encode.py)
  nvfp4      X.weight uint8 [R, C/2] + X.weight_scale float8_e4m3fn [R, C/16] + X.weight_scale_2 float32 []
             + X.input_scale float32 [] = 1.0 (ModelOpt's NVFP4 layout, quant/nvfp4_encode.py)

nvfp4's `input_scale` is the activations' global scale that ModelOpt calibrates and vLLM's and sglang's NVFP4
(W4A4) linear layers load (a layer without one is refused there); a conversion of weights alone has no
activations to calibrate, so it writes 1.0, as slime's HF-to-NVFP4 converter does.

A stacked or fused tensor (3-D experts) is not quantized: HF FP8 releases, and transformers' CPU loader, hold
experts per expert (`--hf-experts per_expert`).

The unquantized 2-D weights are named in the config's list of modules left alone (`modules_to_not_convert`,
`ignore`): transformers reads fp8's as the complete list (given a list, it adds no defaults of its own), and
vLLM quantizes every linear layer of a compressed-tensors or ModelOpt release that its `ignore` does not name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ckptconv.core.dtypes import CASTABLE
from ckptconv.core.user_regex import UserRegex
from ckptconv.quant import ct_encode, fp8, nvfp4_encode
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


CT_VERSION = (
    "0.20.0"  # the compressed-tensors whose layout and math fp8-block reproduces (its config's version)
)
MODELOPT_VERSION = "0.47.0"  # the ModelOpt whose layout and math nvfp4 reproduces (its config's producer)
INPUT_SCALE = 1.0  # nvfp4's input_scale: no activations calibrated (see above)


class Stored(NamedTuple):
    """One tensor a quantized weight is written as: its key, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class QuantPolicy:
    """`scheme` is one of `schemes.SCHEMES`; `skip` are `--quantize-skip` regexes (searched in the output
    key)."""

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
        if self.scheme == "nvfp4" and not nvfp4_encode.quantizable(shape):
            return False
        return not any(p.search(key) for p in self._compiled)

    def stored(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Stored, ...]:
        """The tensors the weight `key` [R, C] (written as `dtype` unquantized) is stored as: the weight
        itself first, then its scales (in the order `encode` gives them)."""
        rows, cols = shape
        if self.scheme == "fp8":
            return (
                Stored(key, shape, fp8.FP8),
                Stored(scale_key(key), fp8.scale_shape(shape), torch.float32),
            )
        if self.scheme == "fp8-block":
            return (
                Stored(key, shape, ct_encode.FP8),
                Stored(key + "_scale", ct_encode.scale_shape(shape), dtype),
            )
        return (
            Stored(key, (rows, cols // 2), torch.uint8),
            Stored(key + "_scale", (rows, cols // nvfp4_encode.GROUP), nvfp4_encode.FP8),
            Stored(key + "_scale_2", (), torch.float32),
            Stored(key.removesuffix("weight") + "input_scale", (), torch.float32),
        )

    def config(self, quantized: Iterable[str], kept: Iterable[str]) -> dict[str, object]:
        """The `quantization_config` of a release whose weights `quantized` are quantized and whose other 2-D
        weights `kept` are not (module names: the keys without `.weight`)."""
        del quantized
        ignore = sorted({k.removesuffix(".weight") for k in kept})
        if self.scheme == "fp8-block":
            return _ct_config(ignore)
        if self.scheme == "nvfp4":
            return _modelopt_config(ignore)
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
            "modules_to_not_convert": ignore,
        }


def encode(scheme: str, w: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """The tensors `QuantPolicy.stored` lists for a fp8-block or nvfp4 weight, from the weight `w` [R, C]
    cast to `dtype` (the dtype it would have been written in; default: w's), a slab of rows at a time."""
    if scheme == "fp8-block":
        return ct_encode.quantize(w, dtype)
    return (*nvfp4_encode.quantize(w, dtype), torch.tensor(INPUT_SCALE))


def _ct_config(ignore: list[str]) -> dict[str, object]:
    """compressed-tensors' quantization_config of an FP8_BLOCK release, key for key as its
    `ModelCompressor.update_config` writes it."""
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": {
                    "dynamic": True,
                    "group_size": ct_encode.BLOCK,
                    "num_bits": 8,
                    "strategy": "group",
                    "symmetric": True,
                    "type": "float",
                },
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "block_structure": [ct_encode.BLOCK, ct_encode.BLOCK],
                    "dynamic": False,
                    "group_size": None,
                    "num_bits": 8,
                    "strategy": "block",
                    "symmetric": True,
                    "type": "float",
                },
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def _modelopt_config(ignore: list[str]) -> dict[str, object]:
    """ModelOpt's quantization_config of an NVFP4 export (`convert_hf_quant_config_format` of its
    hf_quant_config), plus the top-level `group_size` sglang's ModelOpt loader reads."""
    group = nvfp4_encode.GROUP
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group}
    return {
        "config_groups": {"group_0": {"input_activations": fp4, "weights": dict(fp4), "targets": ["Linear"]}},
        "ignore": ignore,
        "quant_algo": "NVFP4",
        "group_size": group,
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quant_method": "modelopt",
    }


def scale_key(weight_key: str) -> str:
    """`X.weight` -> `X.weight_scale_inv` (fp8)."""
    return weight_key + fp8.SCALE_SUFFIX
