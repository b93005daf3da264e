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

A reader that takes the completing object as the sign of a finished result never sees a partial one. On any
failure every rank aborts its multipart uploads in progress and deletes the objects it completed; those that
cannot be deleted are named in the error. But in S3 (by parts or by file) a run can be resumed
(remote_resume): a signal or a killed rank leaves what was sent, less a completing object, for `--resume`.
Rank 0 holds OUT's lock object for the whole run (remote.lock): a second run writing the same OUT stops with
a line naming the first.
`--overwrite` deletes the previous result's completing object first, then its other objects (only those
directly under OUT/: a neighbouring prefix such as `release-v2/` is never touched), so old and new are never
seen mixed as complete; after that point a failure leaves OUT visibly incomplete, and the error says so.

Call order (`publish.target`): `RemoteTarget.check()` on rank 0 before any work; `publish(...)` on every
rank.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ckptconv.errors import CkptconvError
from ckptconv.job.signals import deferred
from ckptconv.job.world import World, collective_failure, everyone, from_main, on_main
from ckptconv.publish import multipart
from ckptconv.publish import remote_resume as rr
from ckptconv.publish.confirm import confirm, write_error
from ckptconv.publish.remote_lock import RemoteLock
from ckptconv.publish.remote_lock import take as take_lock
from ckptconv.publish.remote_run import Run, resumed, start_parts, start_whole
from ckptconv.publish.upload import Stream
from ckptconv.remote.files import forget
from ckptconv.remote.urls import UrlPath, filesystem

if TYPE_CHECKING:
    from ckptconv.plan.types import OutFile, Write
    from ckptconv.publish.resume import Resume

T = TypeVar("T")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"  # --lora adapter's one file
# what makes an OUT look complete, in that order
COMPLETING = (INDEX_FILE, ".metadata", SINGLE_FILE, ADAPTER_FILE)

_run = Run()


def stream(url: UrlPath) -> Stream | multipart.PartStream:
    """The upload of `url` (SafetensorsWriter's sink for a URL path): this rank's piece of it, or all."""
    if url.name in _run.pieces:
        kept = _run.kept_parts.get(url.name, {})
        part = multipart.PartStream(url, _run.uploads[url.name], _run.pieces[url.name], _run.tags, kept)
        _run.open.append(part)
        return part
    return whole(url)


def whole(url: UrlPath) -> Stream:
    """The upload of all of `url` by this rank, written front to back (in a run that can be resumed, tagged
    with its fingerprint: `remote_run.start_whole`)."""
    s = Stream(url, url.name == _run.completing, _run, _run.tag(url.name) if _run.tag else None)
    _run.open.append(s)
    if s.hold:
        _run.held.append(s)
    return s


def publish(
    world: World,
    url: UrlPath,
    clear: Callable[[], bool],
    completing: str,
    write: Callable[[Path], object],
    finish: Callable[[Path], T],
    check: Callable[[Path], None] | None = None,
    layout: tuple[Sequence[OutFile], Sequence[Write]] | None = None,
    resume: Resume | None = None,
) -> T | None:
    """Collective: rank 0 `clear`s OUT `url` (--overwrite), every rank streams its data files (in S3, with the
    plan's `layout` (files, writes): its pieces of them, as parts), every rank `check`s (the CRC-32s of
    chunks read in pieces, --verify reading the written objects back), rank 0 `finish`es into a local
    temporary directory (index, stash, copied files) and uploads those files, the `completing` object last
    (an index or `.metadata` made in that directory, or a held upload). A one-file result and a DCP are
    checked once complete (they cannot be read before). On any failure, each rank removes what this run
    wrote; but with `resume` in S3 (remote_resume), an interrupt (a signal, a rank killed) leaves
    it for a `--resume`, which keeps what checks out of it."""
    global _run
    _run = Run()
    _run.completing = completing
    cleared = False
    held: list[RemoteLock] = []
    # a run that can be resumed (remote_resume): in S3 (by parts or by file; a DCP's files whole), with its
    # fingerprint
    resumable = resume if multipart.supported(url) else None
    try:
        with tempfile.TemporaryDirectory(prefix="ckptconv-out-") as tmp:
            _run.local = Path(tmp)
            on_main(world, lambda: _take(url, held))
            kept = None
            if resumable is not None and resumable.asked:
                found = lambda: resumed(_run, url, resumable, layout, world.size)  # noqa: E731
                kept = everyone(world, from_main, world, found)
                resumable.kept = kept.whole if kept is not None else frozenset()
                resumable.object_sizes = kept.sizes if kept is not None else {}
            if kept is None:
                cleared = bool(on_main(world, clear))
            if layout is not None and multipart.supported(url):
                fingerprint = resumable.fingerprint if resumable is not None else None
                everyone(world, start_parts, _run, world, url, *layout, kept, fingerprint)
                _run.resumable = resumable is not None
            elif resumable is not None:  # a DCP (hf-to-dcp): each rank's files whole, tagged
                everyone(world, start_whole, _run, world, url, kept is not None, resumable.fingerprint)
            everyone(world, write, url)
            if _run.uploads:
                on_main(world, _complete_parts, url, world.all_gather_object(_run.tags))
            late = completing != INDEX_FILE  # the one data file or `.metadata`: read back once complete
            if check is not None and not late:
                _check(check, url)
            result = on_main(world, finish, Path(tmp))
            on_main(world, _upload_small, url, Path(tmp))
            everyone(world, _complete, url, Path(tmp))
            if _run.resumable:
                on_main(world, _drop_record, url)
            if check is not None and late:
                _check(check, url)
        return world.all_gather_object(result)[0]
    except BaseException as e:
        if _run.resumable and resumable is not None and _interrupted(e):
            if _run.dropped:  # after the record went: the result is complete, and stays
                raise
            left = _leave_for_resume()
            if left:
                resumable.warn(f"could not remove {left[0]} (the run did not finish): remove it yourself")
            if world.is_main:
                resumable.warn(
                    f"kept what the run sent so far under {url} (no {completing}: not a complete "
                    "result): rerun with --resume to send only the rest, or with --overwrite to start over"
                )
            raise
        left = _remove_ours()
        if isinstance(e, CkptconvError) and (left or cleared):
            raise CkptconvError(_aftermath(str(e), url, left, cleared)) from None
        raise
    finally:
        _run.local = None
        for lock in held:
            lock.release()


def _interrupted(error: BaseException) -> bool:
    """Whether the run was interrupted (a signal, or a rank that died under it) rather than failed."""
    return isinstance(error, KeyboardInterrupt) or collective_failure(error, 0, 0) is not None


def _take(url: UrlPath, held: list[RemoteLock]) -> None:
    with deferred():  # the lock put and its record
        held.append(take_lock(url))


def _check(check: Callable[[Path], None], url: UrlPath) -> None:
    forget(url)  # listed empty when the run began
    check(url)


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
    return sum(s.written - s.skipped for s in _run.open)  # parts kept by --resume are not sent


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
    _discard_open()
    left = list(_run.left)
    if _run.owned and _run.out is not None:  # rank 0 started the uploads: it aborts those not completed
        # (but an interrupted run's, gone on with by --resume: left as they were, with their parts)
        left += multipart.abort_all(_run.out, [(n, u) for n, u in _run.owned.items() if n not in _run.reused])
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


def _drop_record(url: UrlPath) -> None:
    """Rank 0, once the completing object is there: the record goes (a kill in between leaves both: a
    complete result, which --resume then says it does not resume)."""
    with deferred():  # a signal during the removal finds the result complete, not interrupted
        rr.drop_record(url)
        _run.completed[:] = [u for u in _run.completed if u.name != rr.RECORD]
        _run.dropped = True


def _discard_open() -> None:
    """This rank's streams not completed: discarded (a whole file's upload aborted, a piece's parts in
    memory dropped)."""
    for s in _run.open:
        if s.url not in _run.completed:
            s.discard()


def _leave_for_resume() -> list[str]:
    """On an interrupt before the record went: this rank's parts in memory dropped; what was sent,
    completed or recorded stays, but the completing object, where this run completed it (OUT does not
    look complete: the run did not finish). What could not be removed."""
    _discard_open()
    for url in [u for u in _run.completed if u.name == _run.completing]:
        try:
            filesystem(url).rm_file(url.key)
        except FileNotFoundError:
            pass
        except Exception:
            return [str(url)]
    return []


def _aftermath(message: str, url: UrlPath, left: list[str], cleared: bool) -> str:
    if left:
        message += f"; could not remove {', '.join(left[:5])}" + (" and more" if len(left) > 5 else "")
        message += " (remove them yourself)"
    if cleared:
        message += f"; {url} no longer holds the previous result (--overwrite removed it)"
    return message
