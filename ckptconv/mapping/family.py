"""`--mapping transformers`: the generated preset of config.json's `model_type` (presets/transformers/).

transformers 5 holds some families in a runtime layout of its own (MoE experts stacked, gate and up fused:
`mlp.experts.gate_up_proj [E, 2I, H]`) and `save_pretrained` writes another
(`mlp.experts.{e}.gate_proj.weight` [I, H] per expert). scripts/gen_transformers_mappings.py writes one
preset per such model_type from transformers' own conversion mapping, and `index.toml` beside them names
the model_types whose runtime layout is what save_pretrained writes (no mapping: keys are copied as they
are) and those left out, with the reason.
The family is read from config.json, never guessed from the checkpoint's keys.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.mapping import load_mapping
from ckptconv.mapping.types import KeyMapping

TRANSFORMERS = "transformers"  # the --mapping value that picks the family from config.json
FOLDER = "transformers"  # presets/transformers/<model_type>.toml and index.toml


@cache
def index() -> dict[str, Any]:
    """index.toml: `covered` (a preset each), `identity` (no mapping needed), `not_covered` (model_type ->
    why)."""
    text = resources.files("ckptconv.mapping").joinpath("presets", FOLDER, "index.toml").read_text()
    return tomllib.loads(text)


def model_type(config: Mapping[str, Any]) -> str | None:
    """config.json's `model_type`: the top-level one (a multimodal wrapper's checkpoint holds its whole
    model, and a text-only one names its own model_type, `qwen3_5_moe_text`)."""
    value = config.get("model_type")
    return value if isinstance(value, str) and value else None


def family_spec(config: Mapping[str, Any]) -> str | None:
    """The preset `--mapping transformers` means for `config`: `transformers/<model_type>`, or None when the
    model_type's runtime layout is what save_pretrained writes. Refuses a config without a model_type and a
    model_type no preset covers (naming it and the covered ones)."""
    found = model_type(config)
    if found is None:
        raise CkptconvError(
            f"--mapping {TRANSFORMERS}: the family comes from config.json's model_type, and there is no "
            "config.json (or it has no model_type); pass --config"
        )
    table = index()
    if found in table["covered"]:
        return f"{FOLDER}/{found}"
    if found in table["identity"]:
        return None
    why = table.get("not_covered", {}).get(found)
    reason = f" ({why})" if why else ""
    raise CkptconvError(
        f"--mapping {TRANSFORMERS}: config.json's model_type {found!r} is not covered{reason}; covered: "
        f"{', '.join(table['covered'])} (and, needing no mapping, the {len(table['identity'])} model_types "
        "whose runtime layout is what save_pretrained writes: docs/mapping.md)"
    )


def covered_spec(config: Mapping[str, Any]) -> str | None:
    """The generated preset of config.json's model_type when one covers it, else None (no model_type, a
    family saved as it runs, or one not covered): never refuses."""
    found = model_type(config)
    return f"{FOLDER}/{found}" if found is not None and found in index()["covered"] else None


def mapping_for(
    spec: str | None,
    config: Mapping[str, Any],
    hf_experts: str | None = None,
    runtime_layout: str | None = None,
) -> KeyMapping | None:
    """The mapping `--mapping spec` names (None without one): `load_mapping(spec)`, and for `transformers`
    the preset of config.json's model_type (None where none is needed)."""
    if not spec:
        return None
    if spec != TRANSFORMERS:
        return load_mapping(spec, hf_experts, runtime_layout)
    name = family_spec(config)
    return None if name is None else load_mapping(name, hf_experts, runtime_layout)
