"""Key mapping rules from data: runtime (trainer / DCP) names <-> HF names. Pure: no tensors, no I/O.

A mapping is a list of rules. Each rule names runtime key pattern(s) and HF key pattern(s) with placeholders
(`layers.{layer}.attention.wq.weight`, see `patterns.py`) and how their tensors relate, read in both
directions (every operation, with the shapes on both sides, in docs/mapping.md):

- rename; `permute = "q"` / `"k"`: the rotary row permutation torchtitan's adapters apply;
- `stack = "expert"`: the runtime tensor stacks the HF tensors over a placeholder along `stack_dim`;
- split / concat (one side a list) along `dim`: plain (`sizes`), `interleave`d, or `groups` (fused QKV
  laid out per KV group);
- `transpose = [a, b]`, `narrow` (vocabulary padding), `hf_shape` (reshape), `duplicate` (HF copies);
- `drop = true`, `tied = "<hf key pattern>"`.

The side with one key is the fused tensor F; `ops.pieces` cuts F into the other side's tensors, and each
piece becomes a `Part` (a block copy) in either direction: `map_keys` gives every target its parts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping as MappingT
from collections.abc import Sequence
from typing import Any

from ..errors import CkptconvError
from .ops import Geometry, fused_shape, pieces, transposed
from .parts import Part
from .patterns import Pattern, Scope
from .types import Direction, KeyMapping, Mapped, Rule, Target, inverse, rope_perm, whole


class _Ctx:
    def __init__(self, shapes: MappingT[str, tuple[int, ...]], scope: Scope, sources: list[str]) -> None:
        self.shapes, self.scope, self.where, self.sources = shapes, scope, scope.where, sources
        self.seen: dict[str, set[int]] = {}
        self.consumed: set[str] = set()
        self.targets: dict[str, Target] = {}
        self.same: list[tuple[str, str]] = []

    def add(self, target: Target) -> None:
        if target.key in self.targets:
            raise CkptconvError(
                f"{self.where}: {target.key!r} is produced twice (from {self.targets[target.key].sources} "
                f"and {target.sources}); fix the mapping"
            )
        for part in target.parts:
            problem = part.problem()
            if problem:
                raise CkptconvError(f"{self.where} rule {target.rule}: {target.key!r}: {problem}")
        self.targets[target.key] = target

    def matches(self, pattern: str) -> list[tuple[str, dict[str, int]]]:
        compiled = Pattern(pattern)
        out = []
        for key in self.shapes:
            binding = compiled.match(key, self.scope)
            if binding is not None:
                out.append((key, binding))
        return out

    def values(self, name: str) -> set[int]:
        """The values placeholder `name` takes in the source keys, under every source pattern using it."""
        if name not in self.seen:
            found = self.seen[name] = set()
            for pattern in self.sources:
                if name in Pattern(pattern).placeholders:
                    found.update(b[name] for _, b in self.matches(pattern))
        return self.seen[name]

    def fmt(self, pattern: str, binding: MappingT[str, int]) -> str:
        return Pattern(pattern).format(binding, self.scope)

    def heads(self, rule: Rule) -> int:
        if rule.heads is not None:
            return self.scope.size(rule.heads)
        if rule.permute == "k" and isinstance(self.scope.config.get("num_key_value_heads"), int):
            return self.scope.size("num_key_value_heads")
        return self.scope.size("num_attention_heads")

    def geometry(self, rule: Rule, count: int) -> Geometry:
        split = None
        if count > 1 and not rule.duplicate:
            split = "interleave" if rule.interleave else "grouped" if rule.groups is not None else "plain"
        return Geometry(
            count=count,
            transpose=rule.transpose,
            narrow=None if rule.narrow is None else self.scope.size(rule.narrow),
            stack_dim=None if not rule.stack else (rule.stack_dim if rule.stack_dim is not None else 0),
            dim=rule.dim,
            split=split,
            sizes=tuple(self.scope.size(s) for s in rule.sizes),
            groups=1 if rule.groups is None else self.scope.size(rule.groups),
        )


def map_keys(
    mapping: KeyMapping,
    direction: Direction,
    shapes: MappingT[str, tuple[int, ...]],
    config: MappingT[str, Any],
    *,
    allow_unmapped: bool = False,
    where: str = "--mapping",
) -> Mapped:
    """Targets for every source key, in source order, the keys passed through unmapped, and the HF copies to
    check equal.

    Strict: a source key no rule consumes, an incomplete stack or concat, inconsistent shapes, or a target
    produced twice raise CkptconvError naming the key (`allow_unmapped` passes unconsumed keys through).
    """
    sides = [r.runtime if direction == "to_hf" else r.hf for r in mapping.rules]
    ctx = _Ctx(shapes, Scope(config, dict(mapping.ranges), where), [p for side in sides for p in side])
    tied = bool(config.get("tie_word_embeddings", False))
    variant = _variant(mapping, direction, ctx)
    for rule in mapping.rules:
        if rule.when is not None and rule.when != variant:
            continue
        if rule.drop:
            for pattern in rule.runtime if direction == "to_hf" else rule.hf:
                ctx.consumed.update(key for key, _ in ctx.matches(pattern))
        elif rule.tied and tied:
            _tied(ctx, rule, direction)
        elif (direction == "to_hf") == rule.fused_is_runtime:
            _from_fused(ctx, rule, direction)
        else:
            _into_fused(ctx, rule, direction)
    unmapped = [k for k in shapes if k not in ctx.consumed]
    if unmapped and not allow_unmapped:
        raise CkptconvError(
            f"{where}: no rule maps {unmapped[0]!r}"
            + (f" (and {len(unmapped) - 1} more)" if len(unmapped) > 1 else "")
            + "; add a rule or pass --allow-unmapped"
        )
    for key in unmapped:
        ctx.add(Target(key, shapes[key], (whole(key, shapes[key]),), "passthrough"))
    order = {k: i for i, k in enumerate(shapes)}
    targets = sorted(ctx.targets.values(), key=lambda t: min(order[s] for s in t.sources))
    return Mapped(targets, unmapped, ctx.same)


def _variant(mapping: KeyMapping, direction: Direction, ctx: _Ctx) -> str:
    """to_hf writes the mapping's HF expert form; to_runtime reads whichever form the HF keys are in."""
    if direction == "to_hf" or not mapping.variants:
        return mapping.hf_experts
    for variant in mapping.variants:
        patterns = [p for r in mapping.rules if r.when == variant for p in r.hf]
        if any(ctx.matches(p) for p in patterns):
            return variant
    return mapping.hf_experts


def _tied(ctx: _Ctx, rule: Rule, direction: Direction) -> None:
    """HF stores no such tensor: to HF the runtime one is dropped, to runtime it is a copy of the tied key."""
    if direction == "to_hf":
        ctx.consumed.update(key for key, _ in ctx.matches(rule.runtime[0]))
        return
    assert rule.tied is not None
    for key, binding in ctx.matches(rule.tied):
        shape = ctx.shapes[key]
        ctx.add(
            Target(ctx.fmt(rule.runtime[0], binding), shape, (whole(key, shape),), "tied", rule=rule.number)
        )


def _axes(pair: tuple[int, int] | None, ndim: int) -> tuple[int, ...] | None:
    """The dims of F in the order of F' (a swap is its own inverse)."""
    if pair is None:
        return None
    axes = list(range(ndim))
    axes[pair[0]], axes[pair[1]] = pair[1], pair[0]
    return tuple(axes)


def _in_fused(
    block_offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    steps: tuple[int, ...],
    pair: tuple[int, int] | None,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]:
    """A block of F' in F's coordinates (steps None when all are 1)."""
    offsets, sizes, steps = (transposed(t, pair) for t in (block_offsets, sizes, steps))
    return offsets, sizes, None if all(s == 1 for s in steps) else steps


def _from_fused(ctx: _Ctx, rule: Rule, direction: Direction) -> None:
    """The fused tensor is the source: cut it into the other side's tensors (split, unstack, narrow, ...)."""
    fused, others = (rule.runtime[0], rule.hf) if rule.fused_is_runtime else (rule.hf[0], rule.runtime)
    g = ctx.geometry(rule, 1 if rule.duplicate else len(others))
    op = "+".join(rule.ops(to_fused=False))
    for key, binding in ctx.matches(fused):
        if key in ctx.consumed:
            continue
        ctx.consumed.add(key)
        shape = ctx.shapes[key]
        axes = _axes(rule.transpose, len(shape))
        for piece in pieces(transposed(shape, rule.transpose), g, f"{ctx.where}: {key!r}"):
            perm = rope_perm(piece.shape[0], ctx.heads(rule)) if rule.permute else None
            parts = []
            for block, offsets in piece.blocks:
                src = _in_fused(block.offsets, block.sizes, block.steps, rule.transpose)
                sizes = _drop(block.sizes, g.stack_dim)
                parts.append(Part(key, src[0], src[1], offsets, sizes, perm, src[2], None, axes))
            shape_out, layout = _reshaped(ctx, rule, piece.shape, direction == "to_hf", key)
            element = {} if piece.element is None else {str(rule.stack): piece.element}
            for pattern in others if rule.duplicate else [others[piece.index]]:
                for b in _expand(ctx, pattern, {**binding, **element}):
                    ctx.add(Target(ctx.fmt(pattern, b), shape_out, tuple(parts), op, layout, rule.number))


def _into_fused(ctx: _Ctx, rule: Rule, direction: Direction) -> None:
    """The fused tensor is the target: gather the other side's tensors into it (concat, stack, pad, ...)."""
    to_hf = direction == "to_hf"
    fused, others = (rule.runtime[0], rule.hf) if rule.fused_is_runtime else (rule.hf[0], rule.runtime)
    if rule.duplicate:
        _copies(ctx, rule)
        others = others[:1]
    g = ctx.geometry(rule, len(others))
    op = "+".join(rule.ops(to_fused=True))
    for binding, keys in _groups(ctx, rule, others):
        elements = len(keys[0]) if rule.stack else None
        shapes = [ctx.shapes[k[0]] for k in keys]
        padded = _padded(ctx, rule, shapes[0]) if rule.narrow is not None else None
        fp = fused_shape(shapes, g, elements, padded)  # F' (for a reshape: laid out like the HF tensors)
        lmap = [d for d in range(len(fp)) if d != g.stack_dim]
        axes = _axes(rule.transpose, len(fp))
        l_axes = None if axes is None else tuple(sorted(range(len(lmap)), key=lambda i: axes[lmap[i]]))
        parts = []
        for piece in pieces(fp, g, f"{ctx.where}: {keys[0][0]!r}"):
            key = keys[piece.index][piece.element or 0]
            if piece.shape != ctx.shapes[key]:
                raise CkptconvError(
                    f"{ctx.where}: cannot combine {keys[0][0]!r} {list(shapes[0])} and {key!r} "
                    f"{list(ctx.shapes[key])} into one tensor"
                )
            perm = inverse(rope_perm(piece.shape[0], ctx.heads(rule))) if rule.permute else None
            for block, offsets in piece.blocks:
                dst = _in_fused(block.offsets, block.sizes, block.steps, rule.transpose)
                sizes = _drop(block.sizes, g.stack_dim)
                parts.append(Part(key, offsets, sizes, dst[0], dst[1], perm, None, dst[2], l_axes))
        ctx.consumed.update(k for per in keys for k in per)
        shape, layout = transposed(fp, rule.transpose), None
        if rule.hf_shape is not None and not to_hf:
            shape, layout = _unreshaped(ctx, rule, fp, g.stack_dim, keys[0][0]), fp
        ctx.add(Target(ctx.fmt(fused, binding), shape, tuple(parts), op, layout, rule.number))


def _groups(ctx: _Ctx, rule: Rule, patterns: tuple[str, ...]) -> list[tuple[dict[str, int], list[list[str]]]]:
    """The source keys that make each fused tensor: per binding (less the stacked placeholder), per pattern,
    per stacked element. Refuses a missing key or element."""
    groups: dict[tuple[tuple[str, int], ...], dict[int, str]] = {}
    for key, binding in ctx.matches(patterns[0]):
        if key in ctx.consumed:
            continue
        e = binding.pop(rule.stack, 0) if rule.stack else 0
        groups.setdefault(tuple(sorted(binding.items())), {})[e] = key
    out = []
    for items, found in groups.items():
        binding = dict(items)
        count = max(found) + 1
        bound = ctx.scope.bound(rule.stack) if rule.stack else None
        count = bound if bound is not None else count
        keys = []
        for pattern in patterns:
            row = []
            for e in range(count):
                key = ctx.fmt(pattern, {**binding, **({rule.stack: e} if rule.stack else {})})
                if key not in ctx.shapes and rule.stack:
                    raise CkptconvError(
                        f"{ctx.where}: {key!r} is missing ({len(found)} of {count} {rule.stack}s present)"
                    )
                if key not in ctx.shapes:
                    lead = next(iter(found.values()))
                    raise CkptconvError(
                        f"{ctx.where}: {lead!r} needs {key!r}, which the checkpoint does not have"
                    )
                row.append(key)
            shapes = {ctx.shapes[k] for k in row}
            if len(shapes) != 1:
                raise CkptconvError(
                    f"{ctx.where}: {row[0]!r} and the other {rule.stack}s differ in shape {sorted(shapes)}"
                )
            keys.append(row)
        out.append((binding, keys))
    return out


def _copies(ctx: _Ctx, rule: Rule) -> None:
    """duplicate, read back: every HF copy (hf[1:]) is consumed and recorded to be checked against the
    primary (hf[0]) it repeats."""
    primary = Pattern(rule.hf[0])
    for pattern in rule.hf[1:]:
        for key, binding in ctx.matches(pattern):
            main = primary.format({k: v for k, v in binding.items() if k in primary.placeholders}, ctx.scope)
            if main not in ctx.shapes:
                raise CkptconvError(f"{ctx.where}: {key!r} is a copy of {main!r}, which is missing")
            if ctx.shapes[main] != ctx.shapes[key]:
                raise CkptconvError(f"{ctx.where}: {key!r} should equal {main!r} but differs in shape")
            ctx.consumed.add(key)
            ctx.same.append((key, main))


def _expand(ctx: _Ctx, pattern: str, binding: dict[str, int]) -> list[dict[str, int]]:
    """`binding` for every value of the pattern's placeholders it lacks that the source's keys use (a copy
    per MTP layer the checkpoint has); just `binding` when it binds them all."""
    free = sorted(Pattern(pattern).placeholders - set(binding))
    values = [sorted(ctx.values(name)) for name in free]
    return [{**binding, **dict(zip(free, combo, strict=True))} for combo in itertools.product(*values)]


def _drop(t: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    if dim is None:
        return t
    return t[:dim] + t[dim + 1 :]


def _padded(ctx: _Ctx, rule: Rule, shape: tuple[int, ...]) -> int:
    """The runtime size along `dim` of a narrowed tensor read back: `padded`, or rounded up to `multiple`."""
    kept = shape[rule.dim]
    if rule.padded is not None:
        size = ctx.scope.size(rule.padded)
    elif rule.multiple:
        size = -(-kept // rule.multiple) * rule.multiple
    else:
        raise CkptconvError(
            f"{ctx.where} rule {rule.number}: narrow needs `padded` or `multiple` to read back"
        )
    if size < kept:
        raise CkptconvError(f"{ctx.where} rule {rule.number}: padded size {size} is less than {kept}")
    return size


def _resolve(ctx: _Ctx, spec: Sequence[int | str], shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """A reshape's other shape for a tensor of `shape`: sizes from config.json; -1 first is dim 0 (a reshape
    keeps it), and one other -1 takes what is left."""
    numel = math.prod(shape)
    dims = [-1 if d == -1 else ctx.scope.size(d) for d in spec]
    if dims and dims[0] == -1 and shape:
        dims[0] = shape[0]
    known = math.prod(d for d in dims if d != -1)
    if dims.count(-1) == 1 and known and numel % known == 0:
        dims[dims.index(-1)] = numel // known
    if math.prod(dims) != numel or any(d < 0 for d in dims):
        raise CkptconvError(f"{ctx.where}: {list(shape)} does not reshape to {what} {list(spec)}")
    return tuple(dims)


def _reshaped(
    ctx: _Ctx, rule: Rule, shape: tuple[int, ...], to_hf: bool, key: str
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The HF shape of a runtime piece (and the piece's shape as the layout), or the piece's own shape."""
    if rule.hf_shape is None or not to_hf:
        return shape, None
    out = _resolve(ctx, rule.hf_shape, shape, "hf_shape")
    if not shape or not out or out[0] != shape[0]:
        raise CkptconvError(f"{ctx.where}: {key!r}: a reshape must keep dim 0 ({list(shape)} -> {list(out)})")
    return out, shape


def _unreshaped(
    ctx: _Ctx, rule: Rule, layout: tuple[int, ...], stack_dim: int | None, key: str
) -> tuple[int, ...]:
    """The runtime shape of a tensor whose parts are laid out like the HF tensors (`layout`)."""
    inner = _drop(layout, stack_dim)
    spec = rule.runtime_shape or ((inner[0], -1) if inner else ())
    out = _resolve(ctx, spec, inner, "runtime_shape")
    if stack_dim is not None:
        out = (*out[:stack_dim], layout[stack_dim], *out[stack_dim:])
    if out[0] != layout[0]:
        raise CkptconvError(
            f"{ctx.where}: {key!r}: a reshape must keep dim 0 ({list(layout)} -> {list(out)})"
        )
    return out


__all__ = [
    "Direction",
    "KeyMapping",
    "Mapped",
    "Part",
    "Rule",
    "Target",
    "inverse",
    "map_keys",
    "rope_perm",
    "whole",
]
