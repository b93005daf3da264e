"""compressed-tensors releases (quant_method "compressed-tensors") as their dequantized weights. No torch.

Each quantized module M of a config_groups entry (`quant_ct_config`) is one logical tensor `M.weight` [O, I]:

    ct-fp8    float-quantized   M.weight float8_e4m3fn [O, I] + M.weight_scale (fp32 / bf16 / fp16)
                                [1] tensor, [O, 1] channel, [ceil(O/b0), ceil(I/b1)] block, [O, I/g] group
                                (+ M.weight_zero_point, the scale's shape, when asymmetric)
    ct-int    pack-quantized    M.weight_packed int32 [O, ceil(I*bits/32)] + M.weight_scale [O, I/g] group,
                                [O, 1] channel or [1] tensor + M.weight_shape int [2] (+ M.weight_zero_point
                                int32 [ceil(O*bits/32), I/g or 1], packed along the rows, when asymmetric)
    ct-nvfp4  nvfp4-pack-q.     M.weight_packed uint8 [O, I/2] + M.weight_scale float8_e4m3fn [O, I/16]
                                + M.weight_global_scale fp32 [1]
    ct-mxfp4  mxfp4-pack-q.     M.weight_packed uint8 [O, I/2] + M.weight_scale uint8 E8M0 [O, I/32]

Activation and KV-cache scales (input_scale, input_global_scale, k_scale, ...) are dropped. A module of
`ignore` keeps its plain weight (a quantized part of one is refused), as does a module with no quantized
part. The parts may lie in any files. The values: `dequant_ct`, bit-identical to compressed-tensors 0.20.0.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from typing import Any

from ckptconv.core.specs import Quantized, StoredTensor
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import check_unchanged, open_regular, pread_exact
from ckptconv.formats.quant_base import Recognised, logical, nominal_dtype
from ckptconv.formats.quant_ct_config import Group, group_of, ignored, parse
from ckptconv.remote.files import RemoteFiles
from ckptconv.remote.urls import UrlPath

WEIGHT_PARAMS = (  # a quantized module's parts: compressed-tensors' weight qparams and packed values
    "weight_packed", "weight_scale", "weight_zero_point",
    "weight_global_scale", "weight_shape", "weight_g_idx",
)  # fmt: skip
DROPPED = (  # activation and KV-cache qparams: nothing a training job loads
    "input_scale", "input_zero_point", "input_global_scale",
    "output_scale", "output_zero_point", "output_global_scale",
    "k_scale", "v_scale", "q_scale", "k_zero_point", "v_zero_point", "q_zero_point",
)  # fmt: skip
FLOAT_SCALES = ("float32", "bfloat16", "float16")
SHAPE_DTYPES = {"int64": "<q", "int32": "<i"}


def read(tensors: dict[str, StoredTensor], config: Mapping[str, Any]) -> Recognised:
    """Every quantized module of a compressed-tensors checkpoint as its logical `M.weight`."""
    qc = config.get("quantization_config")
    assert isinstance(qc, dict)
    modules = _quantized_modules(tensors)
    dropped = frozenset(k for k in tensors if k.rpartition(".")[2] in DROPPED)
    if not modules:
        return Recognised({}, dropped)
    first = tensors[modules[next(iter(modules))][0]]
    parsed = parse(qc, f"{first.file}: {first.key!r}")
    nominal = nominal_dtype(config)
    found: dict[str, StoredTensor] = {}
    for module, keys in modules.items():
        t = tensors[keys[0]]
        if ignored(parsed, module):
            raise CkptconvError(
                f"{t.file}: {t.key!r} is a quantized part of {module!r}, which quantization_config's ignore "
                "lists: the checkpoint and its config.json disagree"
            )
        group = group_of(parsed, module)
        if group is None:
            raise CkptconvError(
                f"{t.file}: {t.key!r} is a quantized part of {module!r}, which no config_groups target of "
                "quantization_config matches: its scheme is unknown"
            )
        q = _module(tensors, module, group, nominal)
        found[module + ".weight"] = q
        used = {p.key for p in q.quant.parts} if q.quant is not None else set()
        for key in keys:
            if key not in used:
                raise CkptconvError(
                    f"{tensors[key].file}: {key!r} is not a part of {group.scheme} weights "
                    f"({group.format}, strategy {group.strategy}, config_groups {group.name!r})"
                    + (
                        " (weight_g_idx: actorder, which ckptconv does not dequantize)"
                        if "g_idx" in key
                        else ""
                    )
                )
    return Recognised(found, dropped)


def _quantized_modules(tensors: Mapping[str, StoredTensor]) -> dict[str, list[str]]:
    """Module name -> its quantized keys (weight qparams, and an FP8 `weight`), in checkpoint order."""
    out: dict[str, list[str]] = {}
    for key, t in tensors.items():
        module, _, param = key.rpartition(".")
        if param in WEIGHT_PARAMS or (param == "weight" and t.dtype_name.startswith("float8")):
            out.setdefault(module, []).append(key)
    return out


def _module(tensors: Mapping[str, StoredTensor], module: str, group: Group, nominal: str) -> StoredTensor:
    """The logical weight of `module`, its parts checked against `group`."""
    values_key = module + (".weight" if group.scheme == "ct-fp8" else ".weight_packed")
    scale = _part(tensors, module, "weight_scale", values_key, group)
    values = _part(tensors, module, values_key.rpartition(".")[2], scale.key, group)
    if len(values.shape) != 2:
        raise CkptconvError(
            f"{values.file}: {values.key!r} is {list(values.shape)}; ckptconv reads 2-D {group.scheme} "
            "weights"
        )
    rows = values.shape[0]
    stored: str
    extra: list[StoredTensor] = []
    if group.scheme == "ct-fp8":
        _dtype(values, ("float8_e4m3fn",))
        _dtype(scale, FLOAT_SCALES)
        cols, stored = values.shape[1], values.dtype_name
    elif group.scheme == "ct-int":
        _dtype(values, ("int32",))
        _dtype(scale, FLOAT_SCALES)
        shape = _part(tensors, module, "weight_shape", values_key, group)
        _dtype(shape, tuple(SHAPE_DTYPES))
        if shape.shape != (2,):
            raise CkptconvError(
                f"{shape.file}: {shape.key!r} is {list(shape.shape)}, not [2] (rows, columns)"
            )
        if group.strategy == "group":
            cols = scale.shape[-1] * group.group_size if len(scale.shape) == 2 else 0
            widest = values.shape[1] * 32 // group.bits  # the columns the packed words can hold
            if -(-cols * group.bits // 32) != values.shape[1]:
                need = f"[{rows}, {widest // group.group_size}]" if widest >= group.group_size else "no group"
                raise CkptconvError(
                    f"{scale.file}: {scale.key!r} is {list(scale.shape)}, but {values.key!r} "
                    f"{list(values.shape)} ({widest} columns of {group.bits}-bit values, group_size "
                    f"{group.group_size}) needs {need}"
                )
            told = _stored_ints(shape)  # compressed-tensors unpacks weight_shape's columns: they must agree
            if told != (rows, cols):
                raise CkptconvError(
                    f"{shape.file}: {shape.key!r} says {list(told)}, but {values.key!r} and {scale.key!r} "
                    f"hold [{rows}, {cols}]"
                )
        else:  # the packed width fixes the columns only to within 32 / bits: weight_shape says
            told = _stored_ints(shape)
            if told[0] != rows:
                raise CkptconvError(
                    f"{shape.file}: {shape.key!r} says {list(told)}, but {values.key!r} has {rows} rows"
                )
            cols = told[1]
        extra.append(shape)
        stored = f"int{group.bits}"
        want = (rows, -(-cols * group.bits // 32))
        if values.shape != want:
            raise CkptconvError(
                f"{values.file}: {values.key!r} is {list(values.shape)}, but {cols} columns of "
                f"{group.bits}-bit values need {list(want)} ({scale.key!r} is {list(scale.shape)})"
            )
    else:
        _dtype(values, ("uint8",))
        _dtype(scale, ("float8_e4m3fn",) if group.scheme == "ct-nvfp4" else ("uint8",))
        cols, stored = values.shape[1] * 2, group.scheme[3:]
        if group.scheme == "ct-nvfp4":
            gs = _part(tensors, module, "weight_global_scale", values_key, group)
            _dtype(gs, FLOAT_SCALES)
            if math.prod(gs.shape) != 1 or len(gs.shape) > 1:
                raise CkptconvError(f"{gs.file}: {gs.key!r} is {list(gs.shape)}, not one global scale [1]")
            extra.append(gs)
    grid = _grid(group, rows, cols)
    want_scale: tuple[int, ...] = (
        (1,) if group.strategy == "tensor" else (-(-rows // grid[0]), -(-cols // grid[1]))
    )
    if scale.shape != want_scale or (group.group_size and cols % group.group_size):
        raise CkptconvError(
            f"{scale.file}: {scale.key!r} is {list(scale.shape)}, but {values.key!r} {list(values.shape)} "
            f"({rows} x {cols} values, {group.scheme} strategy {group.strategy}) needs {list(want_scale)}"
            + (f" and columns a multiple of {group.group_size}" if group.group_size else "")
        )
    if not group.symmetric:
        zero = _part(tensors, module, "weight_zero_point", values_key, group)
        want_zero = (-(-rows * group.bits // 32), want_scale[1]) if group.scheme == "ct-int" else scale.shape
        if zero.shape != want_zero:
            raise CkptconvError(
                f"{zero.file}: {zero.key!r} is {list(zero.shape)}, but {scale.key!r} {list(scale.shape)} "
                f"needs zero points {list(want_zero)}"
            )
        _dtype(zero, ("int32",) if group.scheme == "ct-int" else (*FLOAT_SCALES, "float8_e4m3fn", "int8"))
        extra.append(zero)
    args = (
        ("stored", stored),
        ("grid", grid),
        ("bits", group.bits),
        ("zero", not group.symmetric),
        ("block_size", grid if group.strategy == "block" else (group.group_size or grid)),
    )
    quant = Quantized(group.scheme, (values, scale, *extra), group.group_size or grid[1], args)
    return logical(values, module + ".weight", (rows, cols), nominal, quant)


def _grid(group: Group, rows: int, cols: int) -> tuple[int, int]:
    """The values each scale covers: (rows, columns)."""
    if group.strategy == "block":
        return group.block
    if group.group_size:
        return (1, group.group_size)
    return (rows, cols) if group.strategy == "tensor" else (1, cols)


def _part(
    tensors: Mapping[str, StoredTensor], module: str, name: str, beside: str, group: Group
) -> StoredTensor:
    """`module.name`, which the scheme needs; refused naming `beside` (a part that is there) if missing."""
    t = tensors.get(f"{module}.{name}")
    if t is None:
        other = tensors.get(beside)
        where = f"{other.file}: {beside!r}" if other is not None else f"{module!r}"
        raise CkptconvError(
            f"{where} has no {module + '.' + name!r}, which {group.scheme} weights ({group.format}, "
            f"config_groups {group.name!r}) need: the checkpoint is incomplete"
        )
    return t


def _dtype(t: StoredTensor, allowed: tuple[str, ...]) -> None:
    if t.dtype_name not in allowed:
        raise CkptconvError(f"{t.file}: {t.key!r} is {t.dtype_name}, not {' or '.join(allowed)}")


def _stored_ints(t: StoredTensor) -> tuple[int, ...]:
    """The values of a small stored int tensor (weight_shape), read from its file."""
    buf = bytearray(t.nbytes)
    if isinstance(t.file, UrlPath):
        buf[:] = RemoteFiles(t.file.parent).read(t.file.name, t.data_offset, t.nbytes)
    else:
        fd = open_regular(t.file)
        try:
            check_unchanged(t.file, fd, t.stamp)
            pread_exact(fd, t.file, t.data_offset, memoryview(buf), shrank=True)
        finally:
            os.close(fd)
    fmt = SHAPE_DTYPES[t.dtype_name]
    values = tuple(v for (v,) in struct.iter_unpack(fmt, bytes(buf)))
    if any(v < 0 for v in values):
        raise CkptconvError(f"{t.file}: {t.key!r} holds {list(values)}, not a shape")
    return values
