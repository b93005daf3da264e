"""Key mapping rules from data: runtime (trainer / DCP) names <-> HF names. Pure: no tensors, no I/O.

A mapping is a list of rules. Each rule names runtime key pattern(s) and HF key pattern(s) with placeholders
(`layers.{layer}.attention.wq.weight`, see `patterns.py`) and how their tensors relate, read in both
directions (every operation, with the shapes on both sides, in docs/mapping.md):

- rename; `permute = "q"` / `"k"`: the rotary row permutation torchtitan's adapters apply;
- `stack = "expert"`: the runtime tensor stacks the HF tensors over a placeholder along `stack_dim`
  (`stack = ["layer", "expert"]`: over two, on consecutive dims, as Megatron-Core stacks its experts);
- split / concat (one side a list) along `dim`: plain (`sizes`), `interleave`d, or `groups` (fused QKV
  laid out per KV group);
- `unbind = true`: the list's tensors are the slices of `dim` ([2, F, D] <-> [F, D], [F, D]);
- an hf key named more than once in the list: the concatenation of its pieces (`hf_groups`: per group);
- `offset = 1`: HF value = runtime value + offset (the only value transform: `Target.offset`);
- `transpose = [a, b]`, `narrow` (vocabulary padding), `hf_shape` (reshape), `duplicate` (HF copies);
- `drop = true`, `tied = "<hf key pattern>"`; `when` (an HF expert form), `layout` (a runtime layout, or a
  list of them, of different groups, all in effect; told apart by the source's keys and shapes: `layouts.py`).

The side with one key is the fused tensor F; `ops.pieces` cuts F into the other side's tensors, and each
piece becomes a `Part` (a block copy) in either direction: `map_keys` gives every target its parts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from collections.abc import Mapping as MappingT
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.mapping.context import Ctx
from ckptconv.mapping.layouts import detect
from ckptconv.mapping.ops import fused_shape, pieces, squeeze, transposed
from ckptconv.mapping.parts import Part
from ckptconv.mapping.patterns import Pattern, Scope
from ckptconv.mapping.sizes import padded_size, reshaped, unreshaped
from ckptconv.mapping.types import (
    Direction,
    KeyMapping,
    Mapped,
    Rule,
    Target,
    inverse,
    rope_perm,
    rope_rows,
    whole,
)
from ckptconv.mapping.variant import variants_in


def map_keys(
    mapping: KeyMapping,
    direction: Direction,
    shapes: MappingT[str, tuple[int, ...]],
    config: MappingT[str, Any],
    *,
    allow_unmapped: bool = False,
    where: str = "--mapping",
    reference: Collection[str] | None = None,
) -> Mapped:
    """Targets for every source key, in source order, the keys passed through unmapped, and the HF copies to
    check equal. `reference`: the HF keys a reference model holds (`--copy-from` / `--reference`), None
    without one: a `duplicate = "reference"` rule writes its copies only where it holds them.

    Strict: a source key no rule consumes, an incomplete stack or concat, inconsistent shapes, or a target
    produced twice raise CkptconvError naming the key (`allow_unmapped` passes unconsumed keys through).
    """
    sides = [r.runtime if direction == "to_hf" else r.hf for r in mapping.rules]
    scope = Scope(config, dict(mapping.ranges), where, dict(mapping.defaults))
    ctx = Ctx(shapes, scope, [p for side in sides for p in side])
    ctx.reference = None if reference is None else set(reference)
    tied = _tie_word_embeddings(config, where)
    variant = _variant(mapping, direction, ctx)
    layouts = detect(mapping, shapes, scope) if direction == "to_hf" else mapping.written_layouts()
    chosen = set(layouts.values())
    for rule in mapping.rules:
        if (rule.when is not None and rule.when != variant) or not chosen.issuperset(rule.layout or ()):
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
    return Mapped(targets, unmapped, ctx.same, ctx.tied)


def _tie_word_embeddings(config: MappingT[str, Any], where: str) -> bool:
    """config.json's `tie_word_embeddings`: true, false or absent (false); anything else is refused, not
    read by its truthiness (the string "false" would tie)."""
    value = config.get("tie_word_embeddings", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CkptconvError(
            f"{where}: config.json's tie_word_embeddings is {value!r}; it must be true or false"
        )
    return value


def _variant(mapping: KeyMapping, direction: Direction, ctx: Ctx) -> str:
    """to_hf writes the mapping's HF expert form; to_runtime reads whichever form the HF keys are in."""
    if direction == "to_hf" or not mapping.variants:
        return mapping.hf_experts
    found = variants_in(mapping, ctx.shapes, ctx.scope)
    return found[0] if found else mapping.hf_experts


def _tied(ctx: Ctx, rule: Rule, direction: Direction) -> None:
    """HF stores no such tensor: to HF the runtime one is dropped, to runtime it is a copy of the tied key
    (padded with zeros along `dim` like the rule's own tensor, when the rule narrows: [V, D] -> [V', D]).
    Dropped, it is kept aside as the rule maps it untied, with the HF key it is tied to (`Mapped.tied`), for
    the caller to check that it holds what that key holds."""
    if direction == "to_hf":
        before = set(ctx.targets)
        hf = Pattern(rule.hf[0])
        try:
            (_from_fused if rule.fused_is_runtime else _into_fused)(ctx, rule, direction)
        except CkptconvError:  # a head the rule cannot map (not the embedding's shape): left out all the same
            for key in [k for k in ctx.targets if k not in before]:
                del ctx.targets[key]
            for key, binding in ctx.matches(rule.runtime[0]):
                ctx.consumed.add(key)
                ctx.tied.append((None, key, ctx.fmt(rule.tied or "", binding)))
            return
        for key in [k for k in ctx.targets if k not in before]:
            target = ctx.targets.pop(key)
            binding = hf.match(key, ctx.scope) or {}
            ctx.tied.append((target, target.sources[0], ctx.fmt(rule.tied or "", binding)))
        return
    assert rule.tied is not None
    for key, binding in ctx.matches(rule.tied):
        shape = out = ctx.shapes[key]
        if rule.narrow is not None:
            size = padded_size(ctx.scope, rule, shape)
            out = (*shape[: rule.dim], size, *shape[rule.dim + 1 :])
        op = "tied+pad" if out != shape else "tied"
        ctx.add(Target(ctx.fmt(rule.runtime[0], binding), out, (whole(key, shape),), op, rule=rule.number))


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


def _from_fused(ctx: Ctx, rule: Rule, direction: Direction) -> None:
    """The fused tensor is the source: cut it into the other side's tensors (split, unstack, narrow, ...)."""
    fused, others = (rule.runtime[0], rule.hf) if rule.fused_is_runtime else (rule.hf[0], rule.runtime)
    g = ctx.geometry(rule, 1 if rule.duplicate else len(others))
    others = rule.hf_keys if rule.repeated else others  # a piece's index: its distinct key (`ops._joined`)
    op = "+".join(rule.ops(to_fused=False))
    for key, binding in ctx.matches(fused):
        if key in ctx.consumed:
            continue
        ctx.consumed.add(key)
        shape, where = ctx.shapes[key], f"{ctx.where}: {key!r}"
        fused_t = transposed(shape, rule.transpose, where)
        axes = _axes(rule.transpose, len(shape))
        for piece in pieces(fused_t, g, where):
            perm = rope_rows(piece.shape, ctx.heads(rule), where) if rule.permute else None
            parts = []
            for block, offsets in piece.blocks:
                src = _in_fused(block.offsets, block.sizes, block.steps, rule.transpose)
                sizes = squeeze(block.sizes, g.dropped)
                parts.append(Part(key, src[0], src[1], offsets, sizes, perm, src[2], None, axes))
            shape_out, layout = reshaped(ctx.scope, rule, piece.shape, direction == "to_hf", key)
            element = dict(zip(rule.stacks, piece.element or (), strict=True))
            for n, pattern in list(enumerate(others)) if rule.duplicate else [(0, others[piece.index])]:
                for b in _expand(ctx, pattern, {**binding, **element}):
                    out = ctx.fmt(pattern, b)
                    if n and rule.reference_copies and out not in (ctx.reference or ()):
                        continue  # a copy only a reference that holds it asks for
                    offset = _offset(rule, 1 if direction == "to_hf" else -1)
                    ctx.add(Target(out, shape_out, tuple(parts), op, layout, rule.number, offset))


def _into_fused(ctx: Ctx, rule: Rule, direction: Direction) -> None:
    """The fused tensor is the target: gather the other side's tensors into it (concat, stack, pad, ...)."""
    to_hf = direction == "to_hf"
    fused, others = (rule.runtime[0], rule.hf) if rule.fused_is_runtime else (rule.hf[0], rule.runtime)
    if rule.duplicate:
        _copies(ctx, rule)
        others = others[:1]
    g = ctx.geometry(rule, len(others))
    others = rule.hf_keys if rule.repeated else others  # a piece's index: its distinct key (`ops._joined`)
    op = "+".join(rule.ops(to_fused=True))
    for binding, counts, keys in _groups(ctx, rule, others):
        shapes = [ctx.shapes[k[0]] for k in keys]
        padded = padded_size(ctx.scope, rule, shapes[0]) if rule.narrow is not None else None
        where = f"{ctx.where}: {keys[0][0]!r}"
        fp = fused_shape(shapes, g, counts, padded, where)  # F' (for a reshape: laid out like the HF tensors)
        transposed(fp, rule.transpose, where)  # a dim it lacks: refused here
        lmap = [d for d in range(len(fp)) if d not in g.dropped]
        axes = _axes(rule.transpose, len(fp))
        l_axes = None if axes is None else tuple(sorted(range(len(lmap)), key=lambda i: axes[lmap[i]]))
        parts = []
        for piece in pieces(fp, g, f"{ctx.where}: {keys[0][0]!r}"):
            key = keys[piece.index][_flat(piece.element or (), counts)]
            if piece.shape != ctx.shapes[key]:
                raise CkptconvError(
                    f"{ctx.where}: cannot combine {keys[0][0]!r} {list(shapes[0])} and {key!r} "
                    f"{list(ctx.shapes[key])} into one tensor"
                )
            at = f"{ctx.where}: {key!r}"
            perm = rope_rows(piece.shape, ctx.heads(rule), at, back=True) if rule.permute else None
            for block, offsets in piece.blocks:
                dst = _in_fused(block.offsets, block.sizes, block.steps, rule.transpose)
                sizes = squeeze(block.sizes, g.dropped)
                parts.append(Part(key, offsets, sizes, dst[0], dst[1], perm, None, dst[2], l_axes))
        ctx.consumed.update(k for per in keys for k in per)
        shape, layout = transposed(fp, rule.transpose), None
        if rule.hf_shape is not None and not to_hf:
            shape, layout = unreshaped(ctx.scope, rule, fp, g.stack_dims, keys[0][0]), fp
        offset = _offset(rule, 1 if to_hf else -1)
        ctx.add(Target(ctx.fmt(fused, binding), shape, tuple(parts), op, layout, rule.number, offset))


def _offset(rule: Rule, sign: int) -> float | None:
    """The value a target's elements get added: the rule's `offset` to HF, its negation to runtime."""
    return None if rule.offset is None else sign * rule.offset


def _groups(
    ctx: Ctx, rule: Rule, patterns: tuple[str, ...]
) -> list[tuple[dict[str, int], tuple[int, ...], list[list[str]]]]:
    """The source keys that make each fused tensor: per binding (less the stacked placeholders), the number
    of elements along each stacked dim, and per pattern the keys of every element (row-major over the
    stacked placeholders). Refuses a missing key or element."""
    groups: dict[tuple[tuple[str, int], ...], dict[tuple[int, ...], str]] = {}
    for key, binding in ctx.matches(patterns[0]):
        if key in ctx.consumed:
            continue
        element = tuple(binding.pop(name) for name in rule.stacks)
        groups.setdefault(tuple(sorted(binding.items())), {})[element] = key
    out = []
    for items, found in groups.items():
        binding = dict(items)
        counts = tuple(_count(ctx, name, [e[i] for e in found]) for i, name in enumerate(rule.stacks))
        keys = [_row(ctx, rule, pattern, binding, counts, found) for pattern in patterns]
        out.append((binding, counts, keys))
    return out


def _count(ctx: Ctx, name: str, seen: list[int]) -> int:
    """How many elements a stacked placeholder has: its range's bound, else the highest one seen plus 1."""
    bound = ctx.scope.bound(name)
    return bound if bound is not None else max(seen) + 1


def _flat(element: tuple[int, ...], counts: tuple[int, ...]) -> int:
    """The row-major position of `element` among `counts` elements per stacked dim (0 with no stack)."""
    index = 0
    for e, n in zip(element, counts, strict=True):
        index = index * n + e
    return index


def _row(
    ctx: Ctx,
    rule: Rule,
    pattern: str,
    binding: dict[str, int],
    counts: tuple[int, ...],
    found: dict[tuple[int, ...], str],
) -> list[str]:
    """The keys of `pattern` for every element (row-major), all present and of one shape."""
    row = []
    for element in itertools.product(*(range(n) for n in counts)):
        key = ctx.fmt(pattern, {**binding, **dict(zip(rule.stacks, element, strict=True))})
        if key not in ctx.shapes and rule.stacks:
            what = " and ".join(rule.stacks)
            raise CkptconvError(
                f"{ctx.where}: {key!r} is missing ({len(found)} of {math.prod(counts)} {what}s present)"
            )
        if key not in ctx.shapes:
            lead = next(iter(found.values()))
            raise CkptconvError(f"{ctx.where}: {lead!r} needs {key!r}, which the checkpoint does not have")
        row.append(key)
    shapes = {ctx.shapes[k] for k in row}
    if len(shapes) != 1:
        what = " and ".join(rule.stacks)
        raise CkptconvError(f"{ctx.where}: {row[0]!r} and the other {what}s differ in shape {sorted(shapes)}")
    return row


def _copies(ctx: Ctx, rule: Rule) -> None:
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


def _expand(ctx: Ctx, pattern: str, binding: dict[str, int]) -> list[dict[str, int]]:
    """`binding` for every value of the pattern's placeholders it lacks that the source's keys use (a copy
    per MTP layer the checkpoint has); just `binding` when it binds them all."""
    free = sorted(Pattern(pattern).placeholders - set(binding))
    values = [sorted(ctx.values(name)) for name in free]
    return [{**binding, **dict(zip(free, combo, strict=True))} for combo in itertools.product(*values)]


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
