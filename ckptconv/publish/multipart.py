"""S3 multipart uploads written by several ranks (remote.parts plans them), through s3fs's own client.

Rank 0 `start`s one upload per file and shares the ids; every rank writes its piece through a `PartStream`,
which sends each part as soon as all of its bytes are written (in any order: a quantized weight's scale comes
after the weight but lies before it) and keeps the ETags the store acknowledged it with; rank 0 checks that
every part of a file was acknowledged (`check_parts`: S3 would otherwise complete an object without the parts
left out), `complete`s each upload with every rank's ETags and reads its size back (`confirm`), or `abort`s
it. A store without S3's multipart API (gcs, azure, ...) is written one rank a file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.job.signals import deferred
from ckptconv.publish.parts import Piece
from ckptconv.remote.urls import UrlPath, filesystem

Tags = dict[str, list[tuple[int, str]]]  # {file name: [(part number, ETag)]}
META = "ckptconv-fingerprint"  # the user metadata key of a resumable run's fingerprint (remote_resume)


def supported(url: UrlPath) -> bool:
    """Whether `url`'s store takes parts of one object from several writers (S3, through s3fs)."""
    return hasattr(filesystem(url), "call_s3")


def _call(url: UrlPath, method: str, **kwargs: Any) -> Any:
    fs = filesystem(url)
    bucket, key, _ = fs.split_path(url.key)
    return fs.call_s3(method, Bucket=bucket, Key=key, **kwargs)


def start(
    url: UrlPath, names: list[str], ids: dict[str, str], tag: Callable[[str], str] | None = None
) -> dict[str, str]:
    """Rank 0: a multipart upload for each file, each recorded in `ids` {name: upload id} as it is started
    (a signal cannot fall between the two); a copy of `ids`. Those started before a failure are aborted
    and forgotten before it is raised. `tag(name)`: the value of each object's user metadata that says which
    run made it (remote_resume)."""
    try:
        for name in names:
            meta = {"Metadata": {META: tag(name)}} if tag is not None else {}
            with deferred():
                ids[name] = _call(url / name, "create_multipart_upload", **meta)["UploadId"]
    except BaseException:
        abort_all(url, ids.items())
        ids.clear()
        raise
    return dict(ids)


def totals(pieces: list[Piece]) -> dict[str, tuple[int, int]]:
    """{file: (its bytes, its number of parts)} from every rank's pieces."""
    out: dict[str, tuple[int, int]] = {}
    for p in pieces:
        size, parts = out.get(p.file, (0, 0))
        out[p.file] = (max(size, p.end), parts + len(p.part_sizes()))
    return out


def check_parts(url: UrlPath, tags: list[tuple[int, str]], parts: int) -> None:
    """Rank 0, before completing `url`: parts 1 to `parts`, each acknowledged once."""
    numbers = sorted(n for n, _ in tags)
    if numbers != list(range(1, parts + 1)):
        missing = sorted(set(range(1, parts + 1)) - set(numbers))
        raise CkptconvError(
            f"{url}: {len(numbers)} parts acknowledged of {parts} (missing {missing[:5]}); not completing "
            "it (internal error)"
        )


def complete(url: UrlPath, upload_id: str, tags: list[tuple[int, str]]) -> None:
    parts = [{"PartNumber": n, "ETag": tag} for n, tag in sorted(tags)]
    _call(url, "complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": parts})
    filesystem(url).invalidate_cache(url.key)


def abort_all(url: UrlPath, ids: Iterable[tuple[str, str]]) -> list[str]:
    """Abort the uploads `ids`, (file name, upload id) pairs of the files under `url` (a file may have
    several in progress); the names of those the store kept."""
    left = []
    for name, upload_id in ids:
        try:
            _call(url / name, "abort_multipart_upload", UploadId=upload_id)
        except FileNotFoundError:
            pass  # completed or already gone
        except Exception:
            left.append(f"{url / name} (an unfinished multipart upload)")
    return left


def same_bytes(data: bytes | bytearray, etag: str) -> bool:
    """Whether a part S3 acknowledged with `etag` holds `data` (a plain part's ETag is its MD5; under
    encryption with KMS it is not, and the part is sent again)."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest() == etag.strip('"')


class PartStream:
    """This rank's piece of one file: bytes written at their offsets, each part sent once it is whole."""

    def __init__(
        self, url: UrlPath, upload_id: str, piece: Piece, tags: Tags, kept: dict[int, str] | None = None
    ) -> None:
        self.url, self.upload_id, self.piece = url, upload_id, piece
        self.written = 0
        self.kept = kept or {}  # {part number: ETag}: sent by an interrupted run (--resume): same, not again
        self.skipped = 0  # bytes of those parts
        self._tags = tags.setdefault(piece.file, [])
        self._open: dict[int, tuple[bytearray, list[int]]] = {}  # part -> (its bytes, [bytes written])

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset < self.piece.start or offset + len(data) > self.piece.end:
            raise CkptconvError(
                f"{self.url}: write of bytes [{offset}, {offset + len(data)}) outside this rank's "
                f"[{self.piece.start}, {self.piece.end}) (internal error)"
            )
        while data:
            number, first, size = self.piece.part_at(offset)
            buf, filled = self._open.setdefault(number, (bytearray(size), [0]))
            n = min(len(data), first + size - offset)
            buf[offset - first : offset - first + n] = data[:n]
            filled[0] += n
            if filled[0] == size:
                self._send(number, buf)
            data, offset = data[n:], offset + n
            self.written += n

    def _send(self, number: int, buf: bytearray) -> None:
        from ckptconv.publish.confirm import write_error

        if number in self.kept and same_bytes(buf, self.kept[number]):
            del self._open[number]
            self._tags.append((number, self.kept[number]))
            self.skipped += len(buf)
            return
        try:
            reply = _call(
                self.url, "upload_part", UploadId=self.upload_id, PartNumber=number, Body=bytes(buf)
            )
        except Exception as e:
            raise write_error(self.url, e) from None
        del self._open[number]
        self._tags.append((number, reply["ETag"]))

    def close(self) -> None:
        if self._open or self.written != self.piece.end - self.piece.start:
            raise CkptconvError(
                f"{self.url}: {self.written} of this rank's {self.piece.end - self.piece.start} bytes "
                "written (internal error)"
            )

    def discard(self) -> None:
        self._open.clear()  # rank 0 aborts the upload
