"""Key mapping rules from data: runtime (trainer / DCP) names <-> HF names. Pure: no tensors, no I/O.

A mapping is a list of rules. Each rule names runtime key pattern(s) and HF key pattern(s) with named
placeholders (`layers.{layer}.attention.wq.weight`), and one operation, read in both directions:

- rename (one runtime key, one HF key), optionally with `permute = "q"` / `"k"`: the rotary row
  permutation torchtitan's Llama adapter applies (heads from config.json);
- `stack = "expert"` (one runtime key, one HF key holding `{expert}`): the runtime tensor stacks the HF
  tensors over `{expert}` along `dim` (default 0), e.g. `[E, F, D]` <-> E keys of `[F, D]`;
- split / concat (one side a list): the single tensor is the others concatenated along `dim`, with `sizes`
  (numbers, config.json keys or products of them; an equal split when omitted);
- `drop = true` with `runtime` (or `hf`): a runtime (or HF) key with no counterpart on the other side;
- `tied = "<hf key pattern>"`: when config.json says `tie_word_embeddings`, HF stores no such tensor and the
  runtime one is a copy of the tied key.

`map_keys` turns the source keys and shapes into targets: each target tensor is a list of `Part`s, each
copying a block of one source tensor into a block of the target. Both converters execute parts alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from collections.abc import Mapping as MappingT
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import CkptconvError

Direction = Literal["to_hf", "to_runtime"]
_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


@dataclass(frozen=True)
class Part:
    """Copy source block (src_offsets, src_sizes) to target block (dst_offsets, dst_sizes).

    The two blocks have the same number of elements and the same shape once size-1 dims are dropped. With
    `perm`, target row r of the block is source row `perm[r]` of the block (dim 0 of both).
    """

    src: str
    src_offsets: tuple[int, ...]
    src_sizes: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    dst_sizes: tuple[int, ...]
    perm: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Target:
    key: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    op: str  # rename, permute, stack, unstack, split, concat, tied, passthrough

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(p.src for p in self.parts))


@dataclass(frozen=True)
class Rule:
    runtime: tuple[str, ...]
    hf: tuple[str, ...]
    dim: int = 0
    sizes: tuple[int | str, ...] = ()
    stack: str | None = None
    permute: str | None = None
    drop: bool = False
    tied: str | None = None
    when: str | None = None  # only with this variant ("per_expert" or "fused" HF experts)


@dataclass(frozen=True)
class KeyMapping:
    name: str
    rules: tuple[Rule, ...]
    hf_experts: str = "per_expert"  # the variant written to HF; both are read
    variants: tuple[str, ...] = field(default=())


def _compile(pattern: str) -> re.Pattern[str]:
    regex, pos = "", 0
    for m in _PLACEHOLDER.finditer(pattern):
        regex += re.escape(pattern[pos : m.start()]) + f"(?P<{m.group(1)}>[0-9]+)"
        pos = m.end()
    return re.compile("^" + regex + re.escape(pattern[pos:]) + "$")


def _fmt(pattern: str, binding: MappingT[str, Any]) -> str:
    return _PLACEHOLDER.sub(lambda m: str(binding[m.group(1)]), pattern)


def _placeholders(pattern: str) -> set[str]:
    return set(_PLACEHOLDER.findall(pattern))


def rope_perm(rows: int, heads: int) -> tuple[int, ...]:
    """The rotary row permutation to HF, as torchtitan's Llama adapter `_permute` (and HF's own conversion
    script) apply it: `w.view(heads, half, 2, cols).transpose(1, 2)`; interleaved pairs become halves.

    HF row (h, j, i) is runtime row (h, i, j): head h, pair i < half, j in {0, 1}. perm[hf_row] = runtime_row.
    """
    if heads <= 0 or rows % (2 * heads):
        raise CkptconvError(f"rope permutation: {rows} rows do not split into {heads} heads of even size")
    half = rows // heads // 2
    return tuple(h * 2 * half + 2 * i + j for h in range(heads) for j in range(2) for i in range(half))


def inverse(perm: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for r, s in enumerate(perm):
        out[s] = r
    return tuple(out)


class _Ctx:
    def __init__(
        self, shapes: MappingT[str, tuple[int, ...]], config: MappingT[str, Any], where: str
    ) -> None:
        self.shapes, self.config, self.where = shapes, config, where
        self.consumed: set[str] = set()
        self.targets: dict[str, Target] = {}

    def size(self, value: int | str) -> int:
        """An int, a config.json key, or a product of them ("num_key_value_heads * head_dim")."""
        if isinstance(value, int):
            return value
        total = 1
        for factor in (f.strip() for f in value.split("*")):
            if factor.isdigit():
                total *= int(factor)
            elif isinstance(self.config.get(factor), int):
                total *= int(self.config[factor])
            else:
                raise CkptconvError(
                    f"{self.where}: size {factor!r} is not an integer in config.json; pass --config"
                )
        return total

    def heads(self, which: str) -> int:
        key = {"q": "num_attention_heads", "k": "num_key_value_heads"}[which]
        if which == "k" and key not in self.config:
            key = "num_attention_heads"
        return self.size(key)

    def add(self, target: Target) -> None:
        if target.key in self.targets:
            raise CkptconvError(
                f"{self.where}: {target.key!r} is produced twice (from {self.targets[target.key].sources} "
                f"and {target.sources}); fix the mapping"
            )
        self.targets[target.key] = target

    def matches(self, pattern: str) -> list[tuple[str, dict[str, int]]]:
        regex = _compile(pattern)
        out = []
        for key in self.shapes:
            m = regex.match(key)
            if m:
                out.append((key, {k: int(v) for k, v in m.groupdict().items()}))
        return out


def whole(key: str, shape: tuple[int, ...], perm: tuple[int, ...] | None = None) -> Part:
    """All of `key`, as all of its target (optionally with rows permuted)."""
    zeros = (0,) * len(shape)
    return Part(key, zeros, shape, zeros, shape, perm)


def _block(
    shape: tuple[int, ...], dim: int, start: int, size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(size if d == dim else s for d, s in enumerate(shape))
    return offsets, sizes


def map_keys(
    mapping: KeyMapping,
    direction: Direction,
    shapes: MappingT[str, tuple[int, ...]],
    config: MappingT[str, Any],
    *,
    allow_unmapped: bool = False,
    where: str = "--mapping",
) -> tuple[list[Target], list[str]]:
    """Targets for every source key, in source order, and the keys passed through unmapped.

    Strict: a source key no rule consumes, an incomplete stack or concat, inconsistent shapes, or a target
    produced twice raise CkptconvError naming the key (`allow_unmapped` passes unconsumed keys through).
    """
    ctx = _Ctx(shapes, config, where)
    tied = bool(config.get("tie_word_embeddings", False))
    variant = _variant(mapping, direction, shapes)
    for rule in mapping.rules:
        if rule.when is not None and rule.when != variant:
            continue
        if direction == "to_hf":
            _to_hf(ctx, rule, tied)
        else:
            _to_runtime(ctx, rule, tied)
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
    return targets, unmapped


def _variant(mapping: KeyMapping, direction: Direction, shapes: MappingT[str, tuple[int, ...]]) -> str:
    """to_hf writes the mapping's HF expert form; to_runtime reads whichever form the HF keys are in."""
    if direction == "to_hf" or not mapping.variants:
        return mapping.hf_experts
    for variant in mapping.variants:
        patterns = [_compile(p) for r in mapping.rules if r.when == variant for p in r.hf]
        if any(p.match(k) for p in patterns for k in shapes):
            return variant
    return mapping.hf_experts


def _to_hf(ctx: _Ctx, rule: Rule, tied: bool) -> None:
    if not rule.runtime:  # an HF-side drop: nothing to do in this direction
        return
    if rule.drop or (rule.tied and tied):
        ctx.consumed.update(key for key, _ in ctx.matches(rule.runtime[0]))
        return
    if rule.stack:
        _unstack(ctx, rule)
        return
    _pairwise(ctx, rule, rule.runtime, rule.hf, lambda rows: rope_perm(rows, ctx.heads(rule.permute or "q")))


def _to_runtime(ctx: _Ctx, rule: Rule, tied: bool) -> None:
    if rule.drop:
        for pattern in rule.hf:  # an HF key with no runtime counterpart (e.g. rotary_emb.inv_freq)
            ctx.consumed.update(key for key, _ in ctx.matches(pattern))
        return
    if rule.tied and tied:
        for key, binding in ctx.matches(rule.tied):
            shape = ctx.shapes[key]
            ctx.add(Target(_fmt(rule.runtime[0], binding), shape, (whole(key, shape),), "tied"))
        return
    if rule.stack:
        _stack(ctx, rule)
        return
    _pairwise(
        ctx,
        rule,
        rule.hf,
        rule.runtime,
        lambda rows: inverse(rope_perm(rows, ctx.heads(rule.permute or "q"))),
    )


def _pairwise(
    ctx: _Ctx,
    rule: Rule,
    sources: tuple[str, ...],
    targets: tuple[str, ...],
    perm_of: Callable[[int], tuple[int, ...]],
) -> None:
    """Rename (with the rule's permutation), split one source into several targets, or concatenate several
    sources into one target: the same code for both directions, with sources and targets swapped."""
    for key, binding in ctx.matches(sources[0]):
        if key in ctx.consumed:
            continue
        if len(sources) > 1:
            keys = [_fmt(p, binding) for p in sources]
            _require(ctx, keys, key)
            ctx.consumed.update(keys)
            ctx.add(_concat(ctx, _fmt(targets[0], binding), keys, rule.dim, "concat"))
            continue
        ctx.consumed.add(key)
        shape = ctx.shapes[key]
        if len(targets) > 1:
            start = 0
            for pattern, size in zip(
                targets, _split_sizes(ctx, rule, shape[rule.dim], len(targets), key), strict=True
            ):
                src_off, src_size = _block(shape, rule.dim, start, size)
                part = Part(key, src_off, src_size, (0,) * len(shape), src_size)
                ctx.add(Target(_fmt(pattern, binding), src_size, (part,), "split"))
                start += size
        else:
            perm = perm_of(shape[0]) if rule.permute else None
            ctx.add(
                Target(
                    _fmt(targets[0], binding),
                    shape,
                    (whole(key, shape, perm),),
                    "permute" if perm else "rename",
                )
            )


def _unstack(ctx: _Ctx, rule: Rule) -> None:
    for key, binding in ctx.matches(rule.runtime[0]):
        if key in ctx.consumed:
            continue
        ctx.consumed.add(key)
        shape = ctx.shapes[key]
        for e in range(shape[rule.dim]):
            src_off, src_size = _block(shape, rule.dim, e, 1)
            dst = tuple(s for d, s in enumerate(shape) if d != rule.dim)
            part = Part(key, src_off, src_size, (0,) * len(dst), dst)
            assert rule.stack is not None
            ctx.add(Target(_fmt(rule.hf[0], {**binding, rule.stack: e}), dst, (part,), "unstack"))


def _stack(ctx: _Ctx, rule: Rule) -> None:
    assert rule.stack is not None
    groups: dict[tuple[tuple[str, int], ...], dict[int, str]] = {}
    for key, binding in ctx.matches(rule.hf[0]):
        e = binding.pop(rule.stack)
        groups.setdefault(tuple(sorted(binding.items())), {})[e] = key
    for binding_items, experts in groups.items():
        count = max(experts) + 1
        missing = [e for e in range(count) if e not in experts]
        if missing:
            example = _fmt(rule.hf[0], {**dict(binding_items), rule.stack: missing[0]})
            raise CkptconvError(
                f"{ctx.where}: {example!r} is missing ({len(experts)} of {count} {rule.stack}s present)"
            )
        shapes = {ctx.shapes[experts[e]] for e in range(count)}
        if len(shapes) != 1:
            raise CkptconvError(
                f"{ctx.where}: {experts[0]!r} and the other {rule.stack}s differ in shape {sorted(shapes)}"
            )
        inner = shapes.pop()
        shape = (*inner[: rule.dim], count, *inner[rule.dim :])
        parts = []
        for e in range(count):
            dst_off, dst_size = _block(shape, rule.dim, e, 1)
            parts.append(Part(experts[e], (0,) * len(inner), inner, dst_off, dst_size))
            ctx.consumed.add(experts[e])
        ctx.add(Target(_fmt(rule.runtime[0], dict(binding_items)), shape, tuple(parts), "stack"))


def _require(ctx: _Ctx, keys: list[str], lead: str) -> None:
    for k in keys:
        if k not in ctx.shapes:
            raise CkptconvError(f"{ctx.where}: {lead!r} needs {k!r}, which the checkpoint does not have")


def _concat(ctx: _Ctx, target: str, keys: list[str], dim: int, op: str) -> Target:
    shapes = [ctx.shapes[k] for k in keys]
    base = shapes[0]
    for k, s in zip(keys, shapes, strict=True):
        if len(s) != len(base) or any(
            a != b for d, (a, b) in enumerate(zip(s, base, strict=True)) if d != dim
        ):
            raise CkptconvError(
                f"{ctx.where}: cannot concatenate {keys[0]!r} {list(base)} and {k!r} {list(s)}"
            )
    total = sum(s[dim] for s in shapes)
    shape = tuple(total if d == dim else n for d, n in enumerate(base))
    parts, start = [], 0
    for k, s in zip(keys, shapes, strict=True):
        dst_off, dst_size = _block(shape, dim, start, s[dim])
        parts.append(Part(k, (0,) * len(s), s, dst_off, dst_size))
        start += s[dim]
    return Target(target, shape, tuple(parts), op)


def _split_sizes(ctx: _Ctx, rule: Rule, total: int, count: int, key: str) -> list[int]:
    if rule.sizes:
        sizes = [ctx.size(s) for s in rule.sizes]
    elif total % count == 0:
        sizes = [total // count] * count
    else:
        raise CkptconvError(
            f"{ctx.where}: {key!r} dim {rule.dim} of {total} does not split in {count}; give sizes"
        )
    if sum(sizes) != total:
        raise CkptconvError(
            f"{ctx.where}: {key!r} dim {rule.dim} is {total}, but the sizes add up to {sum(sizes)}"
        )
    return sizes
