"""Key mappings from TOML data: `load_mapping(name or path)`, and the rule engine in `rules.py`.

File format (documented in the README):

    [mapping]
    name = "my-model"
    hf_experts = "per_expert"          # which HF expert form dcp-to-hf writes: per_expert or fused

    [[rule]]
    runtime = "layers.{layer}.attention.wq.weight"
    hf = "model.layers.{layer}.self_attn.q_proj.weight"
    permute = "q"                      # optional: rotary row permutation, heads from config.json

Presets are the TOML files in `presets/`, named by their file stem (`torchtitan-llama3`).
"""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import CkptconvError
from .rules import KeyMapping, Rule

_RULE_KEYS = {"runtime", "hf", "dim", "sizes", "stack", "permute", "drop", "tied", "when"}
VARIANTS = ("per_expert", "fused")


MAX_CONFIG_BYTES = 64 * 2**20
CONFIG_FILE = "config.json"  # beside an HF model's weights, and beside `.metadata` of a DCP hf-to-dcp mapped


def load_config(path: Path | None) -> dict[str, Any]:
    """config.json as a dict ({} when there is none); mapping rules read sizes and flags from it."""
    from ..formats.files import exists, read_regular

    if path is None or not exists(path):
        return {}
    raw = read_regular(path, limit=MAX_CONFIG_BYTES)  # a regular file only: a FIFO would block the read
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        why = str(e)[:200] or "too deeply nested"
        raise CkptconvError(f"{path}: not a readable JSON config ({why})") from None
    if not isinstance(doc, dict):
        raise CkptconvError(f"{path}: not a JSON object")
    return doc


def presets() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml")
        for p in resources.files(__package__).joinpath("presets").iterdir()
        if p.name.endswith(".toml")
    )


def load_mapping(spec: str, hf_experts: str | None = None) -> KeyMapping:
    """A preset name or a path to a TOML mapping file; `hf_experts` overrides the form dcp-to-hf writes."""
    if spec in presets():
        text = resources.files(__package__).joinpath("presets", spec + ".toml").read_text()
        where = f"--mapping {spec}"
    else:
        from ..formats.files import exists, read_regular

        path = Path(spec)
        if not exists(path):
            raise CkptconvError(
                f"--mapping {spec!r}: neither a preset ({', '.join(presets())}) nor a TOML file"
            )
        where = f"--mapping {path}"
        raw = read_regular(path, limit=MAX_CONFIG_BYTES)  # a regular file only: a FIFO would block the read
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CkptconvError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise CkptconvError(f"{where}: not valid TOML ({str(e)[:200] or 'too deeply nested'})") from None
    return _parse(doc, where, hf_experts)


def _parse(doc: dict[str, Any], where: str, hf_experts: str | None) -> KeyMapping:
    head = doc.get("mapping", {})
    rules_doc = doc.get("rule", [])
    if not isinstance(head, dict) or not isinstance(rules_doc, list) or not rules_doc:
        raise CkptconvError(f"{where}: needs a [mapping] table and at least one [[rule]]")
    form = hf_experts or head.get("hf_experts", "per_expert")
    if form not in VARIANTS:
        raise CkptconvError(f"{where}: hf_experts {form!r} is not one of {', '.join(VARIANTS)}")
    rules = []
    for i, r in enumerate(rules_doc, 1):
        rules.append(_rule(r, f"{where} rule {i}"))
    variants = tuple(sorted({r.when for r in rules if r.when}))
    return KeyMapping(str(head.get("name", where)), tuple(rules), form, variants)


def _names(value: Any, field: str, where: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise CkptconvError(f"{where}: {field!r} must be a key pattern or a list of them")
    return names


def _rule(r: Any, where: str) -> Rule:
    if not isinstance(r, dict):
        raise CkptconvError(f"{where}: not a table")
    unknown = set(r) - _RULE_KEYS
    if unknown:
        raise CkptconvError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    drop = bool(r.get("drop", False))
    if drop and ("runtime" in r) == ("hf" in r):
        raise CkptconvError(f"{where}: a drop rule names either runtime or hf keys, not both")
    runtime = () if drop and "runtime" not in r else _names(r.get("runtime"), "runtime", where)
    hf = () if drop and "hf" not in r else _names(r.get("hf"), "hf", where)
    rule = Rule(
        runtime=runtime,
        hf=hf,
        dim=int(r.get("dim", 0)),
        sizes=tuple(r.get("sizes", ())),
        stack=r.get("stack"),
        permute=r.get("permute"),
        drop=drop,
        tied=r.get("tied"),
        when=r.get("when"),
    )
    if rule.when is not None and rule.when not in VARIANTS:
        raise CkptconvError(f"{where}: when {rule.when!r} is not one of {', '.join(VARIANTS)}")
    if rule.permute not in (None, "q", "k"):
        raise CkptconvError(f"{where}: permute must be 'q' or 'k'")
    if rule.stack and (len(runtime) != 1 or len(hf) != 1 or f"{{{rule.stack}}}" not in hf[0]):
        raise CkptconvError(
            f"{where}: stack {rule.stack!r} needs one runtime key and one hf key with {{{rule.stack}}}"
        )
    if len(runtime) > 1 and len(hf) > 1:
        raise CkptconvError(f"{where}: lists on both sides; one side of a split/concat is a single key")
    return rule
