"""The `Target` a conversion writes to, a local directory (`outcheck.Output`) or a prefix in object storage
(`remote_target.RemoteTarget`): each answers how it is written and how it is published, so no caller asks
which.

Call order (every call collective unless a rank is named; under torchrun the same arguments on every rank):

  1) (all ranks) `outcheck.hf_target(...)` makes the Target and checks OUT (`check()`): a local OUT on every
     rank, an OUT in object storage on rank 0 (one listing); `granularity(asked, quantize)` is how the plan
     may split the files among ranks (in S3, "parts": every rank uploads its pieces of every file);
  2) (any rank; Ui prints rank 0's) `notes(world_size, granularity)`: what to say before writing;
  3) (all ranks) `publish(world, write, finish, check, last=..., layout=..., say=..., fsync=...)`:
     a) (rank 0) takes OUT's lock and checks OUT again under it (a local OUT: makes the staging directory;
        with --overwrite in object storage: removes the previous result, its completing object first);
     b) (all ranks) `write(staging)`: each rank's data files, into a hidden staging directory beside a local
        OUT or into OUT's URL itself, through `sink(path)` (a safetensors file) or `store()` (torch's DCP
        writer), counted by `written(...)`;
     c) (all ranks) `check(staging)`, (rank 0) `finish(dir)` (index, stash, copied files; in object storage
        made in a local temporary directory and uploaded), in the order the target can read its files back:
        a local OUT finishes first, then checks the staging directory; object storage checks first when
        `last` is the index, else once `last` is complete (a one-file result, a DCP's `.metadata`);
     d) publishes: (rank 0) a local staging directory renamed into place; in object storage the completing
        object `last`, completed last (by the rank holding its upload, or rank 0). On any failure what this
        run wrote is removed and every rank raises;
  4) (rank 0) `local_path`: the published result on this machine (what --push-to-hub uploads), or None;
     `names()`: what OUT holds once published.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from ckptconv.formats.sinks import ObjectStore, PositionedSink
from ckptconv.job.world import World

if TYPE_CHECKING:
    from ckptconv.plan.types import Granularity, OutFile, Write
    from ckptconv.publish.resume import Resume

T = TypeVar("T")


def quiet(message: str) -> None:
    """Say nothing (`publish`'s `say` by default)."""


class Sinks(Protocol):
    """How a rank's data files are written into a target's staging: what the stream writers ask."""

    def sink(self, path: Path) -> PositionedSink | None:
        """This rank's sink for the data file `path` (SafetensorsWriter's); None: a local file, written as
        such."""

    def store(self) -> ObjectStore | None:
        """What torch's DCP writer streams its data files to; None: local files."""

    def written(self, staging: Path, files: str) -> int:
        """The bytes of the data files (the glob `files` in `staging`) this rank wrote in this run."""


class Target(Sinks, Protocol):
    """Where a conversion writes (see the module docstring for the call order)."""

    def check(self) -> None:
        """Refuse this OUT (`outcheck`, `remote_out`): pure checks, repeated under the lock by `publish`."""

    def granularity(self, asked: Granularity, quantize: bool) -> Granularity:
        """The write granularity this OUT takes when `asked` (a remote OUT may force "parts" or "file")."""

    def notes(self, world_size: int, granularity: Granularity | None = None) -> list[str]:
        """What to tell the user before writing (a symlink followed; files uploaded whole by one rank)."""

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
        """Collective: write, finish, check and publish OUT (step 3 of the module docstring); rank 0's
        `finish` result, on every rank. `last`: the file that makes OUT complete in object storage (the
        index, `.metadata` or the one data file); `layout`: the plan's (files, writes), for S3's parts;
        `say` and `fsync`: a local OUT's (the lock's notes; fsync all that is published); `resume`: the
        fingerprint and records of a resumable run (`publish.resume`; in S3 `remote_resume`; other stores
        refuse --resume before this)."""

    @property
    def local_path(self) -> Path | None:
        """The published OUT on this machine (what --push-to-hub uploads); None in object storage."""

    def names(self) -> list[str]:
        """The names OUT holds (a directory's entries, the objects under a prefix), listed afresh, sorted."""


class LocalFiles:
    """Sinks of a local OUT (`outcheck.Output`): its data files are local files, written as such."""

    def sink(self, path: Path) -> PositionedSink | None:
        return None

    def store(self) -> ObjectStore | None:
        return None

    def written(self, staging: Path, files: str) -> int:
        return sum(p.stat().st_size for p in staging.glob(files))

