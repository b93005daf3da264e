"""Key mappings from TOML data: `load_mapping(name or path)`, and the rule engine in `rules.py`.

File format (every field and operation: docs/mapping.md):

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

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.documents import load_json, load_toml
from ckptconv.formats.files import CONFIG_BYTES
from ckptconv.mapping.parse import VARIANTS, parse
from ckptconv.mapping.types import KeyMapping

MAX_CONFIG_BYTES = CONFIG_BYTES  # formats/files.py holds the limits of every file read beside a checkpoint
CONFIG_FILE = "config.json"  # beside an HF model's weights, and beside `.metadata` of a DCP hf-to-dcp mapped


def load_config(path: Path | None, root: Path | None = None) -> dict[str, Any]:
    """config.json as a dict ({} when there is none); mapping rules read sizes and flags from it. One beside a
    checkpoint must resolve inside its `root` (`--config` names any file: no root)."""
    from ckptconv.formats.files import exists, read_regular

    if path is None or not exists(path):
        return {}
    raw = read_regular(path, root, limit=MAX_CONFIG_BYTES)  # a regular file only: a FIFO would block the read
    try:
        doc = load_json(raw, path)  # nesting and objects bounded as it reads (documents.py)
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


def _generated(spec: str) -> bool:
    """`transformers/<model_type>`: a preset scripts/gen_transformers_mappings.py wrote (family.py)."""
    folder, _, name = spec.partition("/")
    if folder != "transformers" or not name or "/" in name or name == "index":
        return False
    return resources.files(__package__).joinpath("presets", folder, name + ".toml").is_file()


def load_mapping(spec: str, hf_experts: str | None = None, runtime_layout: str | None = None) -> KeyMapping:
    """A preset name (`transformers/<model_type>` for the generated ones) or a path to a TOML mapping file;
    `hf_experts` overrides the form dcp-to-hf writes, `runtime_layout` (layout names, comma-separated) the
    runtime layouts hf-to-dcp writes."""
    if spec in presets() or _generated(spec):
        text = resources.files(__package__).joinpath("presets", spec + ".toml").read_text()
        where = f"--mapping {spec}"
    else:
        from ckptconv.formats.files import exists, read_regular

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
        doc = load_toml(text, where)  # nesting, dotted keys and objects bounded as it reads (documents.py)
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise CkptconvError(f"{where}: not valid TOML ({str(e)[:200] or 'too deeply nested'})") from None
    return parse(doc, where, hf_experts, runtime_layout)


__all__ = [
    "CONFIG_FILE",
    "MAX_CONFIG_BYTES",
    "VARIANTS",
    "KeyMapping",
    "load_config",
    "load_mapping",
    "presets",
]
