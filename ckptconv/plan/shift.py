"""The checks a rule's `offset` (a value shift: HF = runtime + offset) needs of the tensors it applies to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptconv.errors import CkptconvError
from ckptconv.mapping.types import Target

if TYPE_CHECKING:  # annotations only: a plan is made before torch is imported
    import torch


def check_shift(target: Target, dtypes: list[torch.dtype], quantized: str | None = None) -> None:
    """Refuse a shift of `target` (its rule's `offset`) onto or from integer or 8-bit (FP8) tensors, or
    through a quantized path (`quantized` names it): the shift is computed in float32 (float64) on values."""
    if target.offset is None:
        return
    where = f"--mapping rule {target.rule}: {target.key!r}"
    if quantized is not None:
        raise CkptconvError(
            f"{where}: its rule's offset shifts values, which {quantized} does not allow; leave it out of "
            "the quantized tensors"
        )
    for dtype in dtypes:
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise CkptconvError(
                f"{where}: its rule's offset shifts values, and a {str(dtype).removeprefix('torch.')} tensor "
                "cannot be shifted; drop offset from the rule or convert a bf16/fp16/fp32/fp64 checkpoint"
            )
