"""An upload is done when the store says so: the object's size read back once its commit has returned; the
one-line error of a failed write to object storage."""

from __future__ import annotations

from ckptconv.errors import CkptconvError
from ckptconv.remote.files import denied
from ckptconv.remote.urls import UrlPath, filesystem, redact


def confirm(url: UrlPath, size: int) -> None:
    """Raise unless the store now holds `size` bytes at `url` (fresh, not from a cached listing): the
    upload's completion is its acknowledgement, not the call's return alone."""
    fs = filesystem(url)
    fs.invalidate_cache(url.key)
    try:
        held = fs.size(url.key)
    except Exception as e:
        raise write_error(url, e) from None
    if held != size:
        raise CkptconvError(
            redact(f"{url}: the store holds {held} bytes after the upload of {size}; run the command again")
        )


def write_error(url: object, e: BaseException) -> CkptconvError:
    if isinstance(e, CkptconvError):
        return e
    if denied(e):
        cause = "access denied; check the credentials and the bucket's permissions"
    else:
        cause = f"{type(e).__name__}: {e}".strip()
    return CkptconvError(redact(f"{url}: cannot write ({cause})"))
