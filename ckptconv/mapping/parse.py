"""A mapping file (TOML, already decoded) -> `KeyMapping`, every field checked with a message naming the rule.

Fields of a [[rule]] are described in docs/mapping.md; [mapping] holds `name`, `hf_experts`, `checkpoint`
(what hf-to-dcp writes: "dcp", or "megatron" for a Megatron-Core checkpoint), the `[mapping.ranges]` table
(`layer = "num_hidden_layers"`, `mtp = { below = "...", default = 0 }`) and the `[mapping.defaults]` table
(`make_vocab_size_divisible_by = 128`: a config key's value when config.json lacks it), and the
`[[mapping.layouts]]` a trainer has stored its keys in (see `layouts.py`).
"""

from __future__ import annotations

import math
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.mapping.layouts import parse_layouts
from ckptconv.mapping.patterns import Pattern, Range
from ckptconv.mapping.types import KeyMapping, Rule

VARIANTS = ("per_expert", "fused")
CHECKPOINTS = ("dcp", "megatron")
_HEAD = {"name", "hf_experts", "checkpoint", "ranges", "defaults", "layouts"}
_SIZE = (int, str)
_FIELDS = {
    "runtime", "hf", "dim", "sizes", "stack", "stack_dim", "permute", "heads", "drop", "tied", "when",
    "transpose", "interleave", "groups", "narrow", "padded", "multiple", "hf_shape", "runtime_shape",
    "duplicate", "layout", "ndim", "unbind", "hf_groups", "offset",
}  # fmt: skip


def parse(
    doc: dict[str, Any], where: str, hf_experts: str | None, runtime_layout: str | None = None
) -> KeyMapping:
    """The mapping `doc` holds; `hf_experts` and `runtime_layout` (comma-separated layout names) override
    what dcp-to-hf and hf-to-dcp write."""
    head = doc.get("mapping", {})
    rules_doc = doc.get("rule", [])
    if not isinstance(head, dict) or not isinstance(rules_doc, list) or not rules_doc:
        raise CkptconvError(f"{where}: needs a [mapping] table and at least one [[rule]]")
    unknown = set(head) - _HEAD
    if unknown:
        raise CkptconvError(f"{where}: unknown [mapping] field(s) {', '.join(sorted(unknown))}")
    form = hf_experts or head.get("hf_experts", "per_expert")
    if form not in VARIANTS:
        raise CkptconvError(f"{where}: hf_experts {form!r} is not one of {', '.join(VARIANTS)}")
    checkpoint = head.get("checkpoint", "dcp")
    if checkpoint not in CHECKPOINTS:
        raise CkptconvError(f"{where}: checkpoint {checkpoint!r} is not one of {', '.join(CHECKPOINTS)}")
    ranges = _ranges(head.get("ranges", {}), where)
    defaults = _defaults(head.get("defaults", {}), where)
    layouts, chosen = parse_layouts(head.get("layouts", []), where, runtime_layout)
    rules = tuple(_rule(r, f"{where} rule {i}", i) for i, r in enumerate(rules_doc, 1))
    group_of = {layout.name: layout.group for layout in layouts}
    for rule in rules:
        groups: dict[str, str] = {}
        for name in rule.layout or ():
            if name not in group_of:
                listed = ", ".join(sorted(group_of)) or "none declared"
                raise CkptconvError(
                    f"{where} rule {rule.number}: layout {name!r} is not a [[mapping.layouts]] name "
                    f"({listed})"
                )
            other = groups.setdefault(group_of[name], name)
            if other != name:
                raise CkptconvError(
                    f"{where} rule {rule.number}: layouts {other!r} and {name!r} are both of group "
                    f"{group_of[name]!r}; a checkpoint holds one layout of each group (name one)"
                )
    variants = tuple(sorted({r.when for r in rules if r.when}))
    name = str(head.get("name", where))
    return KeyMapping(name, rules, form, variants, ranges, defaults, checkpoint, layouts, chosen)


def _defaults(table: Any, where: str) -> tuple[tuple[str, int], ...]:
    """[mapping.defaults]: config key (dotted for a nested one) -> the integer size expressions use when
    config.json lacks that key."""
    if not isinstance(table, dict):
        raise CkptconvError(f"{where}: [mapping.defaults] must be a table of config key = integer")
    out = []
    for name, value in _flatten(table, ""):
        if type(value) is not int:
            raise CkptconvError(f"{where}: default of {name!r} must be an integer")
        out.append((name, value))
    return tuple(out)


def _flatten(table: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """A (possibly nested, or dotted-key) TOML table as (dotted key, value) pairs."""
    out: list[tuple[str, Any]] = []
    for name, value in table.items():
        key = f"{prefix}{name}"
        out += _flatten(value, key + ".") if isinstance(value, dict) else [(key, value)]
    return out


def _ranges(table: Any, where: str) -> tuple[tuple[str, Range], ...]:
    """[mapping.ranges]: placeholder -> a size, `{ below = size, default = integer }`, or the layers of one
    type, `{ where = "layer_types", equals = "linear_attention" }` (`Range.of_type`)."""
    if not isinstance(table, dict):
        raise CkptconvError(f"{where}: [mapping.ranges] must be a table of placeholder = size")
    out = []
    for name, spec in table.items():
        if isinstance(spec, dict) and ("where" in spec or "equals" in spec):
            out.append((str(name), Range.of_type(str(name), spec, where)))
            continue
        if isinstance(spec, dict) and set(spec) <= {"below", "default"} and "below" in spec:
            below, default = spec["below"], spec.get("default")
        else:
            below, default = spec, None
        if (
            not isinstance(below, _SIZE)
            or isinstance(below, bool)
            or not (default is None or type(default) is int)
        ):
            raise CkptconvError(
                f"{where}: range of {name!r} must be a size, {{ below = size, default = integer }} or "
                '{ where = "layer_types", equals = "<layer type>" }'
            )
        out.append((str(name), Range(below, default)))
    return tuple(out)


def _names(value: Any, field: str, where: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise CkptconvError(f"{where}: {field!r} must be a key pattern or a list of them")
    for n in names:
        Pattern(n).check(where)
    return names


def _int(r: dict[str, Any], key: str, where: str, default: int | None = None) -> int | None:
    value = r.get(key, default)
    if value is not None and (type(value) is not int or value < 0):
        raise CkptconvError(f"{where}: {key} must be a non-negative integer")
    return value


def _size(r: dict[str, Any], key: str, where: str) -> int | str | None:
    value = r.get(key)
    if value is not None and (not isinstance(value, _SIZE) or isinstance(value, bool)):
        raise CkptconvError(f"{where}: {key} must be an integer or an expression of config.json keys")
    return value


def _shape(r: dict[str, Any], key: str, where: str) -> tuple[int | str, ...] | None:
    value = r.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(d, _SIZE) for d in value):
        raise CkptconvError(f"{where}: {key} must be a list of sizes (one may be -1)")
    return tuple(value)


def _stack(r: dict[str, Any], where: str) -> str | tuple[str, ...] | None:
    """One placeholder, or a list of them (stacked on consecutive dims, in order)."""
    value = r.get("stack")
    if value is None or isinstance(value, str):
        return value
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, str) for v in value)
        or len(set(value)) != len(value)
    ):
        raise CkptconvError(f"{where}: stack must be a placeholder or a list of different placeholders")
    return value[0] if len(value) == 1 else tuple(value)


def _rule(r: Any, where: str, number: int) -> Rule:
    if not isinstance(r, dict):
        raise CkptconvError(f"{where}: not a table")
    unknown = set(r) - _FIELDS
    if unknown:
        raise CkptconvError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    drop = r.get("drop", False) is True
    if drop and ("runtime" in r) == ("hf" in r):
        raise CkptconvError(f"{where}: a drop rule names either runtime or hf keys, not both")
    runtime = () if drop and "runtime" not in r else _names(r.get("runtime"), "runtime", where)
    hf = () if drop and "hf" not in r else _names(r.get("hf"), "hf", where)
    transpose = r.get("transpose")
    if transpose is not None and (
        not isinstance(transpose, list)
        or len(transpose) != 2
        or not all(type(d) is int and d >= 0 for d in transpose)
        or transpose[0] == transpose[1]
    ):
        raise CkptconvError(f"{where}: transpose must be two different dims, e.g. [1, 2]")
    sizes = r.get("sizes", [])
    if not isinstance(sizes, list) or not all(isinstance(s, _SIZE) for s in sizes):
        raise CkptconvError(f"{where}: sizes must be a list of integers or config.json expressions")
    for flag in ("interleave", "unbind"):
        if not isinstance(r.get(flag, False), bool):
            raise CkptconvError(f"{where}: {flag} must be true or false")
    duplicate = r.get("duplicate", False)
    if not isinstance(duplicate, bool) and duplicate != "reference":
        raise CkptconvError(
            f'{where}: duplicate must be true, false or "reference" (copies written only where the '
            "reference holds them)"
        )
    layout = r.get("layout")
    if isinstance(layout, str):
        layout = [layout]
    if layout is not None and (
        not isinstance(layout, list)
        or not layout
        or not all(isinstance(n, str) for n in layout)
        or len(set(layout)) != len(layout)
    ):
        raise CkptconvError(
            f"{where}: layout must be the name of a [[mapping.layouts]] entry, or a list of different names "
            "(the rule applies when all of them are in effect)"
        )
    offset = r.get("offset")
    if offset is not None and (
        isinstance(offset, bool) or not isinstance(offset, int | float) or not math.isfinite(offset)
    ):
        raise CkptconvError(f"{where}: offset must be a finite number (HF value = runtime value + offset)")
    ndim = _int(r, "ndim", where)
    if ndim is not None and (ndim < 1 or "layout" not in r):
        raise CkptconvError(f"{where}: ndim must be at least 1, on a rule with a layout")
    rule = Rule(
        runtime=runtime,
        hf=hf,
        dim=_int(r, "dim", where, 0) or 0,
        sizes=tuple(sizes),
        stack=_stack(r, where),
        permute=r.get("permute"),
        drop=drop,
        tied=r.get("tied"),
        when=r.get("when"),
        stack_dim=_int(r, "stack_dim", where),
        heads=_size(r, "heads", where),
        transpose=None if transpose is None else (transpose[0], transpose[1]),
        interleave=r.get("interleave", False),
        groups=_size(r, "groups", where),
        narrow=_size(r, "narrow", where),
        padded=_size(r, "padded", where),
        multiple=_size(r, "multiple", where),
        hf_shape=_shape(r, "hf_shape", where),
        runtime_shape=_shape(r, "runtime_shape", where),
        duplicate=duplicate is not False,
        reference_copies=duplicate == "reference",
        layout=None if layout is None else tuple(layout),
        ndim=ndim,
        unbind=r.get("unbind", False),
        hf_groups=_size(r, "hf_groups", where),
        offset=None if offset is None else float(offset),
        number=number,
    )
    if rule.stack is not None and rule.stack_dim is None and "dim" in r and max(len(runtime), len(hf)) == 1:
        rule = Rule(**{**rule.__dict__, "stack_dim": rule.dim})  # a stack-only rule: `dim` is the stack dim
    _check(rule, where)
    return rule


def _check(rule: Rule, where: str) -> None:
    runtime, hf = rule.runtime, rule.hf
    listed = max(len(runtime), len(hf)) > 1
    if rule.when is not None and rule.when not in VARIANTS:
        raise CkptconvError(f"{where}: when {rule.when!r} is not one of {', '.join(VARIANTS)}")
    if rule.tied is not None and not isinstance(rule.tied, str):
        raise CkptconvError(f"{where}: tied must be an HF key pattern")
    if len(runtime) > 1 and len(hf) > 1:
        raise CkptconvError(f"{where}: lists on both sides; one side of a split/concat is a single key")
    if rule.permute not in (None, "q", "k"):
        raise CkptconvError(f"{where}: permute must be 'q' or 'k'")
    plain = not (listed or rule.stack or rule.transpose or rule.narrow is not None or rule.hf_shape)
    if rule.permute and not plain:
        raise CkptconvError(
            f"{where}: permute applies to a rename only (one key each side, no other operation)"
        )
    for name in rule.stacks:
        slot = f"{{{name}}}"
        if len(runtime) != 1 or name in Pattern(runtime[0]).placeholders:
            raise CkptconvError(f"{where}: stack needs one runtime key (the stacked tensor) without {slot}")
        if not all(name in Pattern(p).placeholders for p in hf):
            raise CkptconvError(f"{where}: stack {name!r} needs {slot} in every hf key")
    if rule.duplicate and (len(runtime) != 1 or len(hf) < 2 or rule.sizes or rule.groups or rule.interleave):
        raise CkptconvError(f"{where}: duplicate needs one runtime key and a list of hf keys it is copied to")
    splits = [f for f in ("interleave", "groups", "sizes", "unbind") if getattr(rule, f)]
    if splits and (not listed or rule.duplicate):
        raise CkptconvError(f"{where}: {splits[0]} needs a list of keys on one side")
    if rule.interleave and (rule.groups is not None or rule.sizes):
        raise CkptconvError(f"{where}: interleave splits equally; drop groups and sizes")
    if rule.unbind and (rule.interleave or rule.groups is not None or rule.sizes or rule.transpose):
        raise CkptconvError(f"{where}: unbind takes one slice of dim per key; drop the other split fields")
    narrowed_copies = rule.duplicate and rule.hf_shape is None  # each copy narrowed alike
    if (rule.narrow is not None or rule.hf_shape is not None) and (
        len(runtime) != 1 or (listed and not narrowed_copies)
    ):
        raise CkptconvError(f"{where}: narrow and hf_shape need one runtime key and one hf key")
    if rule.hf_shape is not None and rule.transpose:
        raise CkptconvError(f"{where}: hf_shape and transpose cannot be combined in one rule")
    if rule.runtime_shape is not None and rule.hf_shape is None:
        raise CkptconvError(f"{where}: runtime_shape goes with hf_shape")
    if (rule.padded is not None or rule.multiple is not None) and rule.narrow is None:
        raise CkptconvError(f"{where}: padded and multiple go with narrow")
    _check_repeated(rule, where)
    if rule.offset is not None and (len(runtime) != 1 or len(hf) != 1 or rule.tied is not None):
        raise CkptconvError(f"{where}: offset needs one runtime key and one hf key (and no tied)")


def _check_repeated(rule: Rule, where: str) -> None:
    """A key named twice: only in the hf list, of a split of one runtime tensor; `hf_groups` only then."""
    repeated = next((k for i, k in enumerate(rule.runtime) if k in rule.runtime[:i]), None)
    if repeated is not None:
        raise CkptconvError(f"{where}: runtime names {repeated!r} twice; only an hf key may repeat")
    if rule.repeated and (len(rule.runtime) != 1 or rule.duplicate or rule.unbind or rule.interleave):
        raise CkptconvError(
            f"{where}: an hf key named twice is a concatenation of pieces of one runtime key, cut by a plain "
            "or grouped split (not duplicate, unbind or interleave)"
        )
    if rule.hf_groups is not None and not rule.repeated:
        raise CkptconvError(f"{where}: hf_groups lays out an hf key named more than once; none is")
    if isinstance(rule.hf_groups, int) and rule.hf_groups < 1:
        raise CkptconvError(f"{where}: hf_groups must be at least 1")
