"""Non-tensor items (`step`, `args`, nested dicts) <-> `ckptconv_state.json` in an HF directory.

Each item keeps its DCP key, its nesting path, and its value: as JSON when JSON holds it exactly (ints,
finite floats, strings, bools, None, lists, dicts with string keys), otherwise as its original torch.save
bytes (base64), so a DCP -> HF -> DCP round trip loses nothing. Items that only a full
unpickler could load (custom classes) are kept as bytes and never loaded.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CkptconvError
from .outlock import write_failed

STASH_FILE = "ckptconv_state.json"
STASH_FORMAT = "ckptconv-stash"
STASH_VERSION = 1


@dataclass(frozen=True)
class StashedItem:
    key: str
    path: tuple[str | int, ...]
    raw: bytes  # torch.save bytes as stored in the DCP checkpoint (kept in the file when value is not JSON)
    value: Any = None
    has_value: bool = False  # `value` holds the item exactly as JSON
    note: str | None = None  # why the value was not loaded


def json_exact(value: Any) -> bool:
    """True when JSON round-trips `value` to an equal object of the same types."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(json_exact(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and json_exact(v) for k, v in value.items())
    return False


def to_json(items: list[StashedItem]) -> dict[str, Any]:
    out = []
    for item in items:
        entry: dict[str, Any] = {"key": item.key, "path": list(item.path)}
        if item.has_value:
            entry["value"] = item.value
        else:
            entry["type"] = type(item.value).__name__ if item.note is None else None
            entry["not_loaded"] = item.note
            entry["torch_save_b64"] = base64.b64encode(item.raw).decode()
        out.append({k: v for k, v in entry.items() if v is not None})
    return {"format": STASH_FORMAT, "version": STASH_VERSION, "items": out}


def write_stash(directory: Path, items: list[StashedItem]) -> None:
    """`ckptconv_state.json` in `directory`; a write error (disk full, permissions) names the file."""
    path = directory / STASH_FILE
    try:
        path.write_text(json.dumps(to_json(items), indent=2) + "\n")
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None


def read_stash(directory: Path) -> list[StashedItem]:
    """The items stashed in `directory`, [] when there is no stash file."""
    from .formats.files import read_regular
    from .formats.hf import checkpoint_root

    path = directory / STASH_FILE
    if not path.exists() and not path.is_symlink():
        return []
    raw = read_regular(path, checkpoint_root(directory))  # a FIFO or a link out of the checkpoint: refused
    try:
        doc = json.loads(raw)
        if doc.get("format") != STASH_FORMAT or doc.get("version") != STASH_VERSION:
            raise ValueError("unknown format or version")
        return [
            StashedItem(
                key=str(e["key"]),
                path=tuple(e["path"]),
                raw=base64.b64decode(e.get("torch_save_b64", "")),
                value=e.get("value"),
                has_value="value" in e,
                note=e.get("not_loaded"),
            )
            for e in doc["items"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CkptconvError(f"{path}: not a readable ckptconv stash ({e}); delete or fix it") from None
