"""NVIDIA ModelOpt's NVFP4 (and FP8) releases (config.json's quantization_config: quant_method "modelopt",
quant_algo "NVFP4", "FP8" or "MIXED_PRECISION"), as ModelOpt 0.47.0's `export_hf_checkpoint` writes them.
No torch.

    M.weight [O, I/2] uint8 (two E2M1 codes a byte, the low nibble first)
    M.weight_scale [O, I/16] float8_e4m3fn, M.weight_scale_2 [] float32       ->  M.weight [O, I]
    stacked experts: M.weight [E, O, I/2] + M.weight_scale [E, O, I/16] + weight_scale_2 shared ([] / [1])
        or per expert ([E]) -> [E, O, I]; ModelOpt's bmm experts (Llama4, gpt-oss) X [E, I/2, O] +
        X_weight_scale [E, I/16, O] + X_weight_scale_2 -> X [E, I, O] (their bf16 [E, in, out] layout)
    w = FP4 * (weight_scale * weight_scale_2), `quant.nvfp4`; `input_scale`, `k_scale`, `v_scale` dropped.

Which modules: quant_algo "NVFP4" (or "W4A16_NVFP4", the same weights): every module with a `weight_scale`;
"MIXED_PRECISION": `quantized_layers` names each module's quant_algo (NVFP4 and FP8 ones read, any other
refused by name). "FP8" (scheme "modelopt-fp8"): M.weight [O, I] float8_e4m3fn + M.weight_scale [] fp32,
w = q.to(dtype) * scale.to(dtype), the product in the dtype asked as ModelOpt 0.47.0's FP8QTensor.dequantize
computes it. `ignore` (ModelOpt's `exclude_modules`, also read) patterns, fnmatch wildcards or "re:"
regexes, keep their plain weights; a quantized part of an ignored module is refused. The group size is
`group_size` (top level, per layer, or config_groups' weights), 16 when none says. vLLM and sglang read the
same tensors (their ModelOpt loaders; older releases ship only hf_quant_config.json, which is not read: its
global scales are refused without a quantization_config in config.json).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from ckptconv.core.specs import Quantized, StoredTensor
from ckptconv.errors import CkptconvError
from ckptconv.formats.quant_base import Recognised, logical, nominal_dtype

SCALE, SCALE_2 = "weight_scale", "weight_scale_2"
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
FP8_ALGOS = ("FP8",)  # per-tensor FP8: M.weight float8_e4m3fn + M.weight_scale [] fp32
DROPPED = ("input_scale", "k_scale", "v_scale")  # activation and KV-cache scales: not weights
GROUP = 16
SCALE_2_DTYPES = ("float32", "bfloat16", "float16")


def recognised(tensors: dict[str, StoredTensor], config: Mapping[str, Any]) -> Recognised:
    """Every NVFP4 weight of a ModelOpt release as one logical tensor, its activation scales dropped."""
    qc = config.get("quantization_config")
    assert isinstance(qc, dict)
    algo = qc.get("quant_algo")
    layers = qc.get("quantized_layers") if algo == "MIXED_PRECISION" else None
    if algo != "MIXED_PRECISION" and algo not in NVFP4_ALGOS + FP8_ALGOS:
        _refuse(tensors, f"quant_algo {algo!r}")
    if algo == "MIXED_PRECISION" and not isinstance(layers, dict):
        _refuse(tensors, "quant_algo 'MIXED_PRECISION' without a quantized_layers object")
    ignore = _patterns(qc)
    nominal = nominal_dtype(config)
    out: dict[str, StoredTensor] = {}
    for key, t in tensors.items():
        weight = _weight_of(key)
        if weight is None or key.endswith("_2"):
            continue
        module = weight.removesuffix(".weight")
        where = f"{t.file}: {key!r}"
        if any(_matches(module, p) for p in ignore):
            raise CkptconvError(
                f"{where} is a quantized part of {module!r}, which quantization_config ignores"
            )
        group, layer_algo = _group(qc, t), algo
        if layers is not None:
            cfg = _layer(layers, module)
            layer_algo = cfg.get("quant_algo") if isinstance(cfg, dict) else None
            if layer_algo not in NVFP4_ALGOS + FP8_ALGOS:
                raise CkptconvError(
                    f"{where}: quantized_layers gives {module!r} quant_algo {layer_algo!r}, which ckptconv "
                    f"does not dequantize (it reads {', '.join(NVFP4_ALGOS + FP8_ALGOS)})"
                )
            if isinstance(cfg, dict):
                group = _size(cfg.get("group_size", group), where)
        if layer_algo in FP8_ALGOS:
            out[weight] = _fp8(tensors, weight, key, nominal)
        else:
            out[weight] = _nvfp4(tensors, weight, key, nominal, group)
    _no_lone_parts(tensors, out)
    dropped = frozenset(k for k in tensors if k.rpartition(".")[2] in DROPPED or k.endswith("_input_scale"))
    return Recognised(out, dropped)


def _weight_of(key: str) -> str | None:
    """The weight key whose `weight_scale` `key` is: "M.weight_scale" -> "M.weight" (bmm experts:
    "X_weight_scale" -> "X")."""
    if key.endswith("." + SCALE):
        return key[: -len(SCALE)] + "weight"
    if key.endswith("_" + SCALE):
        return key[: -len(SCALE) - 1]
    return None


def _nvfp4(
    tensors: Mapping[str, StoredTensor], name: str, key: str, nominal: str, group: int
) -> StoredTensor:
    scale = tensors[key]
    weight = tensors.get(name)
    if weight is None:
        raise CkptconvError(f"{scale.file}: NVFP4 scale {key!r} has no weight {name!r}")
    scale_2 = tensors.get(key + "_2")
    if scale_2 is None:
        raise CkptconvError(f"{scale.file}: NVFP4 weight {name!r} has no {key + '_2'!r} (its global scale)")
    if weight.dtype_name != "uint8":
        raise CkptconvError(f"{weight.file}: NVFP4 weight {name!r} is {weight.dtype_name}, not uint8")
    if scale.dtype_name != "float8_e4m3fn":
        raise CkptconvError(f"{scale.file}: NVFP4 scale {key!r} is {scale.dtype_name}, not float8_e4m3fn")
    if scale_2.dtype_name not in SCALE_2_DTYPES:
        raise CkptconvError(f"{scale_2.file}: {scale_2.key!r} is {scale_2.dtype_name}, not a float scale")
    shape, layout = _shape(weight, scale, group)
    experts = shape[0] if len(shape) == 3 else 1
    count = 1
    for n in scale_2.shape:
        count *= n
    if count != 1 and not (len(shape) == 3 and scale_2.shape in ((experts,), (experts, 1), (experts, 1, 1))):
        raise CkptconvError(
            f"{scale_2.file}: {scale_2.key!r} is {list(scale_2.shape)}; the global scale of {name!r} "
            f"{list(weight.shape)} is one value or one per expert"
        )
    args = (("stored", "nvfp4"), ("layout", layout), ("block_size", group))
    return logical(weight, name, shape, nominal, Quantized("nvfp4", (weight, scale, scale_2), group, args))


def _fp8(tensors: Mapping[str, StoredTensor], name: str, key: str, nominal: str) -> StoredTensor:
    """A per-tensor FP8 weight ("FP8" layers): `name` [O, I] float8_e4m3fn and its scale `key` (one value)."""
    scale = tensors[key]
    weight = tensors.get(name)
    if weight is None:
        raise CkptconvError(f"{scale.file}: FP8 scale {key!r} has no weight {name!r}")
    if weight.dtype_name != "float8_e4m3fn":
        raise CkptconvError(f"{weight.file}: FP8 weight {name!r} is {weight.dtype_name}, not float8_e4m3fn")
    if scale.dtype_name not in SCALE_2_DTYPES:
        raise CkptconvError(f"{scale.file}: {key!r} is {scale.dtype_name}, not a float scale")
    if scale.shape not in ((), (1,)) or len(weight.shape) != 2:
        raise CkptconvError(
            f"{scale.file}: FP8 scale {key!r} is {list(scale.shape)} for {name!r} {list(weight.shape)}: "
            "ModelOpt's FP8 is one scale for a 2-D weight"
        )
    quant = Quantized("modelopt-fp8", (weight, scale), 1, (("block_size", tuple(weight.shape)),))
    return logical(weight, name, weight.shape, nominal, quant)


def _shape(weight: StoredTensor, scale: StoredTensor, group: int) -> tuple[tuple[int, ...], str]:
    """The logical shape and layout ("rows" or "bmm") of packed `weight` as `scale`'s shape fits it."""
    w = weight.shape
    if len(w) in (2, 3) and scale.shape == (*w[:-1], -(-w[-1] * 2 // group)):
        return (*w[:-1], w[-1] * 2), "rows"
    if len(w) == 3 and scale.shape == (w[0], -(-w[1] * 2 // group), w[2]):
        return (w[0], w[1] * 2, w[2]), "bmm"
    want = [*w[:-1], -(-w[-1] * 2 // group)]
    raise CkptconvError(
        f"{scale.file}: NVFP4 scale {scale.key!r} is {list(scale.shape)}, but {weight.key!r} "
        f"{list(w)} (uint8, two values a byte, {group} values a scale) needs {want}"
    )


def _no_lone_parts(tensors: Mapping[str, StoredTensor], found: Mapping[str, StoredTensor]) -> None:
    """A global scale without its block scale, or a uint8 weight beside NVFP4 scales without its own, is
    refused: its values cannot be dequantized."""
    parts = {p.key for t in found.values() if t.quant is not None for p in t.quant.parts}
    for key, t in tensors.items():
        if key.endswith(SCALE_2) and key not in parts:
            raise CkptconvError(f"{t.file}: NVFP4 global scale {key!r} has no {key[:-2]!r}")
        if t.dtype_name in ("uint8", "float8_e4m3fn") and key not in parts:
            scale = key[:-6] + "weight_scale" if key.endswith(".weight") else key + "_weight_scale"
            raise CkptconvError(
                f"{t.file}: {key!r} is {t.dtype_name} (quantized) with no {scale!r}: its values cannot be "
                "dequantized"
            )


def _group(qc: Mapping[str, Any], first: StoredTensor) -> int:
    """The group size the config says (top level, or config_groups' weights), else 16 (`first`: a tensor of
    the release, whose directory's config.json an error names)."""
    size = qc.get("group_size")
    groups = qc.get("config_groups")
    if size is None and isinstance(groups, dict):
        for g in groups.values():
            w = g.get("weights") if isinstance(g, dict) else None
            if isinstance(w, dict) and w.get("num_bits") == 4 and w.get("type") == "float":
                size = w.get("group_size")
                break
    where = f"{first.file.parent / 'config.json'}: quantization_config"
    return _size(GROUP if size is None else size, where)


MAX_GROUP = 1 << 16  # ModelOpt writes 16; a larger claim is no NVFP4 release


def _size(size: object, where: str) -> int:
    if type(size) is not int or size <= 0 or size % 2 or size > MAX_GROUP:
        raise CkptconvError(
            f"{where}: NVFP4 group_size {size!r} is not an even integer from 2 to {MAX_GROUP} (ModelOpt "
            "writes 16): fix it in config.json"
        )
    return size


def _layer(layers: Mapping[str, Any], module: str) -> Any:
    """The quantized_layers entry of `module` (or of its experts' parent, for bmm experts)."""
    if module in layers:
        return layers[module]
    return layers.get(module.rpartition(".")[0])


def _patterns(qc: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    for name in ("ignore", "exclude_modules"):
        value = qc.get(name)
        if isinstance(value, list):
            found += [p for p in value if isinstance(p, str)]
    return found


def _matches(module: str, pattern: str) -> bool:
    """ModelOpt's wildcard patterns ("*.mlp.gate", "lm_head"), or compressed-tensors' "re:" regexes."""
    if pattern.startswith("re:"):
        try:
            return re.fullmatch(pattern[3:], module) is not None
        except re.error:
            return False
    return fnmatch.fnmatchcase(module, pattern)


def _refuse(tensors: Mapping[str, StoredTensor], what: str) -> None:
    """An algorithm ckptconv does not dequantize: named with a tensor it stores (a packed uint8 weight, else
    one not a float)."""
    floats = ("bfloat16", "float16", "float32")
    key, t = next(
        ((k, t) for k, t in tensors.items() if t.dtype_name == "uint8"),
        next(((k, t) for k, t in tensors.items() if t.dtype_name not in floats), next(iter(tensors.items()))),
    )
    raise CkptconvError(
        f"{t.file}: {key!r} is quantized with ModelOpt {what} (config.json's quantization_config), which "
        f"ckptconv does not dequantize (it reads quant_algo {', '.join(NVFP4_ALGOS + FP8_ALGOS)}, "
        "MIXED_PRECISION of those); dequantize it with ModelOpt first"
    )
