"""Durable output: each written file fsynced as it is finished, then the directory entries that publish it.

A conversion's exit 0 means its result survives a power loss: every rank fsyncs the files (or byte ranges)
it wrote as it finishes each one (`Syncer`: on a thread of its own while the next file is written; hf-to-dcp's
writer threads fsync their own files), before the ranks agree that the writing is done; rank 0 then fsyncs
the small files it writes last and every directory of the staging tree (`seal`), renames the staging
directory into place and fsyncs OUT's parent (`outdir.publish`). `--no-fsync` (`fsync=False`) skips all of it,
for scratch work: a crash may then leave a published OUT with empty or short files.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

from ckptconv.formats.files import write_failed

SYNC_THREADS = 4  # rank 0's small files (index, config, tokenizer, stash), fsynced at once
# a directory fsync that the file system does not do (some FUSE and network file systems): nothing to wait for
_NO_DIR_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def sync_fd(fd: int, path: object) -> None:
    """fsync the open file `fd` (named `path` in an error): its data and size on the device."""
    try:
        os.fsync(fd)
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None


def sync_file(path: Path) -> None:
    """fsync the file `path` (written and closed by this process or another)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None
    try:
        sync_fd(fd, path)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    """fsync the directory `path`: the names of the entries made, renamed or removed in it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_SYNC:
            raise write_failed(path, OSError(e.errno, e.strerror)) from None
    finally:
        os.close(fd)


def make_dirs(path: Path, fsync: bool) -> None:
    """`mkdir -p path`, each directory it makes fsynced into its parent (when `fsync`)."""
    if path.exists() and not path.is_dir():
        raise write_failed(path, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    missing = []
    at = path
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError as e:
            if directory.is_dir():
                continue  # made meanwhile by another run
            raise write_failed(directory, OSError(e.errno, e.strerror)) from None
        except OSError as e:
            raise write_failed(directory, OSError(e.errno, e.strerror)) from None
        if fsync:
            sync_dir(directory.parent)


def tree(root: Path) -> tuple[set[Path], list[Path]]:
    """The regular files under `root`, and its directories deepest first (`root` last)."""
    files: set[Path] = set()
    dirs: list[Path] = []
    for top, _, names in os.walk(root):  # links are not followed (the copies make none)
        dirs.append(Path(top))
        files.update(p for p in (Path(top) / n for n in names) if p.is_file() and not p.is_symlink())
    return files, dirs[::-1]


def seal(root: Path, synced: Iterable[Path]) -> None:
    """Rank 0, last before the rename: every file under `root` but those `synced` already (the ranks' data
    files, each fsynced by its writer), several at once, then every directory, deepest first."""
    files, dirs = tree(root)
    rest = sorted(files - set(synced))
    if rest:
        with ThreadPoolExecutor(min(SYNC_THREADS, len(rest))) as pool:
            for _ in pool.map(sync_file, rest):
                pass
    for directory in dirs:
        sync_dir(directory)


class Syncer:
    """Closes this rank's finished output files, each fsynced first (when `fsync`) on a thread of its own,
    so that the next file is written meanwhile. `wait()` waits for them all and raises the first error;
    leaving the `with` block waits too (an error then is raised only if none is already on its way).
    `after(path)`, when given, runs once a file is on the device and closed (on the same thread): what may
    only be said of a durable file (a resume record) is said there."""

    def __init__(self, fsync: bool, threads: int = 1, after: Callable[[Any], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptconv-fsync") if fsync else None
        self._pending: list[Future[None]] = []
        self._after = after

    def close(self, fd: int, path: object) -> None:
        """Close `fd` (the file `path`, fully written by this rank), after its fsync."""
        if self._pool is None:
            _close(fd, path)
            if self._after is not None:
                self._after(path)
            return
        self._pending.append(self._pool.submit(_sync_and_close, fd, path, self._after))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except BaseException as e:  # every file is closed before the first error is raised
                error = error or e
        if error is not None:
            raise error

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        try:
            if kind is None:
                self.wait()
            else:
                with suppress(Exception):  # the error already on its way says what went wrong first
                    self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def _sync_and_close(fd: int, path: object, after: Callable[[Any], None] | None = None) -> None:
    try:
        sync_fd(fd, path)
    finally:
        _close(fd, path)
    if after is not None:
        after(path)


def _close(fd: int, path: object) -> None:
    try:
        os.close(fd)
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None
