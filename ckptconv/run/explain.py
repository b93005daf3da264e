"""`inspect SRC --mapping M --explain KEY`: which rule and operation made a key, and from which blocks.

KEY may be a key the mapping makes (an HF key of a DCP, a runtime key of an HF model) or a key SRC holds;
the answer names the rule (its number in the mapping file and its fields), the operations it applied, and
for every part the source block, its steps and reordered dims, and where it lands: enough to debug a TOML
written for another trainer.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

from rich.console import Console

from ckptconv.errors import CkptconvError
from ckptconv.mapping.parts import Part
from ckptconv.mapping.rules import KeyMapping, Rule, Target


def explain(mapping: KeyMapping, targets: list[Target], key: str) -> dict[str, Any]:
    """The targets named `key`, or made from the source key `key`, each with its rule and parts."""
    chosen = [t for t in targets if t.key == key] or [t for t in targets if key in t.sources]
    if not chosen:
        known = [t.key for t in targets] + [s for t in targets for s in t.sources]
        near = difflib.get_close_matches(key, known, n=3)
        hint = f"; close: {', '.join(near)}" if near else "; see the mapped keys without --explain"
        raise CkptconvError(f"--explain {key!r}: no such key in the checkpoint or its mapped view{hint}")
    rules = {r.number: r for r in mapping.rules}
    return {
        "key": key,
        "mapping": mapping.name,
        "targets": [_target(t, rules.get(t.rule or 0)) for t in chosen],
    }


def _target(t: Target, rule: Rule | None) -> dict[str, Any]:
    return {
        "key": t.key,
        "shape": list(t.shape),
        "layout": list(t.layout) if t.layout else None,
        "op": t.op,
        "padded_with_zeros": t.padded,
        "rule": None if rule is None else {"number": rule.number, **_fields(rule)},
        "parts": [_part(p) for p in t.parts],
    }


def _fields(rule: Rule) -> dict[str, Any]:
    """The rule's fields as written (those that differ from their defaults)."""
    out: dict[str, Any] = {}
    for f in fields(rule):
        value = getattr(rule, f.name)
        if f.name == "number" or value == f.default:
            continue
        out[f.name] = list(value) if isinstance(value, tuple) and f.name not in ("runtime", "hf") else value
        if f.name in ("runtime", "hf"):
            out[f.name] = value[0] if len(value) == 1 else list(value)
    return out


def _part(p: Part) -> dict[str, Any]:
    return {
        "source": p.src,
        "from": _block(p.src_offsets, p.src_sizes, p.src_steps),
        "to": _block(p.dst_offsets, p.dst_sizes, p.dst_steps),
        "dims": list(p.axes) if p.axes else None,
        "row_permutation": p.perm is not None,
    }


def _block(offsets: tuple[int, ...], sizes: tuple[int, ...], steps: tuple[int, ...] | None) -> str:
    """`[0:4, 2:10:2]`: start:stop(:step) per dim, as Python slicing reads it."""
    cells = []
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        step = steps[d] if steps else 1
        stop = o + (n - 1) * step + 1 if n else o
        cells.append(f"{o}:{stop}" + (f":{step}" if step != 1 else ""))
    return "[" + ", ".join(cells) + "]"


def render_explain(doc: dict[str, Any], console: Console) -> None:
    for t in doc["targets"]:
        layout = f" (laid out as {t['layout']})" if t["layout"] else ""
        console.print(f"{t['key']} {t['shape']}{layout}: {t['op']}", markup=False)
        rule = t["rule"]
        if rule is None:
            console.print("  passed through unmapped (--allow-unmapped)", markup=False)
        else:
            console.print(f"  rule {rule['number']} of {doc['mapping']}:", markup=False)
            for name, value in rule.items():
                if name != "number":
                    console.print(f"    {name} = {value!r}", markup=False)
        if t["padded_with_zeros"]:
            console.print("  elements no part covers are zeros (padding)", markup=False)
        for p in t["parts"]:
            extra = f", dims {p['dims']}" if p["dims"] else ""
            extra += ", rows permuted (rotary)" if p["row_permutation"] else ""
            console.print(f"  {p['source']}{p['from']} -> {p['to']}{extra}", markup=False)
