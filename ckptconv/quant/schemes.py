"""The `--quantize` schemes by name, without torch: the flag is checked before anything imports it."""

from __future__ import annotations

from ckptconv.errors import CkptconvError

SCHEMES = ("fp8",)


def check_scheme(scheme: str) -> str:
    """`scheme` when ckptconv writes it; refused with one line otherwise."""
    if scheme not in SCHEMES:
        raise CkptconvError(f"--quantize {scheme!r} is not one of {', '.join(SCHEMES)}")
    return scheme
