"""Opening checkpoint files: only regular files, only inside the checkpoint, every OS error one line.

Every file ckptconv reads from a checkpoint goes through `open_regular` (or `read_regular`):

- the path is resolved (symlinks and `..` followed) and must lie inside the checkpoint's root directory
  (`inside`), so neither a path from `.metadata` or an index nor a symlink leads out of it;
- it must be a regular file: checked with `stat` before the open (a FIFO, device or socket is never opened),
  and again with `fstat` on the descriptor, opened `O_NONBLOCK` so that a FIFO swapped in between cannot
  block the open; `O_NONBLOCK` is then cleared;
- any OSError (EACCES, EIO, ELOOP, ...) becomes a `CkptconvError` naming the file and the cause.

`pread_exact` reads at an offset and turns a short read (a file that shrank) into an error as well.

Files beside a checkpoint (config.json, adapter_config.json, `.hf_metadata/`, the stash, what `--copy-from`
copies) and files named by a flag (`--config`, `--mapping`, `--lora-config`) are opened the same way, by
`open_bounded` / `read_regular` with one of the limits below: the size of the open file is checked before a
byte of it is read, so a huge (or sparse) file is refused by name instead of filling memory or OUT.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ckptconv.core.specs import Stamp
from ckptconv.errors import CkptconvError
from ckptconv.remote.urls import UrlPath

# The most a file beside a checkpoint (or named by a flag) may hold, checked before it is read or copied:
CONFIG_BYTES = 16 * 2**20  # read whole: config.json, adapter_config.json, --config, --lora-config, --mapping
KEY_MAP_BYTES = 64 * 2**20  # read whole: .hf_metadata/fqn_to_file_index_mapping.json (a file number per key)
STASH_BYTES = 2**30  # read whole: ckptconv_state.json (non-tensor items, torch.save bytes in base64)
COPIED_FILE_BYTES = 2**30  # streamed: each file --copy-from or .hf_metadata copies (tokenizer.json, ...)
COPIED_TOTAL_BYTES = 4 * 2**30  # streamed: all the files of one --copy-from or .hf_metadata together
COPIED_DEPTH = 32  # directories nested inside a --copy-from or .hf_metadata directory

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def read_error(path: object, e: OSError) -> CkptconvError:
    """The one-line error for an OSError met while reading `path`."""
    cause = e.strerror or str(e) or type(e).__name__
    return CkptconvError(f"{path}: cannot read ({cause}); check the file's permissions and storage")


_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/+")


def refuse_url(path: str | Path, what: str) -> None:
    """A URL (`s3://bucket/x`, `gs://`, `hf://`, ...) where ckptconv does not take one yet (an OUT, an HF
    source) is refused by name: a `Path` would take it for a local directory named `s3:` (writing
    `./s3:/bucket/x` and exiting 0). A local directory of such a name is still reachable as `./s3:/...`."""
    text = str(path)
    match = _URL.match(text)
    if match:
        url = f"{match.group(1)}://{text[match.end() :]}"
        raise CkptconvError(
            f"{what} {url}: object storage URLs are not supported here yet (the commands' SRC and OUT, "
            "save_hf and load_hf take them); use a local or mounted file system path "
            f"(./{text} for a local directory of that name)"
        )


def no_nul(path: object) -> None:
    """A path with a NUL byte (from an index or `.metadata`) names no file: refused before any OS call,
    which would raise ValueError."""
    if "\0" in os.fsdecode(str(path)):
        raise CkptconvError(f"{str(path)!r}: a path with a NUL byte; the checkpoint's file names are corrupt")


def inside(path: Path, root: Path) -> Path:
    """The real path of `path` (symlinks resolved), which must lie in the real directory `root`. In object
    storage: `path` with no `..` leading out of the prefix `root`."""
    no_nul(path)
    if isinstance(path, UrlPath):
        name, prefix = os.path.normpath(path.key), os.path.normpath(getattr(root, "key", ""))
        if name != prefix and not name.startswith(prefix + "/"):
            raise CkptconvError(f"{path}: lies outside the checkpoint's prefix {root}; refusing to read it")
        return path
    try:
        real, base = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    except OSError as e:  # a symlink loop (Python 3.13 raises it even without strict=True)
        raise read_error(path, e) from None
    if real != base and base not in real.parents:
        raise CkptconvError(
            f"{path}: resolves to {real}, outside the checkpoint directory {root}; refusing to read it "
            "(copy the file into the checkpoint instead of linking or pointing to it)"
        )
    return real


def kind(mode: int) -> str:
    """What a file of st_mode `mode` is, in words."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _not_regular(path: object, mode: int) -> CkptconvError:
    """The one-line error for a checkpoint path that is not a regular file."""
    return CkptconvError(
        f"{path}: is {kind(mode)}, not a regular file; refusing to read it (replace it with the real file)"
    )


def stat_regular(path: Path, root: Path | None = None) -> os.stat_result:
    """`stat` of the regular file `path` (inside `root` if given), or a CkptconvError saying why not."""
    return _stat_regular(path, inside(path, root) if root is not None else path)


def _stat_regular(path: Path, real: Path) -> os.stat_result:
    """`stat` of `real` (the resolved `path`), which must be a regular file; errors name `path`."""
    no_nul(real)
    try:
        st = os.stat(real)
    except OSError as e:
        raise read_error(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


def open_regular(path: Path, root: Path | None = None) -> int:
    """A read-only descriptor of the regular file `path` (which must lie inside `root` if given).

    Never opens a FIFO, device or socket, and never blocks opening one swapped in after the check.
    """
    real = inside(path, root) if root is not None else path
    _stat_regular(path, real)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if root is not None else 0)
    try:
        fd = os.open(real, flags)
    except OSError as e:
        raise read_error(path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except OSError as e:
        os.close(fd)
        raise read_error(path, e) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class BoundedReader:
    """A binary file read no further than the `size` it had when opened: a read of n bytes asks the file for
    at most the bytes left, so a length field in the data (a pickle frame claiming 64 GiB) cannot make the
    reader allocate more than the file holds; such a read comes back short, as at the end of the file."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f, self._left = f, size

    def read(self, n: int | None = -1) -> bytes:
        data = self._f.read(self._left if n is None or n < 0 else min(n, self._left))
        self._left -= len(data)
        return data

    def readline(self, limit: int = -1) -> bytes:
        data = self._f.readline(self._left if limit < 0 else min(limit, self._left))
        self._left -= len(data)
        return data


def stamp(st: os.stat_result) -> Stamp:
    """What identifies one version of a file: device, inode, size and modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(path: object, fd: int, expected: Stamp | None) -> None:
    """Refuse a file that is not the one read earlier in this run (replaced, rewritten, or resized)."""
    if expected is None:
        return
    try:
        now = stamp(os.fstat(fd))
    except OSError as e:
        raise read_error(path, e) from None
    if now != expected:
        raise changed(path)


def changed(path: object) -> CkptconvError:
    """The error for a source file that changed or shrank while ckptconv was reading it."""
    return CkptconvError(
        f"{path}: changed or shrank while ckptconv was reading it; "
        "rerun once nothing writes to the checkpoint"
    )


def pread_exact(fd: int, path: object, offset: int, view: memoryview, shrank: bool = False) -> None:
    """Fill `view` with the bytes of the open file `path` at `offset`; a short read is an error (`changed`
    when `shrank`: the caller knew the file held these bytes)."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as e:
            raise read_error(path, e) from None
        if n <= 0 and shrank:
            raise changed(path)
        if n <= 0:
            raise CkptconvError(
                f"{path}: truncated at byte {offset + done} (it shrank, or was cut short when copied); "
                "re-copy it, and rerun once nothing writes to it"
            )
        done += n


def too_large(path: object, size: int, limit: int) -> CkptconvError:
    """The error for a file of `size` bytes where one of its kind holds at most `limit`."""
    return CkptconvError(
        f"{path}: {size} bytes, more than the {limit} a file of its kind may have; refusing to read it "
        "(is it the right file? a sparse or runaway file can be this large)"
    )


def open_bounded(path: Path, root: Path | None, limit: int | None) -> tuple[int, int]:
    """A descriptor of the regular file `path` (inside `root` if given: symlinks followed only within it) and
    its size, which must be at most `limit`: checked on the open descriptor, before any byte is read."""
    fd = open_regular(path, root)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise too_large(path, size, limit)
    except OSError as e:
        os.close(fd)
        raise read_error(path, e) from None
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def read_regular(path: Path, root: Path | None = None, limit: int | None = None) -> bytes:
    """The whole content of the regular file `path` (inside `root` if given), at most `limit` bytes."""
    if isinstance(path, UrlPath):
        from ckptconv.remote import tree

        if root is not None:
            inside(path, root)
        return tree.read_small(path, limit)
    fd, size = open_bounded(path, root, limit)
    try:
        buf = bytearray(size)
        pread_exact(fd, path, 0, memoryview(buf))
        return bytes(buf)
    finally:
        os.close(fd)


def mode_of(path: Path) -> int | None:
    """The st_mode of what `path` leads to (symlinks followed), None when nothing is there (a dangling
    symlink included); any other error (EACCES on a parent directory, ELOOP) is a CkptconvError naming it.
    A URL: an object is a regular file, a prefix with objects under it a directory (`remote.tree`)."""
    no_nul(path)
    if isinstance(path, UrlPath):
        from ckptconv.remote import tree

        return tree.mode(path)
    try:
        return os.stat(path).st_mode
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise read_error(path, e) from None


def exists(path: Path) -> bool:
    """Whether anything is at `path`, without a traceback for EACCES (see `mode_of`)."""
    return mode_of(path) is not None


def is_regular(path: Path) -> bool:
    """Whether `path` is a regular file (symlinks followed), without a traceback for EACCES."""
    mode = mode_of(path)
    return mode is not None and stat.S_ISREG(mode)


def is_directory(path: Path) -> bool:
    """Whether `path` is a directory (symlinks followed), without a traceback for EACCES."""
    mode = mode_of(path)
    return mode is not None and stat.S_ISDIR(mode)


def listdir(path: Path) -> list[str]:
    """The names in directory `path`, sorted; an unreadable directory is a CkptconvError naming it."""
    if isinstance(path, UrlPath):
        from ckptconv.remote import tree

        return tree.children(path)
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        raise read_error(path, e) from None


def write_failed(path: object, e: OSError) -> CkptconvError:
    """The one-line error for a failed write: the file and the cause."""
    where = e.filename if e.filename is not None else path
    cause = e.strerror or type(e).__name__
    return CkptconvError(f"{where}: cannot write ({cause}); check free space and permissions")


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """Any OSError inside is a write error on `path` (a file written whole: index, stash)."""
    try:
        yield
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None
