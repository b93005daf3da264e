"""Where a writer's bytes go when they do not go to a local file: the interfaces the format writers are
handed (object storage implements them in `publish.remote_out`), so that no writer imports a publisher."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class PositionedSink(Protocol):
    """One output file taken in pieces at byte offsets, as `SafetensorsWriter` writes them."""

    skipped: int
    """Bytes written but not sent: parts an interrupted run sent already (`--resume` in object storage)."""

    def write_at(self, offset: int, data: memoryview) -> None:
        """`data` at byte `offset` of the file (a rank's writes to one file come in order)."""

    def close(self) -> None:
        """Done with the file: its upload is completed or handed on."""

    def discard(self) -> None:
        """A failed write: nothing of the file is published."""


class StreamSink(Protocol):
    """One output file written front to back, as torch's DCP writer writes a data file; a context that
    closes it when its block ends and discards it when the block raises."""

    def write(self, data: bytes | memoryview) -> int: ...

    def tell(self) -> int: ...

    def __enter__(self) -> StreamSink: ...

    def __exit__(self, kind: object, *rest: object) -> None: ...


class ObjectStore(Protocol):
    """An OUT in object storage, as `dcp_writer.write_dcp` writes to it (`publish.remote_out` is one)."""

    def whole(self, path: Path) -> StreamSink:
        """The upload of all of `path` (a file under OUT) by this rank, written front to back."""

    def local_dir(self) -> Path:
        """A local directory for the files rank 0 finishes and uploads last (`.metadata`)."""
