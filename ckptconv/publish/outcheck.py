"""What OUT may be, checked before any work and again under the lock: never an input, never holding one
or inside one, never a name ckptconv keeps for itself; with `--overwrite`, only a directory that holds a
checkpoint (or nothing); a symlink at OUT is followed and its target written. Pure checks, no writes: a
checked local `Output` is published by `outdir` (both OUT kinds are a `publish.target.Target`).

Inputs are every path the command reads (SRC, each flag's file or directory, a hub snapshot's cache folder),
compared by identity: local paths by device and inode along every spelling (symlinks, bind mounts, `..`;
a file's hard links among OUT's entries), URLs by the object they name (`remote.urls.identity`: s3 and s3a
are one store), a `file://` URL as the local path it names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ckptconv.errors import CkptconvError
from ckptconv.formats.files import exists, refuse_url
from ckptconv.formats.names import OLD_SUFFIX, PARTIAL_SUFFIX, not_a_checkpoint
from ckptconv.job.world import World
from ckptconv.publish import outlock
from ckptconv.publish.outdir import absolute, atomically
from ckptconv.publish.remote_target import RemoteTarget
from ckptconv.publish.resume import Resume
from ckptconv.publish.target import LocalFiles, Target, quiet
from ckptconv.remote.urls import UrlPath, identity, location, url_path

if TYPE_CHECKING:
    from ckptconv.plan.types import Granularity, OutFile, Write

T = TypeVar("T")

Inputs = Sequence[tuple[str, Path | None]]  # (what it is, e.g. "SRC" or "--config"; its path)


def refuse_reserved(out: Path) -> None:
    """An OUT named like what ckptconv keeps beside an OUT (`.X.ckptconv-partial`, `-old`, `-lock`), or
    inside one, would be removed by a later run to X: refused."""
    reserved = (PARTIAL_SUFFIX, OLD_SUFFIX, outlock.LOCK_SUFFIX)
    for part in dict.fromkeys((out, *out.parents)):
        if part.name.endswith(reserved if part == out else (PARTIAL_SUFFIX, OLD_SUFFIX)):
            raise CkptconvError(
                f"{out}: {part.name} is a name ckptconv keeps for its own files beside an output, which a "
                "later run removes; choose another OUT"
            )


@dataclass(frozen=True)
class Output(LocalFiles):
    """Where a conversion writes: `path` is OUT with symlinks resolved; `note` says so when OUT was one."""

    path: Path
    overwrite: bool
    inputs: tuple[tuple[str, Path], ...] = ()
    flag: str = "--overwrite"
    note: str | None = None

    def check(self) -> None:
        """Refuse this OUT (see the module docstring). Pure checks, no writes; rank 0 repeats them under
        the lock."""
        for label, path in self.inputs:
            _check_not_input(self.path, label, path)
        check_out(self.path, self.overwrite, self.flag)

    # the rest is `publish.target.Target`: a local OUT is staged beside it and renamed into place (`outdir`)

    def granularity(self, asked: Granularity, quantize: bool) -> Granularity:
        """As asked: every rank can write its byte ranges of any local file."""
        return asked

    def notes(self, world_size: int, granularity: Granularity | None = None) -> list[str]:
        """That OUT is a symlink whose target is written, when it is one."""
        return [self.note] if self.note else []

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
        """Collective: `outdir.atomically` (`last` and `layout` are object storage's)."""
        return atomically(world, self, write, finish, check, say, fsync, resume)

    @property
    def local_path(self) -> Path | None:
        return self.path

    def names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir())


def target(
    out: Path, overwrite: bool, inputs: Inputs = (), flag: str = "--overwrite", main: bool = True
) -> Output:
    """The checked Output for OUT `out`; on rank 0 (`main`), also fail at once if a live run is writing it."""
    refuse_url(out, "OUT")
    refuse_reserved(absolute(out))
    real = _resolve_out(out)
    refuse_reserved(real)
    note = f"{out} is a symlink: writing into its target {real}" if out.is_symlink() else None
    result = Output(real, overwrite, located(inputs), flag, note)
    if main:
        outlock.peek(real)
    result.check()
    return result


def located(inputs: Inputs) -> tuple[tuple[str, Path], ...]:
    """The inputs that are given, each where it is (`remote.urls.location`: a `file://` URL is a path)."""
    return tuple((label, location(p, label)) for label, p in inputs if p is not None)


def mapping_input(mapping: str | None, flag: str = "--mapping") -> tuple[str, Path | None]:
    """A mapping that names a file (not a preset), as an input OUT must keep clear of."""
    path = location(mapping, flag) if mapping else None
    return flag, path if path is not None and not isinstance(path, UrlPath) and exists(path) else None


def _resolve_out(out: Path) -> Path:
    """OUT with every symlink resolved (parents too: one real path, so one lock, whatever the spelling)."""
    try:
        real = out.resolve()
    except (OSError, RuntimeError) as e:
        raise CkptconvError(f"{out}: cannot resolve its symlinks ({e}); choose another OUT") from None
    if out.is_symlink() and not real.exists():
        raise CkptconvError(
            f"{out}: is a symlink to {real}, which does not exist; create that directory or remove the link"
        )
    return real


def check_out(out: Path, overwrite: bool, flag: str = "--overwrite") -> None:
    """Refuse an OUT that is a file, or a non-empty directory that is not a checkpoint, or one without
    `overwrite`."""
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise CkptconvError(f"{out}: exists and is not a directory; choose another OUT")
    if not out.is_dir():
        return
    try:
        with os.scandir(out) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise CkptconvError(f"{out}: cannot list it ({e.strerror}); choose another OUT") from None
    if not entries:
        return
    foreign = not_a_checkpoint([(e.name, _shown(e), e.is_file(follow_symlinks=False)) for e in entries])
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CkptconvError(
            f"{out}: holds {shown}, not a checkpoint ({flag} replaces only a directory of regular files "
            "that holds safetensors / an index / DCP files and otherwise only an HF model's config and "
            "tokenizer files, or nothing); choose an empty or new OUT, or remove it yourself"
        )
    if not overwrite:
        raise CkptconvError(f"{out}: exists and is not empty; pass {flag} to replace it")


def _shown(e: os.DirEntry[str]) -> str:
    return e.name + ("@" if e.is_symlink() else "/" if e.is_dir() else "")


def _check_not_input(out: Path, label: str, path: Path) -> None:
    """OUT must not be `path`, contain it or be inside it (symlinks and bind mounts followed; a file's hard
    links among OUT's entries). An input in object storage is never inside a local OUT."""
    if url_path(path) is not None:
        return
    for what, real in ((label, path), *_linked(label, path)):
        inside, contains = _within(out, real), _within(real, out)
        if inside and contains:
            raise CkptconvError(f"{out}: is {what} {path} itself; OUT must never be an input")
        if contains:
            raise CkptconvError(f"{out}: contains {what} {real}; choose an OUT that holds no input")
        if inside:
            raise CkptconvError(f"{out}: is inside {what} {real}; choose an OUT outside the inputs")
    linked = _hard_link_in(out, path)
    if linked is not None:
        raise CkptconvError(
            f"{out}: holds {linked.name}, a hard link of {label} {path}; choose an OUT that holds no input"
        )


def _hard_link_in(out: Path, path: Path) -> Path | None:
    """The entry of directory `out` that is the file `path` under another name (a hard link), if any."""
    try:
        st = os.stat(path)
        if st.st_nlink < 2 or not os.path.isdir(out):
            return None
        with os.scandir(out) as it:
            for entry in it:
                with suppress(OSError):
                    if entry.is_file(follow_symlinks=False) and os.path.samestat(entry.stat(), st):
                        return Path(entry.path)
    except OSError:
        return None
    return None


def _url_not_input(out: UrlPath, label: str, path: Path) -> None:
    """A URL OUT must not be an input in object storage, hold one or lie inside one (--overwrite there
    would delete the source), compared by what they name (s3:// and s3a:// are one store). A local input
    is never under a URL."""
    src = url_path(path)
    if src is None:
        return
    a, b = identity(out), identity(src)
    if a == b:
        raise CkptconvError(f"{out}: is {label} {src} itself; OUT must never be an input")
    if b[: len(a)] == a:
        raise CkptconvError(f"{out}: holds {label} {src}; choose an OUT prefix that holds no input")
    if a[: len(b)] == b:
        raise CkptconvError(f"{out}: is inside {label} {src}; choose an OUT prefix outside the inputs")


def _linked(label: str, path: Path) -> list[tuple[str, Path]]:
    """What an input directory points to: its symlinked entries' targets, a hub snapshot's repo folder."""
    found: list[tuple[str, Path]] = []
    if path.parent.name == "snapshots":  # huggingface_hub's cache: models--org--name/snapshots/<rev>
        found.append((f"the cache folder of {label}", path.parent.parent))
    try:
        entries = list(path.iterdir()) if path.is_dir() else []
        found += [(f"{label}'s link target", e.resolve()) for e in entries if e.is_symlink()]
    except (OSError, RuntimeError):
        pass
    return found


def _within(inner: Path, outer: Path) -> bool:
    """`inner` is `outer` or inside it, compared by device and inode along both of `inner`'s spellings."""
    try:
        o = os.stat(outer)
    except OSError:
        return False
    lineage = [absolute(inner), *absolute(inner).parents]
    with suppress(OSError, RuntimeError):
        lineage += [inner.resolve(), *inner.resolve().parents]
    for p in dict.fromkeys(lineage):
        try:
            if os.path.samestat(os.stat(p), o):
                return True
        except OSError:
            continue
    return False



def hf_target(
    main: bool,
    out: Path,
    overwrite: bool,
    inputs: Inputs,
    push: bool,
    flag: str = "--overwrite",
    resume: bool = False,
) -> Target:
    """Where a conversion writes: a checked local OUT, or a prefix in object storage (checked on rank 0;
    `resume`: what an interrupted run left there passes), where --push-to-hub is refused by name."""
    out = location(out, "OUT")
    url = url_path(out)
    if url is None:
        return target(out, overwrite, inputs, flag, main=main)
    if push:
        raise CkptconvError(
            f"--push-to-hub with OUT {url}: pushing from object storage is not supported; write OUT to a "
            "local path to push it"
        )
    for label, path in located(inputs):
        _url_not_input(url, label, path)
    remote = RemoteTarget(url, overwrite, resume)
    if main:
        remote.check()
    return remote
