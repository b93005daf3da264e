"""Atomic output directories: write into a hidden staging directory beside OUT, rename it at the end.

While a conversion runs nothing at OUT changes, so OUT never looks finished before it is; an interrupted run
leaves only `.OUT.ckptconv-partial` beside it, which the next run replaces. One run writes an OUT at a time
(`outlock`); what OUT may be is `outcheck`'s. Rank 0 owns every step here; the other ranks only write files
inside the staging directory. Unless `fsync=False` (`--no-fsync`), what is published is on the device first
(`durable`): every file and directory of the staging tree before the rename, OUT's parent after it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from ckptconv.errors import CkptconvError
from ckptconv.formats import durable
from ckptconv.formats.files import write_failed
from ckptconv.formats.names import OLD_SUFFIX, PARTIAL_SUFFIX
from ckptconv.job.world import World, collective_failure, everyone, on_main
from ckptconv.publish import outlock
from ckptconv.publish.resume import Resume, drop_records

T = TypeVar("T")


class Checked(Protocol):
    """The OUT `atomically` publishes (`outcheck.Output`): its real path, and its checks, which rank 0
    repeats under the lock."""

    @property
    def path(self) -> Path: ...

    def check(self) -> None: ...


def absolute(p: Path) -> Path:
    return Path(os.path.abspath(p))


def staging_dir(out: Path) -> Path:
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def old_dir(out: Path) -> Path:
    return out.parent / f".{out.name}{OLD_SUFFIX}"


def recover(out: Path) -> None:
    """Rank 0, holding the lock, before checking OUT: a previous OUT that a run killed while publishing had
    moved aside (where the file system cannot swap directories) is put back when OUT is missing or an empty
    directory, and removed only when OUT holds something (the result that run moved into place)."""
    old = old_dir(out)
    try:
        if not old.exists():
            return
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():
            shutil.rmtree(old)
        else:
            old.rename(out)
    except OSError as e:
        raise CkptconvError(
            f"{e.filename or old}: cannot clean up ({e.strerror}); move {old} back to {out} or remove it "
            "yourself"
        ) from None


def prepare(out: Path) -> Path:
    """Rank 0, holding the lock: an empty staging directory for `out`, of mode 0700 while it is written (a
    `--resume` trusts no other: `publish_mode` gives it the mode a new directory gets before it is published).
    A stale one from a killed run is removed; a symlink in its place is removed itself, never its target."""
    staging = staging_dir(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if staging.is_symlink() or (os.path.lexists(staging) and not staging.is_dir()):
            staging.unlink()
        elif staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(mode=0o700)
        os.chmod(staging, (os.lstat(staging).st_mode & stat.S_ISGID) | 0o700)  # whatever the umask
    except OSError as e:
        raise CkptconvError(
            f"{e.filename or staging}: cannot create ({e.strerror}); check permissions and free space"
        ) from None
    return staging


def publish_mode(staging: Path) -> None:
    """Rank 0: give the staging directory (0700 while written) the mode `mkdir` gives a new directory under
    this process's umask (a set-group-ID bit it inherited kept), the mode OUT had before --resume."""
    mode = stat.S_IMODE(os.lstat(staging).st_mode) & stat.S_ISGID
    os.chmod(staging, mode | (0o777 & ~_umask()))


def _umask() -> int:
    """This process's umask (from /proc where it says, so no other thread sees it changed)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish(staging: Path, out: Path, fsync: bool = True) -> None:
    """Rank 0, holding the lock: move the finished `staging` to `out`, replacing what was there.

    An existing OUT is swapped with the staging directory in one step (renameat2 RENAME_EXCHANGE), so OUT
    is always one complete result; where the file system cannot swap, OUT is moved aside and the result
    moved in, with signals held in between (a failure puts OUT back). With `fsync`, OUT's parent is
    fsynced once the result is in place: the rename itself survives a power loss. The previous OUT is
    removed after."""
    previous: Path | None = None
    try:
        with outlock.signals_held():
            if not out.exists():
                staging.rename(out)
            elif _exchange(staging, out):
                previous = staging
            else:
                previous = _swap_by_moving(staging, out)
    except OSError as e:
        raise CkptconvError(
            f"{out}: cannot move the result into place ({e.strerror}); check permissions"
        ) from None
    if fsync:
        durable.sync_dir(out.parent)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def _swap_by_moving(staging: Path, out: Path) -> Path:
    """Move `out` aside to its old name and `staging` in its place; the old name, to remove. Where the second
    move fails, OUT is moved back (or the error says where it is)."""
    old = old_dir(out)
    if old.exists():
        shutil.rmtree(old)
    out.rename(old)
    try:
        staging.rename(out)
    except OSError as e:
        try:
            old.rename(out)
            where = "the previous OUT is back; check permissions"
        except OSError:
            where = f"nor the previous OUT back: move {old} back to {out} yourself"
        cause = f"cannot move the result {staging} into place ({e.strerror})"
        raise CkptconvError(f"{out}: {cause}; {where}") from None
    return old


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` atomically; False where the C library or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def discard(out: Path, patience_s: float = 10.0) -> None:
    """Rank 0: remove the staging directory of `out` after a failure. Under torchrun a signal reaches every
    rank at once, and another rank may still be closing a file inside while this one removes it, so the
    removal is tried again until the directory is gone (or `patience_s` has passed)."""
    with outlock.signals_held():  # torchrun's SIGTERM after a Ctrl-C must not leave it half removed
        _remove_patiently(staging_dir(out), patience_s)


def _remove_patiently(staging: Path, patience_s: float) -> None:
    """Remove `staging`, again and again while another rank may still write into it."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            shutil.rmtree(staging)
            return
        except FileNotFoundError:
            if not staging.exists():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            shutil.rmtree(staging, ignore_errors=True)
            return
        time.sleep(0.05)


def writing(fn: Callable[[Path], T]) -> Callable[[Path], T]:
    """`fn(staging)` with any OSError turned into the one-line write error naming the file."""

    def run(staging: Path) -> T:
        try:
            return fn(staging)
        except OSError as e:
            raise _os_error(staging, e) from None

    return run


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def _os_error(staging: Path, e: OSError) -> CkptconvError:
    """A write error naming the file written; an error on a file outside the staging directory (and not
    one only writing gives) is an input's, named as such. shutil names the source first, the copy second."""
    names = [Path(os.fsdecode(n)) for n in (e.filename2, e.filename) if isinstance(n, (str, bytes))]
    ours = [n for n in names if absolute(n).is_relative_to(absolute(staging))]
    if ours or not names or e.errno in _WRITE_ERRNOS:
        where = ours[0] if ours else (names[0] if names else staging)
        return write_failed(where, OSError(e.errno, e.strerror))
    cause = e.strerror or type(e).__name__
    return CkptconvError(f"{names[-1]}: cannot read ({cause}); check that it exists and is readable")


def atomically(
    world: World,
    out: Checked,
    write: Callable[[Path], object],
    finish: Callable[[Path], T],
    check: Callable[[Path], None] | None = None,
    say: Callable[[str], None] = lambda message: None,
    fsync: bool = True,
    resume: Resume | None = None,
) -> T | None:
    """Collective: rank 0 locks OUT, checks it again and makes the staging directory; every rank `write`s
    into it, rank 0 `finish`es it (index, stash, copied files), every rank `check`s it (verify), then rank 0
    renames it into place and lets the lock go. On any rank's failure or a failed check, rank 0 removes the
    staging directory and every rank raises: OUT is either the complete, checked result or untouched. With
    `fsync`, `write` fsyncs each file it writes before it returns (so before the ranks agree it is done),
    rank 0 fsyncs what `finish` wrote and every directory of the staging tree after it, and OUT's parent
    after the rename: after this returns, the result survives a power loss.

    `resume` (the writers record each file they finish): an interrupt (a signal, or a rank that died under
    it) keeps the staging directory when its records say some files are complete, for a later `--resume`;
    with `resume.asked`, rank 0 keeps the complete files of an earlier run's staging directory instead of
    making an empty one, and every rank learns which (`resume.kept`)."""
    lock: outlock.OutLock | None = None
    refused = False  # --resume refused the staging directory: it is left as it is

    def begin() -> frozenset[str]:
        nonlocal lock, refused
        durable.make_dirs(out.path.parent, fsync)
        with outlock.signals_held():  # an interrupt comes after `lock` is set, so it is let go
            lock = outlock.take(out.path)
        note = lock.note()
        if note:
            say(note)
        recover(out.path)
        out.check()  # again, now that no other run can change OUT
        if resume is not None and resume.asked:
            refused = True
            kept = resume.keep(staging_dir(out.path), fsync)
            refused = False
            if kept:
                return kept
        prepare(out.path)
        return frozenset()

    def finish_durably(staging: Path) -> T:
        written = durable.tree(staging)[0] if fsync else set()  # the ranks' files, each fsynced already
        result = finish(staging)
        # every file is written: OUT holds no records (removed after `finish`, so that their space is not
        # what `finish` writes into: a disk too small for it fails on the file `finish` writes, as before)
        drop_records(staging)
        publish_mode(staging)
        if fsync:
            durable.seal(staging, written)  # what `finish` wrote, and the directories
        return result

    staging = staging_dir(out.path)
    try:
        kept = on_main(world, begin)
        if resume is not None and resume.asked:
            resume.kept = frozenset(world.broadcast_object(kept))
        everyone(world, writing(write), staging)
        result = on_main(world, writing(finish_durably), staging)
        if check is not None:
            check(staging)  # collective, agrees by itself
        on_main(world, publish, staging, out.path, fsync)
        return world.all_gather_object(result)[0]
    except BaseException as e:
        if lock is not None and not refused and not _kept(e, resume, staging):
            discard(out.path)
        raise
    finally:
        if lock is not None:
            lock.release()


def _kept(error: BaseException, resume: Resume | None, staging: Path) -> bool:
    """Rank 0, on a failure: whether the staging directory stays for a `--resume` (the run was interrupted,
    by a signal or a rank killed, and its records say some files are complete; the line says so)."""
    died = collective_failure(error, 0, 0) is not None
    if resume is None or not (isinstance(error, KeyboardInterrupt) or died):
        return False
    complete = resume.complete(staging)
    if not complete:
        return False
    resume.warn(
        f"kept {staging} ({complete} complete file{'s' if complete != 1 else ''} recorded so far): rerun "
        "with --resume to write only the rest (without it, the run starts over and removes it)"
    )
    return True
