"""OUT in object storage (`dcp-to-hf SRC s3://bucket/release`): objects written in place, completed last.

An object store has no rename, so nothing is staged. Each data file is streamed to its final name as a
multipart upload, and OUT is made complete by one last object. In S3 every rank uploads the parts of its
pieces of every file (remote.parts, remote.multipart: tensor-level parallel writing) and rank 0 completes
each upload; elsewhere (gcs, azure, ...) each file is streamed by the rank that owns it (`fs.open(key,
"wb")`).
Either way parts go up as they fill: memory stays within a part or two. The order:

  1. the data files (`model-0000N-of-0000M.safetensors`);
  2. the small files rank 0 writes (`ckptconv_state.json`, the config and tokenizer files), made in a local
     temporary directory and uploaded;
  3. the completing object: `model.safetensors.index.json`, or for a one-file result `model.safetensors`
     itself, whose upload is held open until then.

A reader that takes the completing object as the sign of a finished result never sees a partial one. On
any failure or signal every rank aborts its multipart uploads in progress and deletes the objects it
completed; those that cannot be deleted are named in the error. Rank 0 holds OUT's lock object for the
whole run (remote.lock): a second run writing the same OUT stops with a line naming the first.
`--overwrite` deletes the previous result's completing object first, then its other objects (only those
directly under OUT/: a neighbouring prefix such as `release-v2/` is never touched), so old and new are never
seen mixed as complete; after that point a failure leaves OUT visibly incomplete, and the error says so.

Call order (`publish.target`): `RemoteTarget.check()` on rank 0 before any work; `publish(...)` on every
rank.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ckptconv.errors import CkptconvError
from ckptconv.formats.names import not_a_checkpoint
from ckptconv.formats.sinks import ObjectStore, PositionedSink
from ckptconv.job.signals import deferred
from ckptconv.job.world import World, everyone, from_main, on_main
from ckptconv.publish import multipart
from ckptconv.publish.confirm import confirm, write_error
from ckptconv.publish.parts import Piece, plan_pieces
from ckptconv.publish.remote_lock import NAME as LOCK_NAME
from ckptconv.publish.remote_lock import RemoteLock
from ckptconv.publish.remote_lock import peek as peek_lock
from ckptconv.publish.remote_lock import take as take_lock
from ckptconv.publish.target import quiet
from ckptconv.publish.upload import Ledger, Stream
from ckptconv.remote.files import RemoteFiles, forget
from ckptconv.remote.urls import UrlPath, filesystem, redact, url_path

if TYPE_CHECKING:
    from ckptconv.plan.types import Granularity, OutFile, Write
    from ckptconv.publish.resume import Resume

T = TypeVar("T")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"  # --lora adapter's one file
# what makes an OUT look complete, in that order
COMPLETING = (INDEX_FILE, ".metadata", SINGLE_FILE, ADAPTER_FILE)


@dataclass(frozen=True)
class RemoteTarget:
    """An OUT prefix in object storage (a `publish.target.Target`), written in place and completed last."""

    url: UrlPath
    """OUT."""
    overwrite: bool
    """--overwrite: a previous result there is replaced."""

    def check(self) -> None:
        """Rank 0: refuse an OUT prefix holding anything but a previous result (or one without
        --overwrite)."""
        self._checked()

    def _checked(self) -> list[str]:
        """`check()`; the names of the objects there."""
        filesystem(self.url)  # a missing extra is named with OUT, not with its lock
        peek_lock(self.url)
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
        names = self._checked()
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

    def granularity(self, asked: Granularity, quantize: bool) -> Granularity:
        """In S3 "parts" (tensor-level, every piece a multipart upload's parts) unless asked for "file" or
        quantizing (a weight's scale lies apart from it); one rank a file in other stores."""
        return "parts" if asked == "tensor" and not quantize and multipart.supported(self.url) else "file"

    def notes(self, world_size: int, granularity: Granularity | None = None) -> list[str]:
        """That each file goes up whole from one rank, when several ranks write by file."""
        if world_size > 1 and granularity == "file":
            return [f"{self.url}: each file is uploaded whole by one rank (--write-granularity file)"]
        return []

    def sink(self, path: Path) -> PositionedSink | None:
        return stream(self._under(path))

    def store(self) -> ObjectStore | None:
        return self

    def whole(self, path: Path) -> Stream:
        """`ObjectStore`'s: the upload of all of `path` (under OUT) by this rank."""
        return whole(self._under(path))

    def local_dir(self) -> Path:
        """`ObjectStore`'s: the run's local temporary directory."""
        return local_dir()

    def written(self, staging: Path, files: str) -> int:
        return bytes_written()  # a rank's streams are its data files

    def publish(
        self,
        world: World,
        write: Callable[[Path], object],
        finish: Callable[[Path], T],
        check: Callable[[Path], None] | None = None,
        *,
        last: str,
        layout: tuple[Sequence[OutFile], Sequence[Write]] | None = None,
        say: Callable[[str], None] = quiet,
        fsync: bool = True,
        resume: Resume | None = None,
    ) -> T | None:
        """Collective: `publish` below (`say`, `fsync` and `resume` are a local OUT's: --resume is refused
        for object storage before this)."""
        return publish(world, self, last, write, finish, check, layout)

    @property
    def local_path(self) -> Path | None:
        return None

    def names(self) -> list[str]:
        return sorted(listing(self.url))

    def _under(self, path: Path) -> UrlPath:
        """`path`, a file written under OUT, as the URL it is."""
        return self.url / path.relative_to(self.url)


def granularity(out: str | Path, asked: Granularity, quantize: bool) -> Granularity:
    """The write granularity for OUT: as asked on a file system, else `RemoteTarget.granularity` (what a
    plan made before OUT's target takes)."""
    url = url_path(out)
    return asked if url is None else RemoteTarget(url, False).granularity(asked, quantize)


def listing(url: UrlPath) -> dict[str, int]:
    """{name: size} of the objects under `url`, listed afresh (no cached listing)."""
    forget(url)
    return {n: size for n, size in RemoteFiles(url).sizes().items() if n != LOCK_NAME}  # a bucket's lock


class _Run(Ledger):
    """This process's objects of the current run: completed, held open, and what could not be removed."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[Stream | multipart.PartStream] = []
        self.completing = ""
        self.local: Path | None = None  # rank's temporary directory: small files, hf-to-dcp's .metadata
        self.uploads: dict[str, str] = {}  # S3, written by parts: {file: upload id}
        self.owned: dict[str, str] = {}  # rank 0: those uploads it has not completed yet
        self.out: UrlPath | None = None
        self.pieces: dict[str, Piece] = {}  # this rank's piece of each file
        self.sizes: dict[str, tuple[int, int]] = {}  # rank 0: {file: (its bytes, its parts)}
        self.tags: multipart.Tags = {}  # this rank's parts sent
        self.last_tags: list[tuple[int, str]] | None = None  # rank 0: the completing file's, once gathered


_run = _Run()


def stream(url: UrlPath) -> Stream | multipart.PartStream:
    """The upload of `url` (SafetensorsWriter's sink for a URL path): this rank's piece of it, or all."""
    if url.name in _run.pieces:
        part = multipart.PartStream(url, _run.uploads[url.name], _run.pieces[url.name], _run.tags)
        _run.open.append(part)
        return part
    return whole(url)


def whole(url: UrlPath) -> Stream:
    """The upload of all of `url` by this rank, written front to back."""
    s = Stream(url, url.name == _run.completing, _run)
    _run.open.append(s)
    if s.hold:
        _run.held.append(s)
    return s


def publish(
    world: World,
    target: RemoteTarget,
    completing: str,
    write: Callable[[Path], object],
    finish: Callable[[Path], T],
    check: Callable[[Path], None] | None = None,
    layout: tuple[Sequence[OutFile], Sequence[Write]] | None = None,
) -> T | None:
    """Collective: rank 0 clears OUT (--overwrite), every rank streams its data files (in S3, with the
    plan's `layout` (files, writes): its pieces of them, as parts), every rank `check`s (the CRC-32s of
    chunks read in pieces, --verify reading the written objects back), rank 0 `finish`es into a local
    temporary directory (index, stash, copied files) and uploads those files, the `completing` object last
    (an index or `.metadata` made in that directory, or a held upload). A one-file result and a DCP are
    checked once complete (they cannot be read before). On any failure, each rank removes what this run
    wrote."""
    global _run
    _run = _Run()
    _run.completing = completing
    cleared = False
    held: list[RemoteLock] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ckptconv-out-") as tmp:
            _run.local = Path(tmp)
            on_main(world, lambda: _take(target.url, held))
            cleared = bool(on_main(world, target.clear))
            if layout is not None and multipart.supported(target.url):
                everyone(world, _start_parts, world, target.url, *layout)
            everyone(world, write, target.url)
            if _run.uploads:
                on_main(world, _complete_parts, target.url, world.all_gather_object(_run.tags))
            late = completing != INDEX_FILE  # the one data file or `.metadata`: read back once complete
            if check is not None and not late:
                _check(check, target.url)
            result = on_main(world, finish, Path(tmp))
            on_main(world, _upload_small, target.url, Path(tmp))
            everyone(world, _complete, target.url, Path(tmp))
            if check is not None and late:
                _check(check, target.url)
        return world.all_gather_object(result)[0]
    except BaseException as e:
        left = _remove_ours()
        if isinstance(e, CkptconvError) and (left or cleared):
            raise CkptconvError(_aftermath(str(e), target, left, cleared)) from None
        raise
    finally:
        _run.local = None
        for lock in held:
            lock.release()


def _take(url: UrlPath, held: list[RemoteLock]) -> None:
    with deferred():  # the lock put and its record
        held.append(take_lock(url))


def _check(check: Callable[[Path], None], url: UrlPath) -> None:
    forget(url)  # listed empty when the run began
    check(url)


def _start_parts(world: World, url: UrlPath, files: Sequence[OutFile], writes: Sequence[Write]) -> None:
    """Every rank: the uploads rank 0 starts, and this rank's pieces."""
    pieces = plan_pieces(files, writes)
    _run.out = url
    _run.uploads = from_main(world, lambda: multipart.start(url, [f.name for f in files], _run.owned))
    _run.pieces = {p.file: p for p in pieces if p.rank == world.rank}
    _run.sizes = multipart.totals(pieces)


def _complete_parts(url: UrlPath, gathered: list[multipart.Tags]) -> None:
    """Rank 0, once every rank has sent its parts: each upload completed (the completing one held)."""
    tags: multipart.Tags = {}
    for rank_tags in gathered:
        for name, numbered in rank_tags.items():
            tags.setdefault(name, []).extend(numbered)
    for name, upload_id in _run.uploads.items():
        if name == _run.completing:
            _run.last_tags = tags.get(name, [])
            continue
        _complete_upload(url / name, upload_id, tags.get(name, []))


def _complete_upload(url: UrlPath, upload_id: str, tags: list[tuple[int, str]]) -> None:
    size, parts = _run.sizes[url.name]
    multipart.check_parts(url, tags, parts)  # never an object short of a part
    try:
        with deferred():
            multipart.complete(url, upload_id, tags)
            _run.completed.append(url)
            del _run.owned[url.name]
    except Exception as e:
        raise write_error(url, e) from None
    confirm(url, size)


def local_dir() -> Path:
    """The run's local temporary directory (where torch's DCP writer leaves `.metadata` for rank 0)."""
    assert _run.local is not None, "outside publish()"
    return _run.local


def bytes_written() -> int:
    """What this rank has streamed in the current run."""
    return sum(s.written for s in _run.open)


def _upload_small(url: UrlPath, tmp: Path) -> None:
    """Rank 0: the files `finish` made, but the completing one (and torch's leftovers)."""
    fs = filesystem(url)
    for path in sorted(tmp.iterdir()):
        if path.is_file() and path.name != _run.completing and not path.name.endswith(".tmp"):
            try:
                with deferred():
                    fs.put_file(str(path), f"{url.key}/{path.name}")
                    _run.completed.append(url / path.name)
            except Exception as e:
                raise write_error(url / path.name, e) from None
            confirm(url / path.name, path.stat().st_size)


def _complete(url: UrlPath, tmp: Path) -> None:
    """Every rank, last: the held upload is completed (its owner) or the index or `.metadata` put (rank 0)."""
    for held in list(_run.held):
        held.commit()
    if _run.last_tags is not None:
        _complete_upload(url / _run.completing, _run.uploads[_run.completing], _run.last_tags)
    last = tmp / _run.completing
    if last.is_file():
        try:
            with deferred():
                filesystem(url).put_file(str(last), f"{url.key}/{last.name}")
                _run.completed.append(url / last.name)
        except Exception as e:
            raise write_error(url / last.name, e) from None
        confirm(url / last.name, last.stat().st_size)


def _remove_ours() -> list[str]:
    """This rank's uploads aborted and its completed objects deleted; what is left."""
    for s in _run.open:
        if s.url not in _run.completed:
            s.discard()
    left = list(_run.left)
    if _run.owned and _run.out is not None:  # rank 0 started the uploads: it aborts those not completed
        left += multipart.abort_all(_run.out, _run.owned)
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
