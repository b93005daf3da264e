"""What every quantized scheme's reader shares: the logical tensor it makes of its stored parts, the dtype it
is read in, and what a reader returns. No torch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from ckptconv.core.dtype_names import ITEMSIZE
from ckptconv.core.specs import Quantized, StoredTensor

NOMINAL_DTYPES = ("bfloat16", "float16", "float32")


class Recognised(NamedTuple):
    """A scheme reader's answer: the logical tensors by their key (each placed where its first part is, its
    parts removed from the checkpoint's tensors), and the other keys it leaves out (activation and KV-cache
    scales: not weights, nothing a training job loads)."""

    logical: dict[str, StoredTensor]
    dropped: frozenset[str] = frozenset()


def nominal_dtype(config: Mapping[str, Any]) -> str:
    """config.json's `dtype` (transformers 5) or `torch_dtype` (older) when it is a float dtype, else bf16."""
    name = config.get("dtype", config.get("torch_dtype"))
    return name if isinstance(name, str) and name in NOMINAL_DTYPES else "bfloat16"


def logical(
    first: StoredTensor, key: str, shape: tuple[int, ...], nominal: str, quant: Quantized
) -> StoredTensor:
    """A logical tensor placed where its first part is (file, offset), sized as its dequantized values."""
    nbytes = math.prod(shape) * ITEMSIZE[nominal]
    return dataclasses.replace(first, key=key, dtype_name=nominal, shape=shape, nbytes=nbytes, quant=quant)
