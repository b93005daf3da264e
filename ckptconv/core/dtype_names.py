"""Dtypes by name, without importing torch.

Metadata carries dtypes as names: DCP's `.metadata` pickles one as the global `torch.<name>`, a safetensors
header as `F32`, `BF16`, ... Reading metadata with names keeps torch (1.3-2 s to import) out of commands that
only read metadata (`inspect`); `torch_dtype` turns a name into the torch dtype where tensors are made.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ckptconv.errors import CkptconvError

if TYPE_CHECKING:
    import torch

# the values of --dtype: the dtype of floating output tensors, or keep (core.dtypes maps them to torch's)
DTYPE_FLAG_NAMES = ("bf16", "fp16", "fp32", "keep")

# every dtype torch 2.13 has, by its name (`str(dtype)` without "torch."), with its bytes per element
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bits16": 2,
    **{f"int{n}": 1 for n in range(1, 8)},
    **{f"uint{n}": 1 for n in range(1, 8)},
}
# what a checkpoint's tensor may be to be converted: torch has no element operations (narrow, copy, index)
# for quantized, bits and sub-byte integer dtypes
CONVERTIBLE = frozenset(
    name for name in ITEMSIZE if not name.startswith(("qint", "quint", "bits"))
) - {f"{u}int{n}" for u in ("", "u") for n in range(1, 8)}

# safetensors dtype names -> torch dtype names (those both sides know)
ST_TO_NAME: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
NAME_TO_ST = {v: k for k, v in ST_TO_NAME.items()}


def short_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`: the name this module keys dtypes by."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (imports torch)."""
    import torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def check_dtype_flag(value: str, flag: str = "--dtype") -> str:
    """`value` when it is one of `DTYPE_FLAG_NAMES`; refused with one line naming `flag` otherwise."""
    if value not in DTYPE_FLAG_NAMES:
        raise CkptconvError(f"{flag} {value!r} is not one of {', '.join(DTYPE_FLAG_NAMES)}")
    return value
