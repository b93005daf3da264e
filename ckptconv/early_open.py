"""The DCP checkpoint opened before torch is imported, by the process that reads `.metadata`.

Unpickling DCP metadata peaks at about 0.8 KB a chunk: pickle's memo keeps every record's tuples and emptied
dicts alive until the load ends, 0.7 GiB for the 894 thousand chunks of a 70B model saved by 512 ranks.
torch's import holds 0.21 GiB. With torch imported first the two add up; with `.metadata` read first, what
the load leaves free is there for torch's import, and the peak is the load's. So `dcp-to-hf` opens its
source (`open_dcp`) before anything imports torch, in the process that reads `.metadata` (the only one, or
rank 0 under torchrun), and the conversion takes that checkpoint instead of reading it again
(`dcp_share.open_dcp_shared`). An error of that read is kept and raised where the conversion reads
`.metadata` (after its checks of the flags and of OUT, and, under torchrun, on every rank); `.metadata` is
read once either way, so nothing in it is loaded twice (`--trust-pickle`).

Nothing is read early from a URL (the conversion fetches it, once), on the other ranks, or when `SRC` is not
a DCP checkpoint (the conversion says what it is).
"""

from __future__ import annotations

import os
from pathlib import Path

from .formats.dcp import DcpCheckpoint, open_dcp
from .remote.urls import url_path
from .sources import dcp_source


class Early:
    """The checkpoint at `path`, or the error opening it raised; `take()` gives it up once."""

    def __init__(self, path: Path, ckpt: DcpCheckpoint | None, error: Exception | None) -> None:
        self.path, self._ckpt, self._error = path, ckpt, error

    def take(self) -> DcpCheckpoint:
        """The checkpoint (no longer held here), or its error raised."""
        ckpt, error, self._ckpt, self._error = self._ckpt, self._error, None, None
        if error is not None:
            raise error
        if ckpt is None:
            raise RuntimeError(f"{self.path}: the early checkpoint was taken already")
        return ckpt


def open_early(src: Path) -> Early | None:
    """`open_dcp` of the checkpoint `src` names, where this process is the one that will read it and it is on
    a file system; None elsewhere."""
    if os.environ.get("RANK", "0") != "0" or url_path(src) is not None:
        return None
    try:
        path = dcp_source(src)
    except Exception:  # the conversion says what is wrong with SRC where it always did
        return None
    try:
        return Early(path, open_dcp(path), None)
    except Exception as e:
        return Early(path, None, e)
