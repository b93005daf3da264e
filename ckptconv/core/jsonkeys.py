"""JSON objects that name a key twice: `json.loads` keeps the last value silently, another reader may keep the
first, so a file two programs could read differently is refused (as safetensors headers are, `formats.hf`).
`unique` is the `object_pairs_hook` that checks it (`documents.load_json` uses it); its error is a ValueError,
which every reader reports in one line."""

from __future__ import annotations

from typing import Any


class DuplicateKey(ValueError):
    """A JSON object names a key twice."""


def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` for `json.loads`: the object, or DuplicateKey naming the key it repeats."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out

