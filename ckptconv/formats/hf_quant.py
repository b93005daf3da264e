"""Quantized HF sources seen as their dequantized weights: stored pairs -> one logical tensor. No torch.

    block FP8 (DeepSeek-V3, transformers "fp8"):
        X [R, C] float8_e4m3fn + X_scale_inv [ceil(R/b), ceil(C/b)] (fp32, bf16 or fp16)  ->  X [R, C]
    MXFP4 (gpt-oss; rows are the output dim, 32-value groups run along the input dim):
        X_blocks [E, O, G, 16] uint8 + X_scales [E, O, G] uint8                          ->  X [E, G*32, O]
        (transposed: the [E, in, out] layout of transformers' bf16 GptOssExperts)
    MXFP8 (weight_block_size [1, 32], scale_fmt "ue8m0"):
        X [R, C] float8_e4m3fn + X_scale_inv [R, ceil(C/32)] float8_e8m0fnu (or its bytes)  ->  X [R, C]
    DeepSeek-V4 (`X.scale` beside `X.weight`, `quant_dsv4`), ModelOpt NVFP4 (quant_method "modelopt",
    `quant_modelopt`), compressed-tensors (quant_method "compressed-tensors", `quant_ct`): their own readers,
    chosen by config.json's quant_method (`READERS`); any other method is refused naming a key.

The logical tensor has the nominal dtype (config.json's `dtype` / `torch_dtype` when a float, else bf16): what
`--dtype keep` writes. Its parts are read and dequantized by `dequant.quantized_block`; the scale keys are not
tensors of their own. docs/notes/quantized-formats.md has the formats and the references.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckptconv.core.specs import Quantized, StoredTensor
from ckptconv.errors import CkptconvError
from ckptconv.formats import quant_dsv4, quant_modelopt
from ckptconv.formats.documents import load_json
from ckptconv.formats.files import CONFIG_BYTES, mode_of, read_regular
from ckptconv.formats.quant_base import NOMINAL_DTYPES, Recognised, logical, nominal_dtype
from ckptconv.formats.quant_ct import read as read_compressed_tensors

FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size, the default of torch's quantized reader
MAX_FP8_BLOCK = 2**31  # past every real weight's dims (a larger block is the same one block): refused
MXFP8_BLOCK = (1, 32)  # weight_block_size of MXFP8 (an E8M0 scale per 32 values of a row)
MXFP4_GROUP = 32  # values per E8M0 scale byte (16 bytes of two FP4 codes)
SCALE_SUFFIX = "_scale_inv"
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SCALE_DTYPES = ("float32", "bfloat16", "float16", "float8_e8m0fnu")
CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = CONFIG_BYTES  # files.py holds the limits of every file read beside a checkpoint


def read_config(directory: Path | None, root: Path | None) -> dict[str, Any]:
    """config.json of an HF directory ({} when there is none): its dtype and quantization_config."""
    if directory is None or mode_of(directory / CONFIG_FILE) is None:
        return {}
    path = directory / CONFIG_FILE
    try:
        doc = load_json(read_regular(path, root, MAX_CONFIG_BYTES), path)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise CkptconvError(f"{path}: not a JSON object; cannot tell how its quantized weights are stored")
    return doc


# the parts of a quantized weight in the formats ckptconv knows of (and GPTQ / AWQ's): never a model's own
# parameter names, so one left after reading means a weight went unread (config.json missing or wrong)
PART_SUFFIXES = (  # not "_blocks": MXFP4's are told by their scales and shape, and the name alone is no part
    SCALE_SUFFIX,
    ".weight_scale",
    ".weight_scale_2",
    ".weight_packed",
    ".weight_shape",
    ".weight_global_scale",
    ".weight_zero_point",
    ".weight_g_idx",
    ".input_scale",
    ".input_global_scale",
    ".qweight",
    ".qzeros",
)
PART_DTYPES = (*FP8_DTYPES, "float8_e8m0fnu")


def might_be_quantized(tensors: Mapping[str, StoredTensor]) -> bool:
    """Whether any key or dtype looks like a part of a quantized weight (then config.json must be read)."""
    return any(
        k.endswith((*PART_SUFFIXES, BLOCKS_SUFFIX))
        or t.dtype_name in PART_DTYPES
        or (k.endswith(quant_dsv4.SCALE) and quant_dsv4.is_scale(tensors, k))
        for k, t in tensors.items()
    )


def logical_tensors(tensors: dict[str, StoredTensor], config: Mapping[str, Any]) -> dict[str, StoredTensor]:
    """`tensors` (in order) with every quantized weight as one logical tensor in its weight's place and its
    scales removed. The scheme is config.json's `quantization_config.quant_method` (without one: block FP8 or
    MXFP4 as the keys and dtypes show); a method ckptconv cannot read, or a malformed weight, is a one-line
    CkptconvError naming the key and its file."""
    method = _quant_method(config)
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        _unknown(tensors, f"a quantization_config that is a JSON {type(qc).__name__}, not an object")
    if method is None and isinstance(qc, dict):
        _unknown(tensors, "a quantization_config with no quant_method")
    if method is not None and method not in READERS:
        _unknown(tensors, f"quant_method {method!r}")
    found = READERS.get(method or "", _by_keys)(tensors, config)
    out = _placed(tensors, found) if found.logical or found.dropped else tensors
    _none_unread(out, method)
    return out


def _none_unread(tensors: Mapping[str, StoredTensor], method: str | None) -> None:
    """Refuses a part of a quantized weight that no reader took (a scale, packed words, an E8M0 tensor): its
    weight would reach the DCP as raw bytes. FP8 tensors alone are copied as they are (limits.md)."""
    for key, t in tensors.items():
        if t.quant is None and (key.endswith(PART_SUFFIXES) or t.dtype_name == "float8_e8m0fnu"):
            said = f"quant_method {method!r}" if method else "no quantization_config"
            raise CkptconvError(
                f"{t.file}: {key!r} ({t.dtype_name} {list(t.shape)}) is a part of a quantized weight that "
                f"config.json ({said}) does not account for: give the release's own config.json (its "
                "quantization_config says how the weights are stored), or dequantize it first"
            )


def _placed(tensors: dict[str, StoredTensor], found: Recognised) -> dict[str, StoredTensor]:
    """`tensors` with each logical tensor in the place of its first part, its parts and `dropped` removed."""
    logical = found.logical
    at = {t.quant.parts[0].key: t for t in logical.values() if t.quant is not None}
    parts = {p.key for t in logical.values() if t.quant is not None for p in t.quant.parts}
    out: dict[str, StoredTensor] = {}
    for key, t in tensors.items():
        if key in logical and key not in parts:
            raise CkptconvError(f"{t.file}: {key!r} is stored both as it is and as quantized parts")
        if key in at:
            out[at[key].key] = at[key]  # in the place of its weight (or blocks)
        elif key not in parts and key not in found.dropped:
            out[key] = t
    return out


def _unknown(tensors: Mapping[str, StoredTensor], what: str) -> None:
    """Refuses a quantization ckptconv cannot dequantize, naming a tensor it stores (one not a float, else the
    first) and the scheme."""
    key, t = next(
        ((k, t) for k, t in tensors.items() if t.dtype_name not in NOMINAL_DTYPES),
        next(iter(tensors.items())),
    )
    known = ", ".join(sorted(READERS))
    raise CkptconvError(
        f"{t.file}: {key!r} is quantized with {what} (config.json's quantization_config), which ckptconv "
        f"does not dequantize (it reads quant_method {known}); dequantize it with its own tools first"
    )


def _by_keys(tensors: dict[str, StoredTensor], config: Mapping[str, Any]) -> Recognised:
    """Block FP8 (`X_scale_inv`) and MXFP4 (`X_blocks` + `X_scales`), told apart by their keys and dtypes (the
    quant_method "fp8" and "mxfp4", or none)."""
    method = _quant_method(config)
    nominal = nominal_dtype(config)
    logical: dict[str, StoredTensor] = {}
    for key, t in tensors.items():
        if method is None and key.endswith(quant_modelopt.SCALE_2):
            raise CkptconvError(
                f"{t.file}: {key!r} is a ModelOpt NVFP4 global scale, but config.json has no "
                'quantization_config: add ModelOpt\'s (quant_method "modelopt", as its hf_quant_config.json '
                "says) to config.json"
            )
        if key.endswith(SCALE_SUFFIX):
            logical[key[: -len(SCALE_SUFFIX)]] = _fp8(tensors, key, nominal, _fp8_block(config, t))
        elif key.endswith(quant_dsv4.SCALE) and quant_dsv4.is_scale(tensors, key):
            weight = quant_dsv4.weight_key(key)
            logical[weight] = quant_dsv4.logical_weight(tensors, key, config, nominal, _fp8_block(config, t))
        elif key.endswith(BLOCKS_SUFFIX) and _is_mxfp4(tensors, key, method):
            logical[key[: -len(BLOCKS_SUFFIX)]] = _mxfp4(tensors, key, nominal)
        elif key.endswith(SCALES_SUFFIX) and method == "mxfp4" and _blocks_key(key) not in tensors:
            raise CkptconvError(f"{t.file}: MXFP4 scales {key!r} have no {_blocks_key(key)!r}")
    if method == "fp8" or any(t.quant is not None and t.quant.scheme == "fp8" for t in logical.values()):
        _no_unscaled_fp8(tensors, logical)
    if quant_dsv4.expert_dtype(config) == "fp4":
        for key, t in tensors.items():
            if t.dtype_name == "int8" and key.endswith(quant_dsv4.WEIGHT) and key not in logical:
                raise CkptconvError(
                    f"{t.file}: {key!r} is int8 (two FP4 values a byte, config.json's expert_dtype \"fp4\") "
                    f"with no {key[: -len(quant_dsv4.WEIGHT)] + quant_dsv4.SCALE!r}: its values cannot be "
                    "dequantized"
                )
    return Recognised(logical)


def _quant_method(config: Mapping[str, Any]) -> str | None:
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if isinstance(method, str) else None


def _fp8_block(config: Mapping[str, Any], scale: StoredTensor) -> tuple[int, int]:
    """The [rows, cols] block of `quantization_config.weight_block_size` (128 x 128 when not given; MXFP8's
    is [1, 32])."""
    qc = config.get("quantization_config")
    size = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if size is None:
        return FP8_BLOCK, FP8_BLOCK
    if (
        not isinstance(size, list)
        or len(size) != 2
        or not all(type(s) is int and 0 < s <= MAX_FP8_BLOCK for s in size)
    ):
        shown = json.dumps(size)
        shown = shown if len(shown) <= 60 else shown[:50] + " ..."
        raise CkptconvError(
            f"{scale.file}: {scale.key!r}: weight_block_size {shown} in config.json is not supported "
            f"(blocks [rows, cols], 1 <= n <= {MAX_FP8_BLOCK})"
        )
    return int(size[0]), int(size[1])


def _fp8(tensors: Mapping[str, StoredTensor], key: str, nominal: str, block: tuple[int, int]) -> StoredTensor:
    """The logical tensor of the block-FP8 weight whose scale is `key` (MXFP8 when its blocks are 1 x 32)."""
    scale, name = tensors[key], key[: -len(SCALE_SUFFIX)]
    weight = tensors.get(name)
    if weight is None:
        raise CkptconvError(f"{scale.file}: block-FP8 scale {key!r} has no weight {name!r}")
    where = f"{weight.file}: {name!r}"
    if weight.dtype_name not in FP8_DTYPES:
        raise CkptconvError(f"{where} is {weight.dtype_name}, not FP8, yet has a scale {key!r}")
    if len(weight.shape) != 2:
        raise CkptconvError(
            f"{where}: block-FP8 weights of shape {list(weight.shape)} are not supported (2-D only; "
            "checkpoints hold experts one by one)"
        )
    if scale.dtype_name == "uint8" and block == MXFP8_BLOCK:  # E8M0 saved as bytes (transformers reads them)
        pass
    elif scale.dtype_name not in SCALE_DTYPES:
        raise CkptconvError(f"{scale.file}: {key!r} is {scale.dtype_name}, not a float scale")
    want = tuple(-(-n // b) for n, b in zip(weight.shape, block, strict=True))
    if scale.shape != want:
        raise CkptconvError(
            f"{scale.file}: {key!r} is {list(scale.shape)}, but {name!r} {list(weight.shape)} in "
            f"{block[0]}x{block[1]} blocks needs {list(want)}"
        )
    if block[0] == block[1]:
        quant = Quantized("fp8", (weight, scale), block[0])
    else:
        scheme = "mxfp8" if block == MXFP8_BLOCK else "fp8"
        quant = Quantized(scheme, (weight, scale), block[1], (("block_size", block),))
    return logical(weight, name, weight.shape, nominal, quant)


def _blocks_key(scales_key: str) -> str:
    return scales_key[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX


def _is_mxfp4(tensors: Mapping[str, StoredTensor], key: str, method: str | None) -> bool:
    """Whether `key` (`X_blocks`) is MXFP4: config.json says mxfp4, or a uint8 `X_scales` goes with it and
    the blocks are uint8 groups of 16 bytes."""
    t, name = tensors[key], key[: -len(BLOCKS_SUFFIX)]
    scales = tensors.get(name + SCALES_SUFFIX)
    if method == "mxfp4":
        if scales is None:
            raise CkptconvError(f"{t.file}: MXFP4 blocks {key!r} have no scales {name + SCALES_SUFFIX!r}")
        return True
    return scales is not None and t.dtype_name == "uint8" and bool(t.shape) and t.shape[-1] == 16


def _mxfp4(tensors: Mapping[str, StoredTensor], key: str, nominal: str) -> StoredTensor:
    """The logical [E, G*32, O] tensor of MXFP4 blocks `key` [E, O, G, 16] and their scales [E, O, G]."""
    name = key[: -len(BLOCKS_SUFFIX)]
    blocks, scales = tensors[key], tensors[name + SCALES_SUFFIX]
    for t in (blocks, scales):
        if t.dtype_name != "uint8":
            raise CkptconvError(f"{t.file}: MXFP4 {t.key!r} is {t.dtype_name}, not uint8")
    if len(blocks.shape) != 4 or blocks.shape[3] != 16:
        raise CkptconvError(
            f"{blocks.file}: MXFP4 blocks {key!r} are {list(blocks.shape)}, not [experts, rows, groups, 16]"
        )
    if scales.shape != blocks.shape[:3]:
        raise CkptconvError(
            f"{scales.file}: MXFP4 scales {scales.key!r} are {list(scales.shape)}, but blocks {key!r} "
            f"{list(blocks.shape)} need {list(blocks.shape[:3])}"
        )
    experts, rows, groups, _ = blocks.shape
    shape = (experts, groups * MXFP4_GROUP, rows)
    return logical(blocks, name, shape, nominal, Quantized("mxfp4", (blocks, scales), MXFP4_GROUP))


def _no_unscaled_fp8(tensors: Mapping[str, StoredTensor], logical: Mapping[str, StoredTensor]) -> None:
    """In a block-FP8 checkpoint every FP8 tensor has a scale."""
    for key, t in tensors.items():
        if t.dtype_name in FP8_DTYPES and key not in logical:
            raise CkptconvError(
                f"{t.file}: {key!r} is {t.dtype_name} with no {key + SCALE_SUFFIX!r}, in a block-FP8 "
                "checkpoint: its values cannot be dequantized"
            )


Reader = Callable[[dict[str, StoredTensor], Mapping[str, Any]], Recognised]
READERS: dict[str, Reader] = {  # quantization_config.quant_method -> its reader (quant.schemes.METHODS)
    "fp8": _by_keys,
    "mxfp4": _by_keys,
    "compressed-tensors": read_compressed_tensors,  # formats.quant_ct
    "modelopt": quant_modelopt.recognised,
}
