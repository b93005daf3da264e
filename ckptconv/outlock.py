"""One writer per OUT: a lock file beside OUT, created atomically and held with `flock` while the run lives.

`.OUT.ckptconv-lock` holds JSON naming its run (pid, host, start time, command). It is made complete and
flocked under a temporary name first, then hard-linked into place, which fails if the name exists: so a lock
file is never seen half-written, and one that exists but whose flock is free belongs to a dead process (the
kernel releases a flock when its holder dies) and is taken over. Only rank 0 takes it; it covers preparing
the staging directory, the rename into place (and `--overwrite`'s removal of the old OUT), and the cleanup.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CkptconvError

LOCK_SUFFIX = ".ckptconv-lock"
_ATTEMPTS = 50  # a takeover racing with ours: look again (each attempt sleeps 10 ms)
_HELD_ATTEMPTS = 3  # a held lock is looked at this many times first (a `peek` holds it for a moment)


def lock_path(out: Path) -> Path:
    """The lock file of OUT, beside it."""
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def write_failed(path: object, e: OSError) -> CkptconvError:
    """The one-line error for a failed write: the file and the cause."""
    where = e.filename if e.filename is not None else path
    cause = e.strerror or type(e).__name__
    return CkptconvError(f"{where}: cannot write ({cause}); check free space and permissions")


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
    """Lock `out` for this run, or raise a CkptconvError naming the live run that holds it."""
    path = lock_path(out)
    mine = _make_tmp(path)
    try:
        for attempt in range(_ATTEMPTS):
            try:
                os.link(mine.tmp, path)
                return OutLock(path, mine.release_tmp())
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
                return OutLock(path, mine.release_tmp(), stale[1])
            time.sleep(0.01)
        raise CkptconvError(f"{path}: could not take the lock of {out}; other runs keep taking it, retry")
    finally:
        mine.discard()


def peek(out: Path) -> None:
    """Raise at once if a live run holds the lock of `out` (before any planning); takes nothing."""
    path = lock_path(out)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock, or not ours to read: `take` says why
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _held(out, path, fd) from None
    except OSError:
        pass
    finally:
        os.close(fd)


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
    except (OSError, ValueError):
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
    (on the `last` look); None when it changed under us or is held for now (look again)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _lock_error(path, e) from None
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
    return fd, read_info(fd)


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

    def release_tmp(self) -> int:
        """The fd, now the lock's: the temporary name is removed, the file stays under the lock's name."""
        fd, self.fd = self.fd, -1
        with suppress(OSError):
            self.tmp.unlink()
        return fd

    def discard(self) -> None:
        if self.fd >= 0:
            with suppress(OSError):
                self.tmp.unlink()
            os.close(self.fd)
            self.fd = -1


def _make_tmp(path: Path) -> _Tmp:
    """A complete lock file under a unique temporary name beside `path`, flocked by this process."""
    tmp = path.parent / f"{path.name}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}"
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": " ".join(sys.argv)[:512],
    }
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
