"""Names a checkpoint directory may hold, and the names ckptconv reserves for its own staging (pure rules
on names, shared by the local and the object-storage publisher)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ckptconv.errors import CkptconvError

PARTIAL_SUFFIX = ".ckptconv-partial"  # a run's staging directory, beside OUT
OLD_SUFFIX = ".ckptconv-old"  # the result an --overwrite replaces, until the new one is in place


def refuse_partial(path: Path) -> None:
    """A directory an interrupted ckptconv run left behind is not a checkpoint, whatever it holds."""
    for part in (path, *path.parents):
        if part.name.endswith((PARTIAL_SUFFIX, OLD_SUFFIX)):
            raise CkptconvError(
                f"{path}: is the unfinished output of an interrupted ckptconv run ({part.name}), not a "
                "checkpoint; rerun the conversion that made it"
            )


_CHECKPOINT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".distcp")


# what `--copy-from` copies out of an HF model directory: config, generation config, tokenizer, card
_MODEL_FILE_SUFFIXES = (".json", ".txt", ".model", ".md", ".jinja", ".tiktoken")


_MODEL_FILE_NAMES = ("LICENSE", "NOTICE")


def not_a_checkpoint(entries: Sequence[tuple[str, str, bool]]) -> list[str]:
    """Of the entries (name, how it is shown, whether it is a regular file) of a non-empty OUT, those that
    make it something other than a checkpoint ckptconv may replace: everything when nothing marks a
    checkpoint (weights, index, stash, `.metadata`); otherwise any entry that is not a regular file (a
    subdirectory or prefix, a link: `name/`, `name@`) or not one a checkpoint or an HF model directory holds
    (hidden ones but `.metadata`, code, logs). Pure: a directory's entries or a prefix's objects."""
    if not any(_checkpoint_file(name) for name, _, _ in entries):
        return [shown for _, shown, _ in entries]
    return [
        shown
        for name, shown, regular in entries
        if not regular or not (_checkpoint_file(name) or _model_file(name))
    ]


def _checkpoint_file(name: str) -> bool:
    """A file only a checkpoint holds: weights, an index, a stash, `.metadata`."""
    from ckptconv.formats.stash import STASH_FILE

    return name.endswith(_CHECKPOINT_SUFFIXES) or name in (STASH_FILE, ".metadata")


def _model_file(name: str) -> bool:
    """A non-weight file of an HF model directory (`--copy-from` copies it into OUT)."""
    return not name.startswith(".") and (name.endswith(_MODEL_FILE_SUFFIXES) or name in _MODEL_FILE_NAMES)
