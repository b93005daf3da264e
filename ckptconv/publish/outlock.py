"""One writer per OUT: a lock file beside OUT, created atomically and held with `flock` while the run lives.

`.OUT.ckptconv-lock` holds JSON naming its run (pid, host, start time, command). It is made complete and
flocked under a temporary name first, then hard-linked into place, which fails if the name exists: so a lock
file is never seen half-written, and one that exists but whose flock is free belongs to a dead process (the
kernel releases a flock when its holder dies) and is taken over, provided it names this host and a process
that is gone (with NFS `local_lock=flock` a flock is not seen from other hosts). Only rank 0 takes it; it
covers preparing the staging directory, the rename into place (and `--overwrite`'s removal of the old OUT),
and the cleanup.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.files import write_failed
from ckptconv.remote.urls import redact

LOCK_SUFFIX = ".ckptconv-lock"
_ATTEMPTS = 50  # a takeover racing with ours: look again (each attempt sleeps 10 ms)
_HELD_ATTEMPTS = 3  # a held lock is looked at this many times first (a `peek` holds it for a moment)


def lock_path(out: Path) -> Path:
    """The lock file of OUT, beside it."""
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


@dataclass
class OutLock:
    """A held lock on one OUT; `release` removes the file and lets go."""

    path: Path
    fd: int
    took_over: dict[str, Any] | None = None  # the dead run whose stale lock this one replaced

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and drop the flock. Never raises."""
        if self.fd < 0:
            return
        with signals_held():
            try:
                if _same_file(self.path, self.fd):
                    self.path.unlink()
            except OSError:
                pass  # left behind, it is stale (no flock) and the next run takes it over
            finally:
                os.close(self.fd)
                self.fd = -1

    def note(self) -> str | None:
        """What to tell the user about a takeover, or None."""
        if self.took_over is None:
            return None
        return f"{self.path}: took over the lock of a ckptconv run that is gone ({describe(self.took_over)})"


@contextmanager
def signals_held() -> Iterator[None]:
    """Delay Ctrl-C, SIGTERM and SIGHUP (their handlers raise in the main thread) until the block is done:
    taking or letting go of the lock, and noting that it is held, happen whole or not at all."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def take(out: Path) -> OutLock:
    """Lock `out` for this run, or raise a CkptconvError naming the live run that holds it. Interrupted
    (a signal another thread let through `signals_held`) once the file is in place, it is removed again."""
    path = lock_path(out)
    mine = _make_tmp(path)
    try:
        return _place(out, path, mine)
    except BaseException:
        if mine.fd >= 0 and _same_file(path, mine.fd):
            with suppress(OSError):
                path.unlink()
        raise
    finally:
        mine.discard()


def _place(out: Path, path: Path, mine: _Tmp) -> OutLock:
    """Put the complete lock file `mine` at `path`: a new name, or over a dead run's lock."""
    for attempt in range(_ATTEMPTS):
        try:
            os.link(mine.tmp, path)
            return mine.hand_over(path, None)
        except FileExistsError:
            pass
        except OSError as e:
            raise _lock_error(path, e) from None
        stale = _try_stale(out, path, last=attempt >= _HELD_ATTEMPTS)
        if stale is not None:  # we hold the dead run's flock: put ours in its place
            try:
                os.replace(mine.tmp, path)
            except OSError as e:
                raise _lock_error(path, e) from None
            finally:
                os.close(stale[0])
            return mine.hand_over(path, stale[1])
        time.sleep(0.01)
    raise CkptconvError(f"{path}: could not take the lock of {out}; other runs keep taking it, retry")


def peek(out: Path) -> None:
    """Raise at once if a live run holds the lock of `out` (before any planning); takes nothing."""
    path = lock_path(out)
    try:
        fd = _open_lock(path, os.O_RDONLY)
    except OSError:
        return  # not ours to read: `take` says why
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _held(out, path, fd) from None
    except OSError:
        pass
    finally:
        os.close(fd)


def _open_lock(path: Path, flags: int) -> int | None:
    """An fd on the lock file at `path`, None if there is none; a FIFO, link, directory or device there is
    refused (opening never blocks, links are not followed)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        fd = -1
    try:
        regular = fd >= 0 and stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        if fd >= 0:
            os.close(fd)
        raise CkptconvError(
            f"{path}: is not a lock file ckptconv made (not a regular file); remove it, then run again"
        )
    return fd


def describe(info: dict[str, Any]) -> str:
    """`pid 123 on host h, started <time>: <command>`, from a lock file's JSON."""
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, float) else "?"
    command = str(info.get("command", "?"))
    if len(command) > 160:
        command = command[:157] + "..."
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {when}: {command}"


def read_info(fd: int) -> dict[str, Any]:
    """The JSON of an open lock file, {} when it cannot be read."""
    try:
        raw = os.pread(fd, 65536, 0)
        info = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def _held(out: Path, path: Path, fd: int, sure: bool = True) -> CkptconvError:
    """The error for a lock held by another run; `sure` is False where the file system has no flock."""
    info = read_info(fd)
    other_host = info.get("host") not in (None, socket.gethostname())
    if other_host or not sure:
        hint = f"; wait for it to finish, or if it is gone, remove {path}"
    else:
        hint = "; wait for it to finish or stop it"
    return CkptconvError(f"{out}: another ckptconv run is writing it ({describe(info)}){hint}")


def _lock_error(path: Path, e: OSError) -> CkptconvError:
    """A write error on the lock, named by the lock file (not the temporary name it was made under)."""
    return write_failed(path, OSError(e.errno, e.strerror))


def _try_stale(out: Path, path: Path, last: bool) -> tuple[int, dict[str, Any]] | None:
    """(fd with the flock, its JSON) when the lock at `path` belongs to a dead run; raise when it is live
    (on the `last` look) or may be; None when it changed under us or is held for now (look again)."""
    fd = _open_for_flock(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not last or not _same_file(path, fd):
            os.close(fd)
            return None  # replaced meanwhile by a run taking over a stale lock, or peeked at: look again
        error = _held(out, path, fd)
        os.close(fd)
        raise error from None
    except OSError:  # no flock on this file system: the lock file alone says a run holds OUT
        error = _held(out, path, fd, sure=False)
        os.close(fd)
        raise error from None
    if not _same_file(path, fd):  # unlinked or replaced after we opened it
        os.close(fd)
        return None
    info = read_info(fd)
    refusal = _maybe_alive(out, path, info)
    if refusal is not None:
        os.close(fd)
        raise refusal
    return fd, info


def _open_for_flock(path: Path) -> int | None:
    """The lock file opened read-write (NFS emulates flock with byte-range locks, which need write access),
    read-only where we may not write it; None if it is gone."""
    try:
        try:
            return _open_lock(path, os.O_RDWR)
        except PermissionError:
            return _open_lock(path, os.O_RDONLY)
    except OSError as e:
        raise _lock_error(path, e) from None


def _maybe_alive(out: Path, path: Path, info: dict[str, Any]) -> CkptconvError | None:
    """The error when a lock whose flock is free may still belong to a live run: one on another host (with
    NFS `local_lock=flock` a flock is only seen on its own host), or one whose process is still there."""
    host, pid = info.get("host"), info.get("pid")
    if isinstance(host, str) and host != socket.gethostname():
        return CkptconvError(
            f"{out}: the lock {path} belongs to a ckptconv run on host {host} (pid {pid}), which this host "
            f"cannot check; wait for it to finish, or once it is gone, remove {path}"
        )
    # this process's own leftover (a failed unlink) is stale: its flock is free, so no lock of ours holds it
    if isinstance(pid, int) and pid > 0 and pid != os.getpid() and alive(pid):
        return CkptconvError(
            f"{out}: the lock {path} names a run whose process is still there ({describe(info)}); wait for "
            f"it to finish, or if that process is not ckptconv, remove {path}"
        )
    return None


def alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@dataclass
class _Tmp:
    tmp: Path
    fd: int

    def hand_over(self, path: Path, took_over: dict[str, Any] | None) -> OutLock:
        """The lock, now placed at `path`: the temporary name is removed, the fd becomes the lock's last."""
        with suppress(OSError):
            self.tmp.unlink()
        lock = OutLock(path, self.fd, took_over)
        self.fd = -1
        return lock

    def discard(self) -> None:
        if self.fd >= 0:
            with suppress(OSError):
                self.tmp.unlink()
            os.close(self.fd)
            self.fd = -1


def run_info() -> dict[str, Any]:
    """What a lock says of the run holding it."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": redact(_without_options(sys.argv))[:512],
    }


def _make_tmp(path: Path) -> _Tmp:
    """A complete lock file under a unique temporary name beside `path`, flocked by this process."""
    tmp = path.parent / f"{path.name}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}"
    info = run_info()
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    except OSError as e:
        raise _lock_error(path, e) from None
    made = _Tmp(tmp, fd)
    try:
        with suppress(OSError):  # no flock here: the file alone is the lock
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        data = (json.dumps(info) + "\n").encode()
        if os.write(fd, data) != len(data):
            raise OSError(28, os.strerror(28))
    except OSError as e:
        made.discard()
        raise _lock_error(path, e) from None
    return made


def _without_options(argv: list[str]) -> str:
    """The command line as the lock shows it to other runs, `--storage-options` (credentials) left out."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            shown.append("...")
        elif arg.startswith("--storage-options="):
            shown.append("--storage-options=...")
        else:
            shown.append(arg)
        skip = arg == "--storage-options"
    return " ".join(shown)
