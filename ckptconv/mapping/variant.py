"""Which HF form of a mapping's variant rules (`when = "per_expert" | "fused"`) a reference model's keys are
in: dcp-to-hf writes that form when no `--hf-experts` names one. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ckptconv.mapping.patterns import Pattern, Scope
from ckptconv.mapping.types import KeyMapping


def variants_in(mapping: KeyMapping, hf_keys: Iterable[str], scope: Scope) -> list[str]:
    """The mapping's variants (in its order) whose HF key patterns some of `hf_keys` match."""
    keys = list(hf_keys)
    found = []
    for variant in mapping.variants:
        patterns = [Pattern(p) for r in mapping.rules if r.when == variant for p in r.hf]
        if any(p.match(key, scope) is not None for p in patterns for key in keys):
            found.append(variant)
    return found


def hf_variant(mapping: KeyMapping, hf_keys: Iterable[str], config: Mapping[str, Any]) -> str | None:
    """The variant whose HF key patterns some of `hf_keys` match, when exactly one does (None: the keys
    match none of them, or several, or the mapping has no variants)."""
    if not mapping.variants:
        return None
    scope = Scope(config, dict(mapping.ranges), "--mapping", dict(mapping.defaults))
    found = variants_in(mapping, hf_keys, scope)
    return found[0] if len(found) == 1 else None
