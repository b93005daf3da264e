"""Keys and names in the model's order (no torch: the command line sorts checkpoint directories with it before
anything imports torch)."""

from __future__ import annotations

import re


def natural_key(key: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts `layers.2` before `layers.10`: shards then follow the model's layer order."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", key))
