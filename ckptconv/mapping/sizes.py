"""The sizes a rule resolves from config.json on the way: a narrowed tensor's padded size, and the shapes
on both sides of a reshape. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ckptconv.errors import CkptconvError
from ckptconv.mapping.expr import MAX_SIZE
from ckptconv.mapping.ops import squeeze, unsqueeze
from ckptconv.mapping.patterns import Scope
from ckptconv.mapping.types import Rule

MAX_PAD_ELEMENTS = 2**24  # zeros a padding may add when that is more than the tensor's own elements


def padded_size(scope: Scope, rule: Rule, shape: tuple[int, ...]) -> int:
    """The runtime size along `dim` of a narrowed tensor read back: `padded`, or rounded up to `multiple`
    (Megatron: `"make_vocab_size_divisible_by * tensor_model_parallel_size"`)."""
    if not 0 <= rule.dim < len(shape):
        raise CkptconvError(f"{scope.where} rule {rule.number}: dim {rule.dim} is not a dim of {list(shape)}")
    kept = shape[rule.dim]
    if rule.padded is not None:
        size = scope.size(rule.padded)
    elif rule.multiple is not None:
        multiple = scope.size(rule.multiple)
        if multiple <= 0:
            raise CkptconvError(f"{scope.where} rule {rule.number}: multiple {multiple} is not positive")
        size = -(-kept // multiple) * multiple
    else:
        raise CkptconvError(
            f"{scope.where} rule {rule.number}: narrow needs `padded` or `multiple` to read back"
        )
    if size < kept:
        raise CkptconvError(f"{scope.where} rule {rule.number}: padded size {size} is less than {kept}")
    if size > MAX_SIZE:
        raise CkptconvError(f"{scope.where} rule {rule.number}: padded size {size} is over 2**63 - 1")
    zeros = (size - kept) * math.prod(shape[: rule.dim] + shape[rule.dim + 1 :])
    if zeros > max(math.prod(shape), MAX_PAD_ELEMENTS):
        raise CkptconvError(
            f"{scope.where} rule {rule.number}: padding {list(shape)} to {size} along dim {rule.dim} adds "
            f"{zeros} zeros, more than the tensor's own {math.prod(shape)} elements (or {MAX_PAD_ELEMENTS}); "
            "check `padded` / `multiple` and config.json"
        )
    return size


def _resolve(scope: Scope, spec: Sequence[int | str], shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """A reshape's other shape for a tensor of `shape`: sizes from config.json; -1 first is dim 0 (a reshape
    keeps it), and one other -1 takes what is left."""
    numel = math.prod(shape)
    dims = [-1 if d == -1 else scope.size(d) for d in spec]
    if dims and dims[0] == -1 and shape:
        dims[0] = shape[0]
    known = math.prod(d for d in dims if d != -1)
    if dims.count(-1) == 1 and known and numel % known == 0:
        dims[dims.index(-1)] = numel // known
    if math.prod(dims) != numel or any(d < 0 for d in dims):
        raise CkptconvError(f"{scope.where}: {list(shape)} does not reshape to {what} {list(spec)}")
    return tuple(dims)


def reshaped(
    scope: Scope, rule: Rule, shape: tuple[int, ...], to_hf: bool, key: str
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The HF shape of a runtime piece (and the piece's shape as the layout), or the piece's own shape."""
    if rule.hf_shape is None or not to_hf:
        return shape, None
    out = _resolve(scope, rule.hf_shape, shape, "hf_shape")
    if not shape or not out or out[0] != shape[0]:
        raise CkptconvError(
            f"{scope.where}: {key!r}: a reshape must keep dim 0 ({list(shape)} -> {list(out)})"
        )
    return out, shape


def unreshaped(
    scope: Scope, rule: Rule, layout: tuple[int, ...], stack_dims: tuple[int, ...], key: str
) -> tuple[int, ...]:
    """The runtime shape of a tensor whose parts are laid out like the HF tensors (`layout`)."""
    inner = squeeze(layout, stack_dims)
    spec = rule.runtime_shape or ((inner[0], -1) if inner else ())
    out = _resolve(scope, spec, inner, "runtime_shape")
    if stack_dims:
        out = unsqueeze(out, stack_dims, tuple(layout[d] for d in stack_dims))
    if out[0] != layout[0]:
        raise CkptconvError(
            f"{scope.where}: {key!r}: a reshape must keep dim 0 ({list(layout)} -> {list(out)})"
        )
    return out
