"""OUT in object storage (`dcp-to-hf SRC s3://bucket/release`): objects written in place, completed last.

An object store has no rename, so nothing is staged. Each data file is streamed to its final name by the
rank that owns it, as a multipart upload (`fs.open(key, "wb")`: parts go up as they fill, memory stays within
a part), and OUT is made complete by one last object. The order:

  1. the data files (`model-0000N-of-0000M.safetensors`), each by its owner;
  2. the small files rank 0 writes (`ckptconv_state.json`, the config and tokenizer files), made in a local
     temporary directory and uploaded;
  3. the completing object: `model.safetensors.index.json`, or for a one-file result `model.safetensors`
     itself, whose upload is held open until then.

A reader that takes the completing object as the sign of a finished result never sees a partial one. On
any failure or signal every rank aborts its multipart uploads in progress and deletes the objects it
completed; those that cannot be deleted are named in the error. `--overwrite` deletes the previous result's
completing object first, then its other objects (only those directly under OUT/: a neighbouring prefix such
as `release-v2/` is never touched), so old and new are never seen mixed as complete; after that point a
failure leaves OUT visibly incomplete, and the error says so. There is no lock: two runs writing one OUT at
once are the user's to avoid.

Call order: `RemoteTarget.check()` on rank 0 before any work; `publish(...)` on every rank.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..errors import CkptconvError
from ..world import World, everyone, on_main
from .files import RemoteFiles, denied, forget
from .urls import UrlPath, filesystem, redact

T = TypeVar("T")
PART_BYTES = 16 << 20  # multipart part size: 10,000 parts (S3's limit) hold 160 GiB, far above a shard
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COMPLETING = (INDEX_FILE, ".metadata", SINGLE_FILE)  # what makes an OUT look complete, in that order


@dataclass(frozen=True)
class RemoteTarget:
    url: UrlPath
    overwrite: bool

    def check(self) -> list[str]:
        """Rank 0: refuse an OUT prefix holding anything but a previous result (or one without
        --overwrite); the names of the objects there."""
        from ..outcheck import not_a_checkpoint

        names = sorted(listing(self.url))
        # an object under a deeper prefix counts as a subdirectory would
        entries = {
            (n.split("/")[0], n.split("/")[0] + ("/" if "/" in n else ""), "/" not in n) for n in names
        }
        foreign = not_a_checkpoint(sorted(entries))
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise CkptconvError(
                f"{self.url}: holds {shown}, not a checkpoint (--overwrite replaces only a previous result); "
                "choose an empty or new prefix, or remove them yourself"
            )
        if names and not self.overwrite:
            raise CkptconvError(f"{self.url}: exists and is not empty; pass --overwrite to replace it")
        return names

    def clear(self) -> bool:
        """Rank 0, before writing: with --overwrite, the previous result's completing object goes first,
        then the rest of it; whether there was one."""
        names = self.check()
        fs = filesystem(self.url)
        first = [n for n in COMPLETING if n in names]
        for group in (first, [n for n in names if n not in first]):
            if group:
                try:
                    fs.rm([f"{self.url.key}/{n}" for n in group])
                except Exception as e:
                    raise CkptconvError(
                        redact(f"{self.url}: cannot remove the previous result ({type(e).__name__}: {e})")
                    ) from None
        forget(self.url)
        return bool(names)


def _entry(name: str) -> tuple[str, str, bool]:
    """An object's name as a directory entry: one under a deeper prefix is that prefix, a subdirectory."""
    head, sub, _ = name.partition("/")
    return head, head + sub, not sub


def listing(url: UrlPath) -> dict[str, int]:
    """{name: size} of the objects under `url`, listed afresh (no cached listing)."""
    forget(url)
    return RemoteFiles(url).sizes()


class Stream:
    """One object written front to back as a multipart upload. `close()` completes it, unless it is the
    completing object of the run, which `commit()` completes last."""

    def __init__(self, url: UrlPath, hold: bool) -> None:
        self.url, self.hold, self.pos = url, hold, 0
        try:
            self._file = filesystem(url).open(url.key, "wb", block_size=PART_BYTES)
        except Exception as e:
            raise write_error(url, e) from None

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset != self.pos:  # a rank writes its file in order (file granularity): a bug otherwise
            raise CkptconvError(f"{self.url}: write at byte {offset}, expected {self.pos} (internal error)")
        try:
            self._file.write(data)
        except Exception as e:
            raise write_error(self.url, e) from None
        self.pos += len(data)

    def write(self, data: bytes | memoryview) -> int:
        """File-like: append (torch_record's writer)."""
        self.write_at(self.pos, memoryview(data).cast("B"))
        return len(data)

    def tell(self) -> int:
        return self.pos

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()

    def close(self) -> None:
        if not self.hold:
            self.commit()

    def commit(self) -> None:
        try:
            self._file.close()
        except Exception as e:
            raise write_error(self.url, e) from None
        _run.completed.append(self.url)
        _run.held = [s for s in _run.held if s is not self]

    def discard(self) -> None:
        try:
            if hasattr(self._file, "discard"):
                self._file.discard()  # aborts the multipart upload
        except Exception:
            _run.left.append(f"{self.url} (an unfinished multipart upload)")


class _Run:
    """This process's objects of the current run: completed, held open, and what could not be removed."""

    def __init__(self) -> None:
        self.completed: list[UrlPath] = []
        self.held: list[Stream] = []
        self.open: list[Stream] = []
        self.left: list[str] = []
        self.completing = ""
        self.local: Path | None = None  # rank's temporary directory: small files, hf-to-dcp's .metadata


_run = _Run()


def stream(url: UrlPath) -> Stream:
    """The upload of `url` (SafetensorsWriter's sink for a URL path)."""
    s = Stream(url, hold=url.name == _run.completing)
    _run.open.append(s)
    if s.hold:
        _run.held.append(s)
    return s


def write_error(url: object, e: BaseException) -> CkptconvError:
    if isinstance(e, CkptconvError):
        return e
    if denied(e):
        cause = "access denied; check the credentials and the bucket's permissions"
    else:
        cause = f"{type(e).__name__}: {e}".strip()
    return CkptconvError(redact(f"{url}: cannot write ({cause})"))


def publish(
    world: World,
    target: RemoteTarget,
    completing: str,
    write: Callable[[Path], object],
    finish: Callable[[Path], T],
    check: Callable[[Path], None] | None = None,
) -> T | None:
    """Collective: rank 0 clears OUT (--overwrite), every rank streams its data files, every rank `check`s
    (the CRC-32s of chunks read in pieces), rank 0 `finish`es into a local temporary directory (index,
    stash, copied files) and uploads those files, the `completing` object last (an index or `.metadata`
    made in that directory, or a held upload). On any failure, each rank removes what this run wrote."""
    global _run
    _run = _Run()
    _run.completing = completing
    cleared = False
    try:
        with tempfile.TemporaryDirectory(prefix="ckptconv-out-") as tmp:
            _run.local = Path(tmp)
            cleared = bool(on_main(world, target.clear))
            everyone(world, write, target.url)
            if check is not None:
                check(target.url)
            result = on_main(world, finish, Path(tmp))
            on_main(world, _upload_small, target.url, Path(tmp))
            everyone(world, _complete, target.url, Path(tmp))
        return world.all_gather_object(result)[0]
    except BaseException as e:
        left = _remove_ours()
        if isinstance(e, CkptconvError) and (left or cleared):
            raise CkptconvError(_aftermath(str(e), target, left, cleared)) from None
        raise
    finally:
        _run.local = None


def local_dir() -> Path:
    """The run's local temporary directory (where torch's DCP writer leaves `.metadata` for rank 0)."""
    assert _run.local is not None, "outside publish()"
    return _run.local


def bytes_written() -> int:
    """What this rank has streamed in the current run."""
    return sum(s.pos for s in _run.open)


def _upload_small(url: UrlPath, tmp: Path) -> None:
    """Rank 0: the files `finish` made, but the completing one (and torch's leftovers)."""
    fs = filesystem(url)
    for path in sorted(tmp.iterdir()):
        if path.is_file() and path.name != _run.completing and not path.name.endswith(".tmp"):
            try:
                fs.put_file(str(path), f"{url.key}/{path.name}")
            except Exception as e:
                raise write_error(url / path.name, e) from None
            _run.completed.append(url / path.name)


def _complete(url: UrlPath, tmp: Path) -> None:
    """Every rank, last: the held upload is completed (its owner) or the index or `.metadata` put (rank 0)."""
    for held in list(_run.held):
        held.commit()
    last = tmp / _run.completing
    if last.is_file():
        try:
            filesystem(url).put_file(str(last), f"{url.key}/{last.name}")
        except Exception as e:
            raise write_error(url / last.name, e) from None
        _run.completed.append(url / last.name)


def _remove_ours() -> list[str]:
    """This rank's uploads aborted and its completed objects deleted; what is left."""
    for s in _run.open:
        if s.url not in _run.completed:
            s.discard()
    left = list(_run.left)
    if _run.completed:
        fs = filesystem(_run.completed[0])
        for url in _run.completed:
            try:
                fs.rm_file(url.key)
            except FileNotFoundError:
                pass
            except Exception:
                left.append(str(url))
    _run.completed.clear()
    return left


def _aftermath(message: str, target: RemoteTarget, left: list[str], cleared: bool) -> str:
    if left:
        message += f"; could not remove {', '.join(left[:5])}" + (" and more" if len(left) > 5 else "")
        message += " (remove them yourself)"
    if cleared:
        message += f"; {target.url} no longer holds the previous result (--overwrite removed it)"
    return message
