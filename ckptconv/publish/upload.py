"""One object in object storage written front to back as a multipart upload (`remote_out`'s uploads of
whole files), kept in its run's ledger: completed, held open for last, or left behind."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field

from ckptconv.errors import CkptconvError
from ckptconv.job.signals import deferred
from ckptconv.publish.confirm import confirm, write_error
from ckptconv.publish.multipart import META
from ckptconv.remote.urls import UrlPath, filesystem

PART_BYTES = 16 << 20  # multipart part size: 10,000 parts (S3's limit) hold 160 GiB, far above a shard


@dataclass(eq=False)
class Ledger:
    """What a run's uploads did in this process, for it to complete or remove."""

    completed: list[UrlPath] = field(default_factory=list)
    """The objects completed: removed again if the run fails."""
    held: list[Stream] = field(default_factory=list)
    """The uploads held open until the run completes them last."""
    left: list[str] = field(default_factory=list)
    """What could not be removed, to name in the error."""


class Stream:
    """One object written front to back as a multipart upload. `close()` completes it, unless it is the
    completing object of the run, which `commit()` completes last."""

    skipped = 0  # bytes written but not sent (`PartStream`'s parts kept by --resume): none here

    def __init__(self, url: UrlPath, hold: bool, ledger: Ledger, tag: str | None = None) -> None:
        self.url, self.hold, self.pos, self.ledger = url, hold, 0, ledger
        meta = {"Metadata": {META: tag}} if tag is not None else {}  # S3's user metadata (remote_resume)
        try:
            self._file = filesystem(url).open(url.key, "wb", block_size=PART_BYTES, **meta)
        except Exception as e:
            raise write_error(url, e) from None

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset != self.pos:  # a rank writes its file in order (file granularity): a bug otherwise
            raise CkptconvError(f"{self.url}: write at byte {offset}, expected {self.pos} (internal error)")
        try:
            for at in range(0, len(data), PART_BYTES):  # a signal waits for one part's upload at most
                with deferred():  # s3fs starts the multipart upload in a write: kept, to be aborted
                    self._file.write(data[at : at + PART_BYTES])
        except Exception as e:
            raise write_error(self.url, e) from None
        self.pos += len(data)

    @property
    def written(self) -> int:
        """Bytes streamed (as `PartStream.written`)."""
        return self.pos

    def write(self, data: bytes | memoryview) -> int:
        """File-like: append (torch_record's writer)."""
        self.write_at(self.pos, memoryview(data).cast("B"))
        return len(data)

    def tell(self) -> int:
        return self.pos

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()

    def close(self) -> None:
        if not self.hold:
            self.commit()

    def commit(self) -> None:
        """Complete the upload: done once the store has it whole (`confirm`: its size read back)."""
        try:
            with deferred():
                self._file.close()
                self.ledger.completed.append(self.url)
        except Exception as e:
            raise write_error(self.url, e) from None
        self.ledger.held[:] = [s for s in self.ledger.held if s is not self]
        confirm(self.url, self.pos)

    def discard(self) -> None:
        try:
            if hasattr(self._file, "discard"):
                self._file.discard()  # aborts the multipart upload
        except Exception:
            self.ledger.left.append(f"{self.url} (an unfinished multipart upload)")
        with suppress(AttributeError):  # fsspec's file would otherwise commit what it holds when collected
            self._file.closed = True
