"""Key patterns with placeholders, placeholder arithmetic and ranges. Pure.

    layers.{layer}.attention.wq.weight              {layer} matches a number: 0, 1, 12 (never 01)
    model.layers.{mtp + num_hidden_layers}.eh_proj   the key's number is mtp plus a config.json size

A mapping's `[mapping.ranges]` bounds a placeholder (`layer = "num_hidden_layers"`: 0 <= layer < it). A key
whose binding falls outside a range does not match the pattern at all, so another rule may take it (an MTP
layer, numbered after the main layers, is never read as a main layer).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.mapping import expr

_SLOT = re.compile(r"\{\s*([a-z_][a-z0-9_]*)\s*(?:([+-])\s*([^{}\s](?:[^{}]*[^{}\s])?)\s*)?\}")  # linear
_NUMBER = "(0|[1-9][0-9]*)"


@dataclass(frozen=True)
class Range:
    """0 <= placeholder < `below` (a size expression); `default` when config.json lacks its keys."""

    below: str | int
    default: int | None = None


@dataclass
class Scope:
    """What matching needs besides the key: config.json, the ranges, where errors point, and the mapping's
    defaults for config keys config.json lacks."""

    config: Mapping[str, Any]
    ranges: Mapping[str, Range]
    where: str
    defaults: Mapping[str, int] = field(default_factory=dict)
    _bounds: dict[str, int] = field(default_factory=dict)

    def size(self, value: int | str) -> int:
        return expr.size(value, self.config, self.where, self.defaults)

    def bound(self, name: str) -> int | None:
        """The exclusive upper bound of placeholder `name`, None if it has no range."""
        spec = self.ranges.get(name)
        if spec is None:
            return None
        if name not in self._bounds:
            try:
                self._bounds[name] = self.size(spec.below)
            except expr.MissingKey:
                if spec.default is None:
                    raise CkptconvError(
                        f"{self.where}: the range of {{{name}}} needs {spec.below!r} from config.json; "
                        "pass --config"
                    ) from None
                self._bounds[name] = spec.default
        return self._bounds[name]

    def in_range(self, name: str, value: int) -> bool:
        bound = self.bound(name)
        return value >= 0 and (bound is None or value < bound)


@dataclass(frozen=True)
class Pattern:
    text: str

    @cached_property
    def slots(self) -> tuple[tuple[str, str, str], ...]:
        """(placeholder, sign, offset expression) per `{...}`, in order; sign "" when there is no offset."""
        return tuple((m.group(1), m.group(2) or "", m.group(3) or "") for m in _SLOT.finditer(self.text))

    @cached_property
    def placeholders(self) -> frozenset[str]:
        return frozenset(name for name, _, _ in self.slots)

    @cached_property
    def _regex(self) -> re.Pattern[str]:
        regex, pos = "", 0
        for m in _SLOT.finditer(self.text):
            regex += re.escape(self.text[pos : m.start()]) + _NUMBER
            pos = m.end()
        return re.compile("^" + regex + re.escape(self.text[pos:]) + "$")

    def match(self, key: str, scope: Scope) -> dict[str, int] | None:
        """The placeholders' values if `key` matches (every value within its range), else None."""
        m = self._regex.match(key)
        if m is None:
            return None
        binding: dict[str, int] = {}
        for (name, sign, offset), number in zip(self.slots, m.groups(), strict=True):
            value = int(number)
            if sign:
                shift = scope.size(offset)
                value = value - shift if sign == "+" else value + shift
            if binding.setdefault(name, value) != value or not scope.in_range(name, value):
                return None
        return binding

    def format(self, binding: Mapping[str, int], scope: Scope) -> str:
        def one(m: re.Match[str]) -> str:
            if m.group(1) not in binding:
                raise CkptconvError(
                    f"{scope.where}: {self.text!r} needs {{{m.group(1)}}}, which the key on the other side "
                    "of its rule does not give; fix the mapping"
                )
            value = binding[m.group(1)]
            if m.group(2):
                shift = scope.size(m.group(3))
                value = value + shift if m.group(2) == "+" else value - shift
            return str(value)

        return _SLOT.sub(one, self.text)

    def check(self, where: str) -> None:
        """Refuse what cannot be matched back: braces that are not placeholders, two numbers side by side."""
        rest = _SLOT.sub("", self.text)
        if "{" in rest or "}" in rest:
            raise CkptconvError(f"{where}: {self.text!r} has a brace that is not a {{placeholder}}")
        if re.search(r"\}\s*\{", self.text):
            raise CkptconvError(f"{where}: {self.text!r} has two placeholders with nothing between them")
