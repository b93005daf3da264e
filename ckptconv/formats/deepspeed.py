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
from ckptconv.formats.files import is_directory, is_regular, kind, listdir, mode_of, read_regular

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


class BadLatest(CkptconvError):
    """A `latest` tag file that names no tag directory, beside tag directories with model states: the
    checkpoint is DeepSpeed's, and which of its tags is meant cannot be told."""


def step_dir(path: Path) -> tuple[Path, str] | None:
    """(the tag directory, its name relative to `path` with a trailing "/" or ""), None if not DeepSpeed;
    `BadLatest` when `latest` names no tag directory but tag directories are there."""
    mode = mode_of(path)
    if mode is None or not stat.S_ISDIR(mode):
        return None
    problem = None
    for latest in (
        "latest",
        "latest_universal",
    ):  # the tag file engine.save_checkpoint / ds_to_universal write
        if mode_of(path / latest) is None:
            continue
        tag, wrong = _tag(path, latest)
        if tag is not None:
            return path / tag, tag + "/"
        problem = problem or (latest, wrong)
    if any(MODEL.fullmatch(n) for n in listdir(path)):
        return path, ""
    if problem is not None:
        tags = [n for n in listdir(path) if is_directory(path / n) and _has_model(path / n)]
        if tags:
            raise BadLatest(
                f"{path / problem[0]}: {problem[1]}; which tag of this DeepSpeed checkpoint is meant is "
                f"unknown; point at the tag directory (e.g. {path / tags[-1]}) or write its name into "
                f"{problem[0]}"
            )
    return None


def _tag(path: Path, latest: str) -> tuple[str | None, str]:
    """The tag `path/latest` names, if a tag directory with model states; else None and what is wrong."""
    if not is_regular(path / latest):
        return None, f"is {kind(mode_of(path / latest) or 0)} (DeepSpeed writes the tag's name into a file)"
    try:
        data = read_regular(path / latest, path, limit=4096)
    except CkptconvError as e:
        return None, str(e).removeprefix(f"{path / latest}: ")
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    shown = repr(tag) if len(tag) <= 80 else repr(tag[:77] + "...")
    if not tag or "/" in tag or "\x00" in tag or tag in (".", ".."):
        return None, f"holds {shown}, not the name of a tag directory beside it"
    if not is_directory(path / tag) or not _has_model(path / tag):
        return None, f"names {shown}, which is not a directory with *_model_states.pt beside it"
    return tag, ""


def _has_model(directory: Path) -> bool:
    return any(MODEL.fullmatch(n) for n in listdir(directory))


def is_deepspeed_dir(path: Path) -> bool:
    """A DeepSpeed checkpoint directory: `latest` naming a tag directory with model states, or the tag
    directory itself (reads directory listings and `latest` only); one whose `latest` is wrong too, so that
    opening it says what is wrong (`BadLatest`)."""
    try:
        return step_dir(path) is not None
    except BadLatest:
        return True
    except CkptconvError:
        return False
