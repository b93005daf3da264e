"""The state of one mapping run (`Ctx`): the source's shapes and scope, the keys consumed, the targets made
so far, and the rule's resolved geometry. Pure."""

from __future__ import annotations

from collections.abc import Mapping as MappingT

from ckptconv.errors import CkptconvError
from ckptconv.mapping.ops import Geometry
from ckptconv.mapping.patterns import Pattern, Scope
from ckptconv.mapping.types import Rule, Target


class Ctx:
    """One mapping run: the source's shapes, the scope, and what the rules have consumed and made."""

    def __init__(self, shapes: MappingT[str, tuple[int, ...]], scope: Scope, sources: list[str]) -> None:
        self.shapes, self.scope, self.where, self.sources = shapes, scope, scope.where, sources
        self.seen: dict[str, set[int]] = {}
        self.consumed: set[str] = set()
        self.targets: dict[str, Target] = {}
        self.same: list[tuple[str, str]] = []
        self.tied: list[tuple[Target | None, str, str]] = []
        self.reference: set[str] | None = None  # the HF keys a reference model holds (None: no reference)

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
        first = rule.stack_dim if rule.stack_dim is not None else 0
        split = None
        if count > 1 and not rule.duplicate:
            split = "interleave" if rule.interleave else "grouped" if rule.groups is not None else "plain"
            split = "unbind" if rule.unbind else split
        return Geometry(
            count=count,
            transpose=rule.transpose,
            narrow=None if rule.narrow is None else self.scope.size(rule.narrow),
            stack_dims=tuple(range(first, first + len(rule.stacks))),
            dim=rule.dim,
            split=split,
            sizes=tuple(self.scope.size(s) for s in rule.sizes),
            groups=1 if rule.groups is None else self.scope.size(rule.groups),
            slots=rule.slots if rule.repeated and split is not None else (),
            hf_groups=1 if rule.hf_groups is None else self.scope.size(rule.hf_groups),
            rule=rule.number,
        )
