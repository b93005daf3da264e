"""A run's uploads into object storage: what each process keeps of them (`Run`), how they start in S3 (rank
0 records a run that can be resumed under OUT before any byte is sent: `start_parts`, `start_whole`), and
what `--resume` keeps of an interrupted one (`resumed`, from remote_resume's checks). remote_out drives them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ckptconv.job.signals import deferred
from ckptconv.job.world import World, from_main, on_main
from ckptconv.publish import multipart
from ckptconv.publish import remote_resume as rr
from ckptconv.publish.parts import Piece, plan_pieces
from ckptconv.publish.remote_lock import NAME as LOCK_NAME
from ckptconv.publish.upload import Ledger, Stream
from ckptconv.remote.files import RemoteFiles, forget
from ckptconv.remote.urls import UrlPath

if TYPE_CHECKING:
    from ckptconv.plan.types import OutFile, Write
    from ckptconv.publish.resume import Resume


def listing(url: UrlPath) -> dict[str, int]:
    """{name: size} of the objects under `url`, listed afresh (no cached listing)."""
    forget(url)
    return {n: size for n, size in RemoteFiles(url).sizes().items() if n != LOCK_NAME}  # a bucket's lock


class Run(Ledger):
    """This process's objects of the current run: completed, held open, and what could not be removed."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[Stream | multipart.PartStream] = []
        self.completing = ""
        self.local: Path | None = None  # rank's temporary directory: small files, hf-to-dcp's .metadata
        self.uploads: dict[str, str] = {}  # S3: {file: upload id}
        self.owned: dict[str, str] = {}  # rank 0: those uploads it has not completed yet
        self.out: UrlPath | None = None
        self.pieces: dict[str, Piece] = {}  # this rank's piece of each file
        self.sizes: dict[str, tuple[int, int]] = {}  # rank 0: {file: (its bytes, its parts)}
        self.tags: multipart.Tags = {}  # this rank's parts sent
        self.last_tags: list[tuple[int, str]] | None = None  # rank 0: the completing file's, once gathered
        self.resumable = False  # an interrupt leaves what was sent for a --resume (remote_resume)
        self.dropped = False  # the record removed: the result is complete
        self.reused: set[str] = set()  # --resume: the uploads an interrupted run started, gone on with
        self.kept_parts: dict[str, dict[int, str]] = {}  # --resume: {file: {part: ETag}} not sent again
        self.tag: Callable[[str], str] | None = None  # a DCP run that can be resumed: each upload's tag



def resumed(
    run: Run,
    url: UrlPath, resume: Resume, layout: tuple[Sequence[OutFile], Sequence[Write]] | None, ranks: int
) -> rr.Kept | None:
    """Rank 0, holding the lock, with --resume: what it keeps of the interrupted run under OUT, or None
    where there is no record of one (OUT is then checked as without --resume; a note says so). `layout`
    None: a DCP's data files (hf-to-dcp), kept whole."""
    record = rr.read_record(url)
    if record is None:
        resume.info(f"--resume: no record of an interrupted run under {url}; writing every file")
        return None
    names = sorted(listing(url))
    if layout is None:
        whole = rr.resumed_whole(url, record, resume.fingerprint, ranks, resume.sizes, names, run.completing)
        resume.info(
            f"--resume: {len(whole.whole)} data files kept from the interrupted run under {url}; writing the "
            "rest"
        )
        return whole
    kept = rr.resumed(url, record, resume.fingerprint, ranks, *layout, names, run.completing)
    resume.info(
        f"--resume: {len(kept.whole)} of {len(layout[0])} files kept whole and {kept.count()} parts of "
        f"{len(kept.uploads)} uploads from the interrupted run under {url}; sending the rest"
    )
    return kept


def start_parts(
    run: Run,
    world: World,
    url: UrlPath,
    files: Sequence[OutFile],
    writes: Sequence[Write],
    kept: rr.Kept | None,
    fingerprint: tuple[str, str, str] | None,
) -> None:
    """Every rank: the uploads rank 0 starts (those `kept` goes on with are not started again; the files
    it keeps whole have none), and this rank's pieces. With a `fingerprint` (a run that can be resumed):
    each upload carries it, and rank 0 records the run under OUT before any part is sent."""
    resuming = kept is not None  # an interrupted run's record is there: it stays whatever happens
    kept = kept or rr.Kept()
    pieces = [p for p in plan_pieces(files, writes) if p.file not in kept.whole]
    run.out = url
    run.reused = set(kept.uploads)
    run.kept_parts = kept.parts

    def start() -> dict[str, str]:
        todo = [f.name for f in files if f.name not in kept.whole and f.name not in kept.uploads]
        tag = (lambda name: rr.tag(fingerprint, name)) if fingerprint is not None else None
        # (`start` aborts what it started on a failure: only this run's uploads, never those kept)
        ids = {**kept.uploads, **multipart.start(url, todo, run.owned, tag)}
        run.owned.update(kept.uploads)
        if fingerprint is not None:
            with deferred():  # the record, what removes it on a failure and the run's resumability: one step
                rr.put_record(url, fingerprint, world.size, ids)
                if not resuming:  # a new record: a failure removes it with the rest
                    run.completed.append(url / rr.RECORD)
                run.resumable = True
        return ids

    run.uploads = from_main(world, start)
    run.pieces = {p.file: p for p in pieces if p.rank == world.rank}
    run.sizes = multipart.totals(pieces)


def start_whole(
    run: Run, world: World, url: UrlPath, resuming: bool, fingerprint: tuple[str, str, str]
) -> None:
    """Every rank, a run whose files are each one rank's upload (hf-to-dcp) that can be resumed: rank 0
    records the run under OUT before any file is written (its record stays whatever happens when
    `resuming`), and every upload carries the fingerprint with its own name."""
    run.out = url
    run.tag = lambda name: rr.tag(fingerprint, name)

    def record() -> None:
        with deferred():  # the record, what removes it on a failure and the run's resumability: one step
            rr.put_record(url, fingerprint, world.size, {})
            if not resuming:
                run.completed.append(url / rr.RECORD)
            run.resumable = True

    on_main(world, record)
    run.resumable = True
