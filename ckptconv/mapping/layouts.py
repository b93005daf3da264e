"""Runtime layouts: the ways a trainer has stored one family of keys, and which one a checkpoint holds. Pure.

A mapping declares them in `[[mapping.layouts]]` (name, description, group, default) and tags the rules of
each with `layout = NAME` (or `layout = [NAME, ...]`, layouts of different groups: the rule applies when all
of them are in effect, and a key it matches shows each of them); untagged rules apply to every layout. To HF
the layout of each group is read off the source's keys and shapes (a rule's `ndim` tells apart layouts whose
key names collide: torchtitan's `feed_forward.w13.weight` is `[2F, D]` interleaved or `[2, F, D]` stacked),
from the global metadata alone, so every rank picks the same. A key that fits a tagged rule's pattern but none
of its group's layouts, or a source holding two layouts of one group, is refused naming the key, its shape and
the layouts known. To runtime, each group's default is written unless `--runtime-layout` names another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.mapping.patterns import Pattern, Scope
from ckptconv.mapping.types import KeyMapping, Layout, Rule

_FIELDS = {"name", "description", "group", "default"}


def parse_layouts(
    entries: Any, where: str, runtime_layout: str | None
) -> tuple[tuple[Layout, ...], tuple[str, ...]]:
    """`[[mapping.layouts]]` checked (names unique, one default per group), and the comma-separated names of
    `runtime_layout` checked against them (at most one per group)."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CkptconvError(f"{where}: [[mapping.layouts]] must be a list of tables")
    layouts = []
    for i, entry in enumerate(entries, 1):
        at = f"{where}: [[mapping.layouts]] {i}"
        unknown = set(entry) - _FIELDS
        if unknown:
            raise CkptconvError(f"{at}: unknown field(s) {', '.join(sorted(unknown))}")
        name, text, group = entry.get("name"), entry.get("description", ""), entry.get("group", "runtime")
        if not all(isinstance(v, str) for v in (name, text, group)) or not name or not group:
            raise CkptconvError(f"{at}: name, description and group must be strings (name, group not empty)")
        if not isinstance(entry.get("default", False), bool):
            raise CkptconvError(f"{at}: default must be true or false")
        layouts.append(Layout(name, text, group, entry.get("default", False)))
    names = [layout.name for layout in layouts]
    if len(set(names)) != len(names):
        raise CkptconvError(f"{where}: [[mapping.layouts]] names a layout twice")
    for group in dict.fromkeys(layout.group for layout in layouts):
        defaults = [layout.name for layout in layouts if layout.group == group and layout.default]
        if len(defaults) != 1:
            raise CkptconvError(f"{where}: layout group {group!r} needs exactly one default = true")
    return tuple(layouts), _chosen(layouts, runtime_layout, where)


def _chosen(layouts: list[Layout], spec: str | None, where: str) -> tuple[str, ...]:
    """The layout names `--runtime-layout` gives, each known, at most one per group."""
    if spec is None:
        return ()
    by_name = {layout.name: layout for layout in layouts}
    names = [n.strip() for n in spec.split(",")]
    known = ", ".join(by_name) or "none: it has one layout"
    groups: dict[str, str] = {}
    for name in names:
        if name not in by_name:
            raise CkptconvError(f"--runtime-layout {name!r}: not a layout of {where} (known: {known})")
        group = by_name[name].group
        if group in groups:
            raise CkptconvError(
                f"--runtime-layout: {groups[group]!r} and {name!r} are both layouts of {group!r}; name one"
            )
        groups[group] = name
    return tuple(names)


def _fits(rule: Rule, shape: tuple[int, ...]) -> bool:
    return rule.ndim is None or len(shape) == rule.ndim


def _known(mapping: KeyMapping, group: str) -> str:
    return "; ".join(
        f"{layout.name} ({layout.description})" if layout.description else layout.name
        for layout in mapping.layouts
        if layout.group == group
    )


def detect(mapping: KeyMapping, shapes: Mapping[str, tuple[int, ...]], scope: Scope) -> dict[str, str]:
    """Group -> the runtime layout the source (runtime keys and their global shapes) holds; a group none of
    whose keys the source has takes its default. Refuses a key no layout of its group fits, and a source
    holding two layouts of one group."""
    where = f"{scope.where} {mapping.name}"
    group_of = {layout.name: layout.group for layout in mapping.layouts}
    chosen = {layout.group: layout.name for layout in mapping.layouts if layout.default}
    found: dict[str, dict[str, str]] = {}  # group -> layout -> its first key in the source
    misfit: dict[str, str] = {}  # key -> group: a tagged rule's pattern took it, its shape no layout's
    fitted: set[str] = set()
    for rule in mapping.rules:
        for pattern in rule.runtime if rule.layout else ():
            compiled = Pattern(pattern)
            for key, shape in shapes.items():
                if compiled.match(key, scope) is None:
                    continue
                fits = _fits(rule, shape)
                if fits:
                    fitted.add(key)
                for name in rule.layout or ():  # a key of a rule of several layouts shows each of them
                    if fits:
                        found.setdefault(group_of[name], {}).setdefault(name, key)
                    else:
                        misfit.setdefault(key, group_of[name])
    for key, group in misfit.items():
        if key not in fitted:
            raise CkptconvError(
                f"{where}: {key!r} {list(shapes[key])} fits none of the runtime layouts of {group} it "
                f"knows: {_known(mapping, group)}; add the checkpoint's layout to the mapping"
            )
    for group, layouts in found.items():
        if len(layouts) > 1:
            (a, ka), (b, kb) = list(layouts.items())[:2]
            raise CkptconvError(
                f"{where}: the checkpoint mixes runtime layouts of {group}: {ka!r} "
                f"{list(shapes[ka])} is {a}, {kb!r} {list(shapes[kb])} is {b}; one checkpoint holds one "
                f"layout (known: {_known(mapping, group)})"
            )
        chosen[group] = next(iter(layouts))
    return chosen


__all__ = ["detect", "parse_layouts"]
