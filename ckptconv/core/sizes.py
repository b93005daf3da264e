"""Sizes given on the command line ("5GB", "128MB", a number of bytes); no torch, so flags are checked
before anything imports it."""

from __future__ import annotations

from ckptconv.errors import CkptconvError


def parse_size(value: str | int, flag: str = "--max-shard-size") -> int:
    """Bytes from HF notation ("500MB", "5GB": powers of ten, as huggingface_hub parses them) or a number."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(value, int):
        size = value
    else:
        text = value.strip()
        try:
            size = int(text) if text.isdigit() else parse_size_to_int(text)
        except ValueError:
            raise CkptconvError(
                f"{flag} {value!r}: not a size; use bytes or a number with KB, MB, GB or TB"
            ) from None
    if size <= 0:
        raise CkptconvError(f"{flag} {value!r}: must be positive")
    return size
