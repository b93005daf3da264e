"""Object storage seen as files and directories, for the checks `formats.files` makes on any path: what is
at a URL (an object, a prefix with objects under it, nothing), the names one level under a prefix, a small
object's bytes, any object's bytes by range.

A prefix is listed once per process (`RemoteFiles.sizes`); a URL whose parent prefix was listed is answered
from that listing, any other costs one listing of its own (and, when nothing is under it, one `info`
request: an object). No parent is ever listed on its own account: the parent of a model's prefix may be a
bucket of millions of objects.
"""

from __future__ import annotations

import stat

from ckptconv.errors import CkptconvError
from ckptconv.remote.files import RemoteFiles, _listings, remote_error
from ckptconv.remote.urls import UrlPath, filesystem

_objects: dict[str, int] = {}  # URL of a single object found by `info` -> its size


def size(url: UrlPath) -> int | None:
    """The size of the object at `url`, None when there is no object there (a prefix, or nothing)."""
    parent = _listings.get(str(url.parent))
    if parent is not None:
        return parent.get(url.name)
    if str(url) not in _objects:
        if RemoteFiles(url).sizes():
            return None
        try:
            info = filesystem(url).info(url.key)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise remote_error(url, e) from None
        if info.get("type", "file") != "file":
            return None
        _objects[str(url)] = int(info.get("size") or 0)
    return _objects[str(url)]


def mode(url: UrlPath) -> int | None:
    """S_IFREG for an object, S_IFDIR for a prefix with objects under it, None for nothing."""
    parent = _listings.get(str(url.parent))
    if parent is not None:
        if url.name in parent:
            return stat.S_IFREG
        below = url.name + "/"
        return stat.S_IFDIR if any(name.startswith(below) for name in parent) else None
    if RemoteFiles(url).sizes():
        return stat.S_IFDIR
    return None if size(url) is None else stat.S_IFREG


def children(url: UrlPath) -> list[str]:
    """The names one level under the prefix `url`, sorted (objects, and prefixes holding objects)."""
    return sorted({name.split("/", 1)[0] for name in RemoteFiles(url).sizes()})


def read(url: UrlPath, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of the object `url`, exactly (one ranged GET)."""
    return RemoteFiles(url.parent).read(url.name, offset, length)  # a ranged read lists nothing


def read_small(url: UrlPath, limit: int | None) -> bytes:
    """The whole object `url` (a config, an index, a stash), refused above `limit` bytes."""
    n = size(url)
    if n is None:
        raise CkptconvError(f"{url}: no such object")
    if limit is not None and n > limit:
        raise CkptconvError(f"{url}: {n} bytes, more than the {limit} a file of its kind may have")
    return read(url, 0, n)


Known = tuple[dict[str, dict[str, int]], dict[str, int]]


def known() -> Known:
    """What this process has listed and found (for rank 0 to give the other ranks)."""
    return dict(_listings), dict(_objects)


def remember(found: Known) -> None:
    """Take listings made by another rank as this process's own (no rank lists a prefix rank 0 listed)."""
    listings, objects = found
    for url, sizes in listings.items():
        _listings.setdefault(url, sizes)
    for url, n in objects.items():
        _objects.setdefault(url, n)
