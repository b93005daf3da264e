"""One writer per OUT prefix in object storage: a lock object beside it, put only if it does not exist.

`s3://bucket/.release.ckptconv-lock` (for OUT `s3://bucket/release`; `.ckptconv-lock` inside a bucket
that is OUT itself, which OUT's checks then pass over) holds JSON naming its run (pid, host, start time,
command), put with the store's create-only write (S3's `If-None-Match: *`, fsspec's mode "xb"), which fails
when the object exists: of two runs, one gets it. Rank 0 takes it before clearing OUT and removes it when
the run ends, whatever the outcome. A run killed outright (SIGKILL, a lost node) leaves it behind: the next
run on the same host takes it over once the process it names is gone; one from another host is named in the
error, with the object to remove once that run is gone. A store without create-only writes is checked for
the object first instead (two runs starting at the same moment can then both go on).
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.remote.urls import UrlPath, filesystem, redact

NAME = ".ckptconv-lock"


def lock_url(out: UrlPath) -> UrlPath:
    """The lock object of OUT: beside it, or inside a bucket that is OUT."""
    return out / NAME if "/" not in out.key.strip("/") else out.parent / f".{out.name}{NAME}"


@dataclass
class RemoteLock:
    url: UrlPath
    took_over: dict[str, Any] | None = None  # the dead run whose lock this one replaced

    def release(self) -> None:
        """Remove the lock object. Never raises: a lock left behind is taken over by the next run here."""
        with suppress(Exception):
            filesystem(self.url).rm_file(self.url.key)


def take(out: UrlPath) -> RemoteLock:
    """Rank 0: the lock of `out`, or a CkptconvError naming the run that holds it."""
    from ckptconv.publish.outlock import run_info

    url = lock_url(out)
    fs = filesystem(url)
    data = (json.dumps(run_info()) + "\n").encode()
    took_over = None
    for _ in range(2):
        try:
            _put_new(fs, url, data)
            return RemoteLock(url, took_over)
        except FileExistsError:
            pass
        except Exception as e:
            raise CkptconvError(
                redact(f"{url}: cannot write the lock of {out} ({type(e).__name__}: {e})")
            ) from None
        info = _read(fs, url)
        if took_over is not None or not _stale(info):
            raise _held(out, url, info)
        took_over = info
        try:
            fs.rm_file(url.key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise CkptconvError(
                redact(f"{url}: cannot remove a dead run's lock ({type(e).__name__}: {e})")
            ) from None
    raise _held(out, url, _read(fs, url))


def peek(out: UrlPath) -> None:
    """Raise as `take` would if a live run holds the lock of `out` now (a check before any work)."""
    url = lock_url(out)
    fs = filesystem(url)
    try:
        if not fs.exists(url.key):
            return
    except Exception:
        return  # `take` says what is wrong
    info = _read(fs, url)
    if not _stale(info):
        raise _held(out, url, info)


# fsspec file systems whose mode "xb" is a create-only write on the store itself (s3fs: If-None-Match)
CREATE_ONLY = frozenset({"s3", "s3a"})


def _put_new(fs: Any, url: UrlPath, data: bytes) -> None:
    """Put `data` at `url` unless an object is there (FileExistsError): with the store's create-only
    write where it has one (`CREATE_ONLY`), else after looking."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if CREATE_ONLY.intersection(protocols):
        with fs.open(url.key, "xb") as f:
            f.write(data)
        return
    if fs.exists(url.key):
        raise FileExistsError(url.key)
    fs.pipe_file(url.key, data)


def _read(fs: Any, url: UrlPath) -> dict[str, Any]:
    try:
        info = json.loads(fs.cat_file(url.key))
    except Exception:
        return {}
    return info if isinstance(info, dict) else {}


def _stale(info: dict[str, Any]) -> bool:
    """A lock of a process of this host that is gone (or of this very process: a leftover)."""
    from ckptconv.publish.outlock import alive

    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    return pid == os.getpid() or not alive(pid)


def _held(out: UrlPath, url: UrlPath, info: dict[str, Any]) -> CkptconvError:
    from ckptconv.publish.outlock import describe

    here = info.get("host") == socket.gethostname()
    hint = (
        "wait for it to finish or stop it"
        if here
        else f"wait for it to finish, or once it is gone, remove {url}"
    )
    return CkptconvError(f"{out}: another ckptconv run is writing it ({describe(info)}); {hint}")
