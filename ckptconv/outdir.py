"""Atomic output directories: write into a hidden staging directory beside OUT, rename it at the end.

While a conversion runs nothing at OUT changes, so OUT never looks finished before it is; an interrupted run
leaves only `.OUT.ckptconv-partial` beside it, which the next run replaces. Rank 0 owns every step here;
the other ranks only write files inside `staging`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .errors import CkptconvError

PARTIAL_SUFFIX = ".ckptconv-partial"
OLD_SUFFIX = ".ckptconv-old"


def staging_dir(out: Path) -> Path:
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def refuse_partial(path: Path) -> None:
    """A directory an interrupted ckptconv run left behind is not a checkpoint, whatever it holds."""
    for part in (path, *path.parents):
        if part.name.endswith((PARTIAL_SUFFIX, OLD_SUFFIX)):
            raise CkptconvError(
                f"{path}: is the unfinished output of an interrupted ckptconv run ({part.name}), not a "
                "checkpoint; rerun the conversion that made it"
            )


def check_out(out: Path, overwrite: bool, flag_hint: str = "--overwrite") -> None:
    """Refuse an OUT that is a file, or a non-empty directory without `overwrite`. Pure checks, no writes."""
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise CkptconvError(f"{out}: exists and is not a directory; choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CkptconvError(f"{out}: exists and is not empty; pass {flag_hint} to replace it")


def prepare(out: Path) -> Path:
    """Rank 0: an empty staging directory for `out` (a stale one from a killed run is removed)."""
    staging = staging_dir(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    except OSError as e:
        raise CkptconvError(
            f"{staging}: cannot create ({e.strerror}); check permissions and free space"
        ) from None
    return staging


def publish(staging: Path, out: Path) -> None:
    """Rank 0: move the finished `staging` to `out`, replacing what was there (checked by `check_out`)."""
    old = out.parent / f".{out.name}{OLD_SUFFIX}"
    try:
        if old.exists():
            shutil.rmtree(old)
        if out.exists():
            out.rename(old)
        staging.rename(out)
        if old.exists():
            shutil.rmtree(old)
    except OSError as e:
        raise CkptconvError(f"{out}: cannot move the result into place ({e.strerror})") from None


def discard(out: Path) -> None:
    """Rank 0: remove the staging directory of `out` after a failure."""
    shutil.rmtree(staging_dir(out), ignore_errors=True)


def copy_non_weights(src: Path, dst: Path) -> list[str]:
    """Copy config, tokenizer and other non-weight files of an HF directory; return the names copied."""
    if not src.is_dir():
        raise CkptconvError(f"--copy-from {src}: not a directory")
    copied = []
    for entry in sorted(src.iterdir()):
        if entry.name.startswith(".") or _is_weight_file(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name)
        else:
            shutil.copy2(entry, dst / entry.name)
        copied.append(entry.name)
    return copied


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp")


def _is_weight_file(name: str) -> bool:
    from .stash import STASH_FILE

    return (
        name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json") or name in (STASH_FILE, ".metadata")
    )
