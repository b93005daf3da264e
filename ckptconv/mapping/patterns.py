"""Key patterns with placeholders, placeholder arithmetic and ranges. Pure.

    layers.{layer}.attention.wq.weight              {layer} matches a number: 0, 1, 12 (never 01)
    model.layers.{mtp + num_hidden_layers}.eh_proj   the key's number is mtp plus a config.json size

A mapping's `[mapping.ranges]` bounds a placeholder (`layer = "num_hidden_layers"`: 0 <= layer < it), or
picks the layers of one type from a config.json list (`linear = { where = "layer_types", equals =
"linear_attention" }`: the i with layer_types[i] == "linear_attention"). A key whose binding falls outside a
range does not match the pattern at all, so another rule may take it (an MTP layer, numbered after the main
layers, is never read as a main layer; a delta-net layer's input norm is not a full-attention layer's).
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
_CONFIG_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}(?:\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,7}")  # a dotted key
MAX_TYPES = 2**20  # the most entries a config.json list of layer types may have (no model has 2**20 layers)


@dataclass(frozen=True)
class Range:
    """0 <= placeholder < `below` (a size expression), or, with `where`, the indices i of the config.json
    list `where` with list[i] == `equals` (then `below`, if given, is the length the list must have)."""

    below: str | int | None
    """The exclusive upper bound; with `where`, the list's required length (None: any length)."""
    default: int | None = None
    """The bound when config.json lacks the keys of `below` (not with `where`)."""
    where: str | None = None
    """A config.json key (dotted for a nested one) holding a list of strings, one per layer."""
    equals: str | None = None
    """The entry of `where` whose indices the placeholder takes."""
    every: str | int | None = None
    """Where config.json has no `where` list: the layers i with i + 1 a multiple of this size are of the type
    (how transformers fills Qwen3-Next's and Qwen3.5's `layer_types` from `full_attention_interval`)."""
    between: bool = False
    """With `every`: the layers between those are of the type instead."""

    @classmethod
    def of_type(cls, name: str, spec: Mapping[str, Any], where: str) -> Range:
        """`{ where = config key, equals = layer type[, below = size: the list's length][, every = size[,
        between = true]]: the types where config.json has no list }`, checked."""
        key, equals, below = spec.get("where"), spec.get("equals"), spec.get("below")
        every, between = spec.get("every"), spec.get("between", False)
        if (
            not set(spec) <= {"where", "equals", "below", "every", "between"}
            or not isinstance(key, str)
            or not _CONFIG_KEY.fullmatch(key)
            or not isinstance(equals, str)
            or not 0 < len(equals) <= expr.MAX_EXPR_CHARS
            or not (below is None or (isinstance(below, int | str) and not isinstance(below, bool)))
            or not (every is None or (isinstance(every, int | str) and not isinstance(every, bool)))
            or (every is not None and below is None)
            or not isinstance(between, bool)
            or (between and every is None)
        ):
            raise CkptconvError(
                f"{where}: range of {name!r} must be {{ where = config key (a list of layer types), equals = "
                "layer type[, below = size: the list's length][, every = size, between = true or false: the "
                'types where config.json has no list; every needs below] }, e.g. { where = "layer_types", '
                'equals = "linear_attention" }'
            )
        return cls(below, None, key, equals, every, between)


@dataclass
class Scope:
    """What matching needs besides the key: config.json, the ranges, where errors point, and the mapping's
    defaults for config keys config.json lacks."""

    config: Mapping[str, Any]
    ranges: Mapping[str, Range]
    where: str
    defaults: Mapping[str, int] = field(default_factory=dict)
    _bounds: dict[str, int] = field(default_factory=dict)
    _members: dict[str, frozenset[int]] = field(default_factory=dict)

    def size(self, value: int | str) -> int:
        return expr.size(value, self.config, self.where, self.defaults)

    def bound(self, name: str) -> int | None:
        """The exclusive upper bound of placeholder `name`, None if it has no range. A range of layer types
        has none (its indices need not be contiguous): a stack over it is refused."""
        spec = self.ranges.get(name)
        if spec is None:
            return None
        if spec.where is not None:
            raise CkptconvError(
                f"{self.where}: {{{name}}} ranges over the layers whose {spec.where} is {spec.equals!r}, "
                "not 0..N-1; a stack needs a range with `below`; fix the mapping"
            )
        if name not in self._bounds:
            self._bounds[name] = self._size_of(name, spec)
        return self._bounds[name]

    def _size_of(self, name: str, spec: Range) -> int:
        assert spec.below is not None
        try:
            return self.size(spec.below)
        except expr.MissingKey:
            if spec.default is None:
                raise CkptconvError(
                    f"{self.where}: the range of {{{name}}} needs {spec.below!r} from config.json; "
                    "pass --config"
                ) from None
            return spec.default

    def members(self, name: str, spec: Range) -> frozenset[int]:
        """The indices i with config[spec.where][i] == spec.equals, the list checked once: a list of
        strings, no longer than MAX_TYPES, of length `below` where the range gives one."""
        if name not in self._members:
            assert spec.where is not None
            types = expr.lookup(self.config, spec.where)
            what = f"the range of {{{name}}} ({spec.where} == {spec.equals!r})"
            if types is None and spec.every is not None:
                self._members[name] = self._every(name, spec, what)
                return self._members[name]
            if not isinstance(types, list):
                raise CkptconvError(
                    f"{self.where}: {what} needs config.json's {spec.where!r}, a list of layer types; "
                    "pass --config with it"
                )
            if len(types) > MAX_TYPES:
                raise CkptconvError(
                    f"{self.where}: config.json's {spec.where!r} has {len(types)} entries, more than "
                    f"{MAX_TYPES}; fix the config ({what})"
                )
            bad = next((t for t in types if not isinstance(t, str)), None)
            if bad is not None:
                raise CkptconvError(
                    f"{self.where}: config.json's {spec.where!r} has an entry of type "
                    f"{type(bad).__name__}; it must be a list of layer type names ({what})"
                )
            if spec.below is not None and len(types) != (n := self._size_of(name, spec)):
                raise CkptconvError(
                    f"{self.where}: config.json's {spec.where!r} has {len(types)} entries, not {n} "
                    f"({spec.below}); fix the config ({what})"
                )
            self._members[name] = frozenset(i for i, t in enumerate(types) if t == spec.equals)
        return self._members[name]

    def _every(self, name: str, spec: Range, what: str) -> frozenset[int]:
        """The layers of the type where config.json has no list: i + 1 a multiple of `every` (or not)."""
        assert spec.every is not None
        n = self._size_of(name, spec)
        try:
            k = self.size(spec.every)
        except expr.MissingKey:
            raise CkptconvError(
                f"{self.where}: {what} needs config.json's {spec.where!r}, or {spec.every!r}; pass --config "
                "with one of them"
            ) from None
        if k < 1 or n > MAX_TYPES:
            raise CkptconvError(
                f"{self.where}: {what}: {spec.every} {k} over {n} layers gives no layer types; fix the config"
            )
        return frozenset(i for i in range(n) if ((i + 1) % k == 0) != spec.between)

    def in_range(self, name: str, value: int) -> bool:
        """Whether `value` is one of placeholder `name`'s: below its bound, or a layer of its type."""
        spec = self.ranges.get(name)
        if spec is not None and spec.where is not None:
            return value in self.members(name, spec)
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
