"""Compare two tensors element by element, a bounded slab at a time: what `verify` reports for one key.

Exact: A's values cast to B's dtype (`Tensor.to`) equal B bit for bit (so -0.0 != 0.0, and NaN == NaN only
with the same bits). With a tolerance: |a - b| <= atol + rtol * |b| in fp32, NaN equal to NaN in the same
place, infinities equal when the same.

Memory: besides the pair itself, `compare` holds the temporaries of one slab of `SLAB_ELEMENTS` elements (the
cast slab, its fp32 copies with a tolerance, the mask, the differing values in fp64: a few tens of MB), never
a full-size copy of either tensor in another dtype. Every operation is elementwise, so counting slab by slab
gives exactly the whole-tensor verdict, count and largest difference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ckptconv.core.dtype_names import short_name

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SLAB_ELEMENTS = 2**20  # elements compared at a time: fp64 temporaries of 8 MiB each


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.0
    rtol: float = 0.0


@dataclass(frozen=True)
class Finding:
    """One mismatch: a key on one side only, a shape that differs, or values that differ (`verify --layout`:
    a dtype, or the file an HF directory holds the key in)."""

    key: str
    kind: str  # only_in_a | only_in_b | shape | values; with --layout: dtype | file
    a: dict[str, Any] | None
    b: dict[str, Any] | None
    differing: int = 0
    numel: int = 0
    max_abs_diff: float | None = None

    def line(self) -> str:
        def desc(side: dict[str, Any] | None) -> str:
            return f"{side['dtype']}{side['shape']}" if side else "-"

        if self.kind == "only_in_a":
            return f"{self.key}: only in A ({desc(self.a)})"
        if self.kind == "only_in_b":
            return f"{self.key}: only in B ({desc(self.b)})"
        if self.kind in ("shape", "dtype"):
            return f"{self.key}: {self.kind} differs, A {desc(self.a)} vs B {desc(self.b)}"
        if self.kind == "file" and self.a and self.b:
            return f"{self.key}: file differs, A {self.a['file']} vs B {self.b['file']}"
        return (
            f"{self.key}: {self.differing} of {self.numel} elements differ (max abs diff "
            f"{self.max_abs_diff:.6g}), A {desc(self.a)} vs B {desc(self.b)}"
        )


def describe(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": short_name(dtype)}


def compare(key: str, a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance | None = None) -> Finding | None:
    """None when `a` (cast to b's dtype) matches `b`; else what differs. Holds one slab's temporaries."""
    da, db = describe(tuple(a.shape), a.dtype), describe(tuple(b.shape), b.dtype)
    if a.shape != b.shape:
        return Finding(key, "shape", da, db)
    n, worst = 0, -math.inf
    for sa, sb in slabs(a, b):
        differ = _differ(sa, sb, tolerance)
        count = int(differ.sum())
        if count:
            n += count
            worst = _worse(worst, float((sa[differ].double() - sb[differ].double()).abs().max()))
    if n == 0:
        return None
    return Finding(key, "values", da, db, n, b.numel(), worst)


def _differ(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance | None) -> torch.Tensor:
    """The mask of elements of the 1-D slab `a` (cast to b's dtype) that do not match the slab `b`."""
    cast = a.to(b.dtype)
    if tolerance is None:
        if b.dtype == torch.bool:
            return cast != b
        bits = _BITS[b.dtype.itemsize]
        return cast.view(bits) != b.view(bits)
    fa, fb = cast.float(), b.float()
    close = (fa - fb).abs() <= tolerance.atol + tolerance.rtol * fb.abs()
    return ~(close | (fa == fb) | (fa.isnan() & fb.isnan()))


def _worse(worst: float, gap: float) -> float:
    """The larger absolute difference, NaN winning (as `Tensor.max` over the whole tensor would give)."""
    if math.isnan(worst) or math.isnan(gap):
        return math.nan
    return max(worst, gap)


def slabs(
    a: torch.Tensor, b: torch.Tensor, elements: int | None = None
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Aligned 1-D slabs of `a` and `b` (same shape), row-major, at most `elements` each (a 0-d pair is one
    slab of one): views when both are contiguous; otherwise slabs of whole rows, copied a slab at a time
    (a single row longer than `elements` is one slab). `elements` defaults to `SLAB_ELEMENTS`."""
    elements = elements or SLAB_ELEMENTS
    if a.is_contiguous() and b.is_contiguous():
        fa, fb = a.reshape(-1), b.reshape(-1)
        for lo in range(0, fa.numel(), elements):
            yield fa[lo : lo + elements], fb[lo : lo + elements]
        return
    rows = a.shape[0]
    step = max(1, elements // max(1, math.prod(a.shape[1:])))
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        yield a.narrow(0, lo, n).reshape(-1), b.narrow(0, lo, n).reshape(-1)
