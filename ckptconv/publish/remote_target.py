"""An OUT prefix in object storage as a `publish.target.Target`: checked before any work, cleared
(--overwrite), written and completed by `remote_out`, resumed by `remote_resume`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ckptconv.errors import CkptconvError
from ckptconv.formats.names import not_a_checkpoint
from ckptconv.formats.sinks import ObjectStore, PositionedSink
from ckptconv.job.world import World
from ckptconv.publish import multipart, remote_out
from ckptconv.publish import remote_resume as rr
from ckptconv.publish.remote_lock import peek as peek_lock
from ckptconv.publish.remote_run import listing
from ckptconv.publish.target import quiet
from ckptconv.publish.upload import Stream
from ckptconv.remote.files import forget
from ckptconv.remote.urls import UrlPath, filesystem, redact, url_path

if TYPE_CHECKING:
    from ckptconv.plan.types import Granularity, OutFile, Write
    from ckptconv.publish.resume import Resume

T = TypeVar("T")


@dataclass(frozen=True)
class RemoteTarget:
    """An OUT prefix in object storage (a `publish.target.Target`), written in place and completed last."""

    url: UrlPath
    """OUT."""
    overwrite: bool
    """--overwrite: a previous result there is replaced."""
    resume: bool = False
    """--resume: what an interrupted run left there is gone on with (checked again under the lock)."""

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
            (n.split("/")[0], n.split("/")[0] + ("/" if "/" in n else ""), "/" not in n)
            for n in names
            if n != rr.RECORD
        }
        foreign = not_a_checkpoint(sorted(entries))
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise CkptconvError(
                f"{self.url}: holds {shown}, not a checkpoint (--overwrite replaces only a previous result); "
                "choose an empty or new prefix, or remove them yourself"
            )
        if rr.RECORD in names and self.resume:
            return names
        if rr.RECORD in names and not self.overwrite:
            raise CkptconvError(
                f"{self.url}: holds what an interrupted run wrote ({rr.RECORD}); rerun with "
                "--resume to write only the rest, or with --overwrite to start over"
            )
        if names and self.resume and not self.overwrite:
            raise CkptconvError(
                f"{self.url}: --resume: holds no record of an interrupted run ({rr.RECORD}), so nothing to "
                "resume; pass --overwrite instead to replace what it holds"
            )
        if names and not self.overwrite:
            raise CkptconvError(f"{self.url}: exists and is not empty; pass --overwrite to replace it")
        return names

    def clear(self) -> bool:
        """Rank 0, before writing: with --overwrite, the previous result's completing object goes first,
        then the rest of it; whether there was one."""
        names = self._checked()
        fs = filesystem(self.url)
        # uploads left in progress under OUT (an interrupted run's, or one killed before its record): aborted
        if (names or self.overwrite) and multipart.supported(self.url):
            listed = rr.in_progress(self.url)
            left = multipart.abort_all(self.url, [(n, u) for n, ids in listed.items() for u in ids])
            if left:
                shown = ", ".join(left[:5])
                raise CkptconvError(f"{self.url}: cannot abort {shown} (--overwrite); abort them yourself")
        first = [n for n in remote_out.COMPLETING if n in names]
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
        return remote_out.stream(self._under(path))

    def store(self) -> ObjectStore | None:
        return self

    def whole(self, path: Path) -> Stream:
        """`ObjectStore`'s: the upload of all of `path` (under OUT) by this rank."""
        return remote_out.whole(self._under(path))

    def local_dir(self) -> Path:
        """`ObjectStore`'s: the run's local temporary directory."""
        return remote_out.local_dir()

    def written(self, staging: Path, files: str) -> int:
        return remote_out.bytes_written()  # a rank's streams are its data files

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
        """Collective: `remote_out.publish` (`say` and `fsync` are a local OUT's; `resume`: in S3, see
        remote_resume)."""
        return remote_out.publish(world, self.url, self.clear, last, write, finish, check, layout, resume)

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
