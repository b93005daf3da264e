"""`--copy-from DIR`: config, tokenizer and the other non-weight files of an HF directory, copied into OUT.

Only what is the source's own is copied: regular files and directories inside DIR (a huggingface_hub cache
snapshot's links into its repo's `blobs/` included, as `formats.hf.checkpoint_root` allows), never a FIFO,
device or socket, never a symlink leading out of it. Weights, indexes, stashes and hidden files stay behind.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import CkptconvError
from .formats.files import inside, open_regular, read_error
from .formats.hf import checkpoint_root
from .outlock import write_failed

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp")


def copy_non_weights(src: Path, dst: Path) -> list[str]:
    """Copy the non-weight files and directories of `src` into `dst`; return the names copied."""
    if not src.is_dir():
        raise CkptconvError(f"--copy-from {src}: not a directory")
    root = checkpoint_root(src)
    copied = []
    for name in sorted(_listdir(src)):
        if name.startswith(".") or is_weight_file(name):
            continue
        _copy(src / name, dst / name, root)
        copied.append(name)
    return copied


def is_weight_file(name: str) -> bool:
    """Weights and what describes them (index, stash, DCP metadata): never copied from --copy-from."""
    from .stash import STASH_FILE

    return (
        name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json") or name in (STASH_FILE, ".metadata")
    )


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError as e:
        raise read_error(directory, e) from None


def _copy(path: Path, target: Path, root: Path) -> None:
    """`path` (a regular file, or a directory copied entry by entry) to `target`; the rest is refused."""
    real = inside(path, root)
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        raise read_error(path, e) from None
    if stat.S_ISDIR(mode):
        try:
            target.mkdir()
        except OSError as e:
            raise write_failed(target, e) from None
        for name in sorted(_listdir(path)):
            _copy(path / name, target / name, root)
        return
    fd = open_regular(path, root)  # a FIFO, device or socket is refused here, naming it
    with os.fdopen(fd, "rb") as source:
        try:
            with open(target, "wb") as out:
                while chunk := _read(source, path):
                    out.write(chunk)
        except OSError as e:  # creating, writing or closing (flushing) the copy
            raise write_failed(target, e) from None


def _read(source: BinaryIO, path: Path) -> bytes:
    try:
        return source.read(2**20)
    except OSError as e:
        raise read_error(path, e) from None
