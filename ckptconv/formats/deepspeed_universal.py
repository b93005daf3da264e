"""DeepSpeed universal checkpoints (`ds_to_universal.py` output) as tensors: `zero/<param name>/fp32.pt` holds
each parameter whole (`{"param": tensor, "cat_dim": int}`; from ZeRO-3 the flat tensor alone), beside
`exp_avg.pt`, `exp_avg_sq.pt` and `step.pt`, which are never opened; the model states file(s) copied beside
`zero/` list the module, its shared parameters, frozen parameters and buffers (deepspeed_open finishes the
checkpoint from them).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ckptconv.core.specs import Stamp, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.deepspeed_layout import Piece, chunks
from ckptconv.formats.deepspeed_pickle import read_pickled
from ckptconv.formats.files import is_regular, listdir
from ckptconv.formats.torch_record import TensorRecord

ZERO_DIR = "zero"


def is_universal(step: Path) -> bool:
    """Whether `step` holds a universal checkpoint's `zero/<param>/fp32.pt` files."""
    try:
        return any(is_regular(step / ZERO_DIR / n / "fp32.pt") for n in listdir(step / ZERO_DIR))
    except CkptconvError:
        return False


def universal_tensors(
    path: Path, prefix: str, shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, TensorSpec], dict[str, Stamp]]:
    """Every `zero/<name>/fp32.pt` under `path/prefix` as a tensor `name`, read in place; a shape other than
    `shapes` says (the model states' `param_shapes`) is refused, as is anything but the whole parameter."""
    tensors, stamps = {}, {}
    for name in sorted(listdir(path / prefix / ZERO_DIR)):
        rel = f"{prefix}{ZERO_DIR}/{name}/fp32.pt"
        if not is_regular(path / rel):
            continue
        file = read_pickled(path, rel)
        value: Any = file.value
        # ZeRO-1/2's are {"param": tensor, "cat_dim": 0}; ZeRO-3's, the tensor alone
        record = (
            value
            if isinstance(value, TensorRecord)
            else value.get("param")
            if isinstance(value, dict)
            else None
        )
        if not isinstance(record, TensorRecord) or (
            isinstance(value, dict) and set(value) - {"param", "cat_dim"}
        ):
            what = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
            raise CkptconvError(
                f"{path / rel}: holds {what}, not one whole parameter (`param`, `cat_dim`); "
                "a padded or partitioned universal parameter is not read, convert with zero_to_fp32.py"
            )
        shape = shapes.get(name, record.size)
        # ZeRO-3's are flat: the parameter's elements in C order
        if record.size != shape and record.size != (math.prod(shape),):
            raise CkptconvError(
                f"{path / rel}: {name!r} is {list(record.size)}, the model states say {list(shape)}"
            )
        dtype = str(record.dtype).removeprefix("torch.")
        piece = Piece(0, math.prod(shape), rel, file.where(record))
        tensors[name] = TensorSpec(name, dtype, shape, chunks(shape, record.dtype.itemsize, [piece]))
        stamps[rel] = file.stamp
    if not tensors:
        raise CkptconvError(f"{path / prefix / ZERO_DIR}: no <param>/fp32.pt inside")
    return tensors, stamps
