"""URLs of checkpoints in object storage, and the fsspec file system that serves them.

A URL reaches ckptconv as a command-line `Path` (`s3://b/x` becomes `s3:/b/x`) or as a string; `url_path`
turns either into a `UrlPath`, a path whose `str` is the URL again, so every message names the object as the
user wrote it and `root / rel` names an object inside. The file system comes from fsspec and the backend's
own package, installed with an extra (`pip install 'ckptconv[s3]'`); `--storage-options JSON` is passed to it
as keyword arguments and wins over the environment's variables, which apply otherwise. Secrets given there
never appear in a message (`redact`).

A `file://` URL is a local path (`location`), read as fsspec reads it; a URL with no bucket or path (`s3://`,
which a `Path` makes `s3:`), a `..` in a URL and a chained URL (`simplecache::s3://...`) are refused by name.
Two URLs name the same object when `identity` says so: protocols fsspec serves with one file system (s3 and
s3a; gs and gcs; az, abfs and abfss) are one store, bucket names are compared without case.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path, PosixPath
from typing import Any

from ckptconv.errors import CkptconvError

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/+")
_BARE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/*\Z")  # s3:, s3://, s3:/// (a Path makes `s3:` of `s3://`)
_CHAINED = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*::")  # fsspec's chained URLs: simplecache::s3://b/x
LOCAL_PROTOCOLS = ("file", "local")  # fsspec's LocalFileSystem: a local path
_AZURE = ("az", "abfs", "abfss")  # az://container@account.dfs.core.windows.net/x names container/x
# protocol -> (the extra that installs its backend, the backend's package)
_EXTRAS = {
    "s3": ("s3", "s3fs"),
    "s3a": ("s3", "s3fs"),
    "gs": ("gcs", "gcsfs"),
    "gcs": ("gcs", "gcsfs"),
    "az": ("azure", "adlfs"),
    "abfs": ("azure", "adlfs"),
    "abfss": ("azure", "adlfs"),
}
_SECRET_NAMES = re.compile(r"secret|token|password|key|credential|sas|signature", re.IGNORECASE)
DEFAULT_COALESCE_GAP = 10**6  # 1MB: on S3 a request costs about what 1 MB of transfer does
_options: dict[str, Any] = {}
_gap = [DEFAULT_COALESCE_GAP]
_filesystems: dict[str, Any] = {}


class UrlPath(PosixPath):
    """An object-storage location as a path: `/` and `.name` work, `str()` gives the URL back."""

    @property
    def protocol(self) -> str:
        return self.parts[0].rstrip(":")

    @property
    def key(self) -> str:
        """The location as the file system names it: `bucket/prefix/...`, no protocol."""
        return "/".join(self.parts[1:])

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"UrlPath({str(self)!r})"


def is_url(path: str | Path) -> bool:
    """Whether `path` is spelled as a URL (`file://` included)."""
    return isinstance(path, UrlPath) or _URL.match(str(path)) is not None


def url_path(path: str | Path, what: str = "") -> UrlPath | None:
    """`path` as a `UrlPath` when it is a URL of object storage (`s3://b/x`, or `s3:/b/x` as `Path` leaves
    it), else None (a local path, or a `file://` URL: see `location`). A URL without a bucket, with a `..`
    or chained is refused (`what`: the flag or argument it was given as, for the message)."""
    if isinstance(path, UrlPath):
        return path
    text = str(path)
    named = f"{what} " if what else ""
    bare = _BARE.match(text)
    if bare is not None:
        raise _bucketless(named, text, bare.group(1))
    if _CHAINED.match(text):
        raise CkptconvError(
            f"{named}{text}: chained fsspec URLs are not supported; give the store's own URL "
            "(s3://bucket/prefix) or a local path"
        )
    match = _URL.match(text)
    if match is None:
        return None
    protocol = match.group(1).lower()
    if protocol in LOCAL_PROTOCOLS:
        return None
    parts = [p for p in text[match.end() :].split("/") if p not in ("", ".")]
    if not parts:
        raise _bucketless(named, text, protocol)
    if ".." in parts:
        raise CkptconvError(
            f"{named}{text}: a URL with a '..' segment (object stores take it literally, some clients "
            "resolve it); spell the prefix without it"
        )
    return UrlPath(f"{protocol}:", *parts)


def _bucketless(named: str, text: str, protocol: str) -> CkptconvError:
    if protocol.lower() in LOCAL_PROTOCOLS:
        return CkptconvError(f"{named}{text}: a file URL without a path; give the local path itself")
    return CkptconvError(
        f"{named}{text}: a URL without a bucket or path; give {protocol.lower()}://bucket/prefix "
        f"(or, for a local directory of that name, its absolute path: {os.path.abspath(text)})"
    )


def file_path(path: str | Path) -> Path | None:
    """The local path a `file://` (or `local://`) URL names, as fsspec's LocalFileSystem reads it:
    `file:///abs/x` is /abs/x, `file://rel/x` is ./rel/x made absolute; None for anything else. (A `Path`
    has made `file:/x` of both `file:///x` and `file://x`: read as /x.)"""
    text = str(path)
    match = _URL.match(text)
    if isinstance(path, UrlPath) or match is None or match.group(1).lower() not in LOCAL_PROTOCOLS:
        return None
    rest = text[len(match.group(1)) + 1 :]
    rest = rest[2:] if rest.startswith("//") else rest
    if rest.startswith("~"):
        rest = os.path.expanduser(rest)
    return Path(rest if rest.startswith("/") else os.path.join(os.getcwd(), rest))


def location(path: str | Path, what: str = "") -> Path:
    """Where `path` is: a `UrlPath` in object storage, the local path of a `file://` URL, or `path` as a
    local `Path` (made absolute where a `Path` would read its spelling as a URL: `./s3:/x` stays local)."""
    url = url_path(path, what)
    if url is not None:
        return url
    local = file_path(path)
    if local is not None:
        return local
    plain = Path(path)
    looks = _URL.match(str(plain)) or _BARE.match(str(plain)) or _CHAINED.match(str(plain))
    return Path(os.path.abspath(plain)) if looks else plain


def identity(url: UrlPath) -> tuple[str, ...]:
    """What `url` names, as fsspec resolves it: (the store, the bucket without case, the key's parts).
    Two URLs whose identities are equal or one a prefix of the other name the same objects or nest."""
    bucket, *key = url.key.split("/")
    if url.protocol in _AZURE:
        bucket = bucket.split("@", 1)[0]  # abfs://container@account.dfs.core.windows.net/x
    return (store(url.protocol), bucket.casefold(), *key)


def store(protocol: str) -> str:
    """One name for every protocol fsspec serves with the same file system (`s3a` is `s3`): the least of
    the aliases its registry, the file system class's own `protocol` and the backends ckptconv knows give."""
    seen, todo = set(), [protocol.lower()]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _aliases(name)
    return min(seen)


def _aliases(protocol: str) -> list[str]:
    package = _EXTRAS.get(protocol, ("", ""))[1]
    found = [p for p, (_, pkg) in _EXTRAS.items() if package and pkg == package]
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        return found
    cls = known_implementations.get(protocol, {}).get("class")
    found += [p for p, spec in known_implementations.items() if cls and spec.get("class") == cls]
    try:
        served = fsspec.get_filesystem_class(protocol).protocol
    except Exception:  # not installed, or not a protocol fsspec knows: the names above
        return found
    return [*found, served] if isinstance(served, str) else [*found, *(str(p) for p in served)]


def configure(storage_options: str | None, coalesce_gap: int | None = None) -> None:
    """`--storage-options JSON`: keyword arguments for every file system this run opens; `--coalesce-gap`:
    the most bytes between two needed ranges that one request reads across."""
    _gap[0] = DEFAULT_COALESCE_GAP if coalesce_gap is None else coalesce_gap
    if storage_options is None:
        use_options({})
        return
    try:
        options = json.loads(storage_options)
    except json.JSONDecodeError as e:
        raise CkptconvError(
            f"--storage-options: not valid JSON ({e.msg} at character {e.pos}); "
            'pass an object such as \'{"endpoint_url": "http://localhost:9000"}\''
        ) from None
    if not isinstance(options, dict):
        raise CkptconvError("--storage-options: must be a JSON object of the backend's keyword arguments")
    use_options(options)


def use_options(options: Mapping[str, Any]) -> None:
    """The backend's keyword arguments for every file system opened from now on (`save_hf`/`load_hf`'s
    `storage_options`; the CLI's come through `configure`)."""
    _filesystems.clear()
    _options.clear()
    _options.update(options)


def coalesce_gap() -> int:
    return _gap[0]


def filesystem(url: UrlPath) -> Any:
    """The fsspec file system for `url`'s protocol (one per protocol and run), or a CkptconvError naming the
    extra to install."""
    fs = _filesystems.get(url.protocol)
    if fs is not None:
        return fs
    extra, package = _EXTRAS.get(url.protocol, ("", ""))
    try:
        import fsspec

        cls = fsspec.get_filesystem_class(url.protocol)
    except ImportError:
        how = f"pip install 'ckptconv[{extra}]'" if extra else "install the fsspec backend for it"
        raise CkptconvError(
            f"{url}: reading {url.protocol}:// needs {package or 'its fsspec backend'}; {how}"
        ) from None
    except ValueError:
        raise CkptconvError(f"{url}: {url.protocol}:// is not a storage protocol fsspec knows") from None
    try:
        fs = cls(**_options)
    except Exception as e:
        raise CkptconvError(
            f"--storage-options: {url.protocol}:// does not take them ({redact(str(e))})"
        ) from None
    _filesystems[url.protocol] = fs
    return fs


def redact(text: str) -> str:
    """`text` with every secret of `--storage-options` (any value under a key naming a secret, key or
    token, at any depth) replaced by `***`."""
    for value in _secrets(_options):
        text = text.replace(value, "***")
    return text


def _secrets(options: Any, named: bool = False) -> list[str]:
    if isinstance(options, dict):
        return [
            s for k, v in options.items() for s in _secrets(v, named or bool(_SECRET_NAMES.search(str(k))))
        ]
    if isinstance(options, (list, tuple)):
        return [s for v in options for s in _secrets(v, named)]
    return [options] if named and isinstance(options, str) and len(options) >= 4 else []
