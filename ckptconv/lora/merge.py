"""Merge mode's arithmetic: rows of a targeted weight with its LoRA added, as PEFT's `merge_and_unload()`
computes it, in fp32.

    linear     W [out, in] + (B [out, r] @ A [r, in]) * scaling
    embedding  W [vocab, dim] + (B [dim, r] @ A [r, vocab]).T * scaling
    DoRA       V = W + delta;  (m [out] / ||V||_row).view(-1, 1) * V
    experts    W [E, out, in] + einsum("o r e, e r i -> e o i", B [out, r * E] as [out, r, E],
                                       A [E * r, in] as [E, r, in]) * scaling        (PEFT's ParamWrapper;
               [E, in, out] with "-> e i o"), one expert at a time

Each call makes rows [lo, hi) of the merged weight (a write's slab, or all of it). The product is computed
in blocks of `BLOCK` rows at fixed offsets (a slab cut mid-block computes the whole block), so every rank
runs the same float operations on the same operands whatever the slabs are: the bytes do not depend on the
number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ckptconv.core.specs import TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.lora.select import MergeKind

BLOCK = 1024  # rows of delta computed together

# (stored tensor, rows [a, b) or None for all) -> those rows in fp32
ReadFn = Callable[[TensorSpec, tuple[int, int] | None], torch.Tensor]


@dataclass(frozen=True)
class LoraParts:
    """The stored tensors a merged weight reads besides its own, and PEFT's scaling for it."""

    a: TensorSpec
    b: TensorSpec
    kind: MergeKind
    scaling: float
    magnitude: TensorSpec | None = None
    experts: int = 1  # experts_*: E, the stacked dim of the weight

    @property
    def specs(self) -> list[TensorSpec]:
        return [self.a, self.b] + ([self.magnitude] if self.magnitude is not None else [])

    def check(self, key: str, shape: tuple[int, ...]) -> None:
        """The factors fit the weight `key` of `shape`: a CkptconvError naming them otherwise."""
        a, b = self.a.shape, self.b.shape
        if self.kind.startswith("experts"):
            out_in = (b[0], a[1]) if self.kind == "experts_out_in" else (a[1], b[0])
            fits = len(shape) == 3 and shape[1:] == out_in and bool(shape[0]) and a[0] % shape[0] == 0
        elif self.kind == "linear":
            fits = len(shape) == 2 and a == (a[0], shape[1]) and b == (shape[0], a[0])
        else:
            fits = len(shape) == 2 and a == (a[0], shape[0]) and b == (shape[1], a[0])
        if self.magnitude is not None and self.magnitude.shape != shape[:1]:
            fits = False
        if not fits:
            raise CkptconvError(
                f"{key!r} {list(shape)}: its LoRA factors {self.a.fqn!r} {list(a)} and {self.b.fqn!r} "
                f"{list(b)} do not fit it; the checkpoint is not one PEFT model"
            )


def check_finite(
    key: str,
    lo: int,
    merged: torch.Tensor,
    written: torch.Tensor,
    base: torch.Tensor | Callable[[], torch.Tensor],
) -> None:
    """A CkptconvError unless the merged rows from `lo` of `key` are finite wherever W's are: `merged` in
    fp32, `written` in the dtype written, `base` W's rows (or a function reading them again, called only
    when something is not finite). A finite W never becomes inf or NaN without a word: an alpha or factors
    that large overflow fp32, or the written dtype (bf16, fp16); an inf or NaN that W holds is kept, as a
    plain conversion keeps it."""
    if bool(torch.isfinite(written).all()):
        return
    w = base if isinstance(base, torch.Tensor) else base()
    introduced = ~torch.isfinite(written) & torch.isfinite(w)
    if not bool(introduced.any()):
        return
    row = lo + int(introduced.nonzero()[0][0])
    if bool(torch.isfinite(merged).all()):
        peak = float(merged.abs().max())
        raise CkptconvError(
            f"--lora merge: {key!r} row {row}: the merged weight (|w| up to {peak:.3g}) overflows "
            f"{str(written.dtype).removeprefix('torch.')}; write it with --dtype fp32, or check the "
            "LoRA alpha and factors"
        )
    raise CkptconvError(
        f"--lora merge: {key!r} row {row}: W + scaling * B @ A is not finite where W is; the LoRA alpha "
        "(lora_alpha, --lora-alpha) or the factors are too large"
    )


def merge_rows(w: torch.Tensor, lo: int, lora: LoraParts, read: ReadFn) -> torch.Tensor:
    """Rows [lo, lo + len(w)) of the merged weight, from those rows of W (`w`, fp32; overwritten)."""
    hi = lo + w.shape[0]
    if lora.kind.startswith("experts"):
        return _merge_experts(w, lo, lora, read)
    a = read(lora.a, None)
    b = read(lora.b, None) if lora.kind == "embedding" else None
    total = lora.a.shape[1] if lora.kind == "embedding" else lora.b.shape[0]
    start = lo - lo % BLOCK
    for k0 in range(start, hi, BLOCK):
        k1 = min(k0 + BLOCK, total)
        if lora.kind == "linear":
            delta = (read(lora.b, (k0, k1)) @ a) * lora.scaling
        else:
            assert b is not None
            delta = (b @ a[:, k0:k1]).T * lora.scaling
        r0, r1 = max(lo, k0), min(hi, k1)
        rows = w[r0 - lo : r1 - lo]
        rows += delta[r0 - k0 : r1 - k0]
    if lora.magnitude is not None:
        m = read(lora.magnitude, (lo, hi))
        norm = torch.linalg.norm(w, dim=1)
        w.mul_((m / norm).view(-1, 1))
    return w


def _merge_experts(w: torch.Tensor, lo: int, lora: LoraParts, read: ReadFn) -> torch.Tensor:
    """Experts [lo, lo + len(w)) of a stacked weight with its ParamWrapper's LoRA added, each expert by the
    einsum PEFT's `get_delta_weight` runs, on that expert's slice of the factors."""
    a, b = read(lora.a, None), read(lora.b, None)
    a3 = a.reshape(lora.experts, -1, a.shape[-1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], -1, lora.experts)  # [out, r, E]
    spec = "o r e, e r i -> e o i" if lora.kind == "experts_out_in" else "o r e, e r i -> e i o"
    for e in range(lo, lo + w.shape[0]):
        delta = torch.einsum(spec, b3[:, :, e : e + 1], a3[e : e + 1]) * lora.scaling
        w[e - lo] += delta[0]
    return w


def delta_box(
    lora: LoraParts, offsets: tuple[int, ...], sizes: tuple[int, ...], read: ReadFn
) -> torch.Tensor:
    """scaling * (B @ A), the LoRA update, on the block of W at `offsets` of `sizes` (a chunk's rows, which a
    mapping then splits, permutes or unstacks), in fp32: the same rows of the same fixed blocks as
    `merge_rows` computes, cut to the block's other dims."""
    out = torch.empty(sizes, dtype=torch.float32)
    g0, g1 = offsets[0], offsets[0] + sizes[0]
    rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:], strict=True))
    a = read(lora.a, None)
    if lora.kind.startswith("experts"):
        b = read(lora.b, None)
        a3, b3 = a.reshape(lora.experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, lora.experts)
        spec = "o r e, e r i -> e o i" if lora.kind == "experts_out_in" else "o r e, e r i -> e i o"
        for e in range(g0, g1):
            out[e - g0] = (torch.einsum(spec, b3[:, :, e : e + 1], a3[e : e + 1]) * lora.scaling)[0][rest]
        return out
    b_all = read(lora.b, None) if lora.kind == "embedding" else None
    total = lora.a.shape[1] if lora.kind == "embedding" else lora.b.shape[0]
    for k0 in range(g0 - g0 % BLOCK, g1, BLOCK):
        k1 = min(k0 + BLOCK, total)
        if b_all is None:
            delta = (read(lora.b, (k0, k1)) @ a) * lora.scaling
        else:
            delta = (b_all @ a[:, k0:k1]).T * lora.scaling
        r0, r1 = max(g0, k0), min(g1, k1)
        out[r0 - g0 : r1 - g0] = delta[r0 - k0 : r1 - k0][(slice(None), *rest)]
    return out
