"""`--copy-from DIR`: config, tokenizer and the other non-weight files of an HF directory, copied into OUT.

Only what is the source's own is copied: regular files and directories inside its root (DIR, or the
huggingface_hub cache folder of a snapshot, whose links into `blobs/` are followed, as
`formats.hf.checkpoint_root` allows; for NeMo Automodel's `.hf_metadata/`, the checkpoint it lies in), never
a FIFO, device or socket, never a symlink leading out. Weights, indexes, stashes and hidden files stay behind,
at every level. What is copied is bounded (`formats.files`): each file's size (checked before it is read), the
total, the nesting, and each real directory is copied once (a symlink loop, or a second link to a directory,
is refused by name).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from ckptconv.errors import CkptconvError
from ckptconv.formats.files import (
    COPIED_DEPTH,
    COPIED_FILE_BYTES,
    COPIED_TOTAL_BYTES,
    changed,
    inside,
    is_directory,
    listdir,
    open_bounded,
    read_error,
    stat_regular,
    too_large,
    write_failed,
)
from ckptconv.formats.hf import checkpoint_root

_WEIGHT_SUFFIXES = (
    *(".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp"),
    *(".onnx", ".onnx_data", ".ot", ".tflite"),  # other runtimes' weights (onnx/, rust_model.ot)
)
_CHUNK = 2**20


def copy_non_weights(src: Path, dst: Path, root: Path | None = None) -> list[str]:
    """Copy the non-weight files and directories of `src` into `dst`; return the names copied at the top.
    Every file must resolve inside `root` (default: `src`'s own, `checkpoint_root`); `src` itself too.
    All of it is walked and checked before anything is written."""
    walk = _walk(src, root)
    total = 0
    for rel, size in walk.entries:
        if size is None:
            try:
                (dst / rel).mkdir()
            except OSError as e:
                raise write_failed(dst / rel, e) from None
        else:
            total += _copy_file(src / rel, dst / rel, walk.root)
            if total > COPIED_TOTAL_BYTES:  # grown since the walk
                raise _too_much(src, src / rel)
    return [str(rel) for rel, _ in walk.entries if len(rel.parts) == 1]


def check_copy(src: Path, root: Path | None = None) -> None:
    """Refuse now what `copy_non_weights(src, _, root)` would refuse (before the weights are written)."""
    _walk(src, root)


def _walk(src: Path, root: Path | None) -> _Walk:
    if not is_directory(src):
        raise CkptconvError(f"--copy-from {src}: not a directory")
    return _Walk(src, checkpoint_root(src) if root is None else root)


def is_weight_file(name: str) -> bool:
    """Weights and what describes them (index, stash, DCP metadata): never copied from --copy-from."""
    from ckptconv.formats.stash import STASH_FILE

    return (
        name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json") or name in (STASH_FILE, ".metadata")
    )


def uncopied_patterns() -> list[str]:
    """What `is_copied` leaves behind (but the index), as huggingface_hub's ignore patterns: what fetching
    --copy-from's hub repo skips (fnmatch's `*` spans folders, so `*.bin` is any folder's)."""
    from ckptconv.formats.stash import STASH_FILE

    names = [f"*{suffix}" for suffix in _WEIGHT_SUFFIXES] + [STASH_FILE, ".metadata", ".*"]
    return names + [f"*/{name}" for name in names if not name.startswith("*")]


def is_copied(name: str) -> bool:
    """Whether an entry of this name (at any level) is copied: not hidden, not weights."""
    return not name.startswith(".") and not is_weight_file(name)


class _Walk:
    """What one copy takes, checked before anything is written: `entries` ((path relative to `src`, its size
    or None for a directory), parents first); each real directory entered once; the limits of `files`."""

    def __init__(self, src: Path, root: Path) -> None:
        self.src, self.root = src, root
        self.entries: list[tuple[Path, int | None]] = []
        self.entered: dict[tuple[int, int], Path] = {}
        self.total = 0
        self._directory(src, inside(src, root), Path(), 0)

    def _directory(self, path: Path, real: Path, rel: Path, depth: int) -> None:
        if depth > COPIED_DEPTH:
            raise CkptconvError(
                f"{path}: directories nested more than {COPIED_DEPTH} deep in {self.src}; "
                "a model's files are not, copy what you need yourself"
            )
        st = _stat(path, real)
        first = self.entered.setdefault((st.st_dev, st.st_ino), path)
        if first != path:
            raise CkptconvError(
                f"{path}: leads to {real}, copied already as {first} (a symlink loop, or a second link to "
                "one directory); remove the link"
            )
        for name in listdir(path):
            if is_copied(name):
                self._entry(path / name, rel / name, depth + 1)

    def _entry(self, path: Path, rel: Path, depth: int) -> None:
        real = inside(path, self.root)
        if stat.S_ISDIR(_stat(path, real).st_mode):
            self.entries.append((rel, None))
            self._directory(path, real, rel, depth)
            return
        size = stat_regular(path, self.root).st_size  # a FIFO, device or socket is refused here, naming it
        if size > COPIED_FILE_BYTES:
            raise too_large(path, size, COPIED_FILE_BYTES)
        self.total += size
        if self.total > COPIED_TOTAL_BYTES:
            raise _too_much(self.src, path)
        self.entries.append((rel, size))


def _stat(path: Path, real: Path) -> os.stat_result:
    try:
        return os.stat(real)
    except OSError as e:
        raise read_error(path, e) from None


def _too_much(src: Path, at: Path) -> CkptconvError:
    return CkptconvError(
        f"{src}: its files to copy hold more than {COPIED_TOTAL_BYTES} bytes (at {at}); "
        "a model's config and tokenizer files do not, copy what you need yourself"
    )


def _copy_file(path: Path, target: Path, root: Path) -> int:
    """The bytes `path` has when opened (at most COPIED_FILE_BYTES) to `target`; returns how many."""
    fd, size = open_bounded(path, root, COPIED_FILE_BYTES)
    with os.fdopen(fd, "rb") as source:
        try:
            with open(target, "wb") as out:
                left = size
                while left:
                    chunk = _read(source, path, min(left, _CHUNK))
                    out.write(chunk)
                    left -= len(chunk)
        except OSError as e:  # creating, writing or closing (flushing) the copy
            raise write_failed(target, e) from None
    return size


def _read(source: BinaryIO, path: Path, n: int) -> bytes:
    """At most `n` bytes of `source`, at least one: none (the file shrank while it was copied) is an error."""
    try:
        data = source.read(n)
    except OSError as e:
        raise read_error(path, e) from None
    if not data:
        raise changed(path)
    return data
