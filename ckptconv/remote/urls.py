"""URLs of checkpoints in object storage, and the fsspec file system that serves them.

A URL reaches ckptconv as a command-line `Path` (`s3://b/x` becomes `s3:/b/x`) or as a string; `url_path`
turns either into a `UrlPath`, a path whose `str` is the URL again, so every message names the object as the
user wrote it and `root / rel` names an object inside. The file system comes from fsspec and the backend's
own package, installed with an extra (`pip install 'ckptconv[s3]'`); `--storage-options JSON` is passed to it
as keyword arguments and wins over the environment's variables, which apply otherwise. Secrets given there
never appear in a message (`redact`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path, PosixPath
from typing import Any

from ..errors import CkptconvError

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/+")
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
    return isinstance(path, UrlPath) or _URL.match(str(path)) is not None


def url_path(path: str | Path) -> UrlPath | None:
    """`path` as a `UrlPath` when it is a URL (`s3://b/x`, or `s3:/b/x` as `Path` leaves it), else None."""
    if isinstance(path, UrlPath):
        return path
    text = str(path)
    match = _URL.match(text)
    if match is None:
        return None
    rest = text[match.end() :].strip("/")
    if not rest:
        raise CkptconvError(f"{match.group(1)}://: a URL needs a bucket or container (s3://bucket/prefix)")
    return UrlPath(f"{match.group(1).lower()}:", *rest.split("/"))


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
