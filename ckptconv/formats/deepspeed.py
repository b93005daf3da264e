"""Where a DeepSpeed checkpoint is, and which of its weights `--deepspeed-weights` asks for; torch-free (the
CLI asks before importing torch). deepspeed_open reads the checkpoint.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from ckptconv.errors import CkptconvError
from ckptconv.formats.files import is_directory, is_regular, listdir, mode_of, read_regular

WEIGHTS = ("fp32", "module")
_WEIGHTS: ContextVar[str] = ContextVar("ckptconv_deepspeed_weights", default="fp32")
OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")


@contextmanager
def deepspeed_weights(which: str) -> Iterator[None]:
    """`--deepspeed-weights`: which weights a DeepSpeed checkpoint opened inside this block gives."""
    token = _WEIGHTS.set(which)
    try:
        yield
    finally:
        _WEIGHTS.reset(token)


def weights() -> str:
    """The `--deepspeed-weights` in force: fp32 (the master partitions) or module (the 16-bit weights)."""
    return _WEIGHTS.get()


def step_dir(path: Path) -> tuple[Path, str] | None:
    """(the tag directory, its name relative to `path` with a trailing "/" or ""), None if not DeepSpeed."""
    mode = mode_of(path)
    if mode is None or not stat.S_ISDIR(mode):
        return None
    for latest in (
        "latest",
        "latest_universal",
    ):  # the tag file engine.save_checkpoint / ds_to_universal write
        if not is_regular(path / latest):
            continue
        tag = read_regular(path / latest, path, limit=4096).decode("utf-8", "replace").strip()
        usable = tag and "/" not in tag and tag not in (".", "..") and is_directory(path / tag)
        if usable and any(MODEL.fullmatch(n) for n in listdir(path / tag)):
            return path / tag, tag + "/"
    if any(MODEL.fullmatch(n) for n in listdir(path)):
        return path, ""
    return None


def is_deepspeed_dir(path: Path) -> bool:
    """A DeepSpeed checkpoint directory: `latest` naming a tag directory with model states, or the tag
    directory itself (reads directory listings and `latest` only)."""
    try:
        return step_dir(path) is not None
    except CkptconvError:
        return False
