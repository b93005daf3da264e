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

Nothing is read early from a URL (the conversion fetches it, once), on the other ranks, when `SRC` is not a
DCP checkpoint (the conversion says what it is), nor when the conversion will refuse OUT before it reads
`.metadata` (it then says so first, as it always did, with nothing read). The flags are checked before
either, when the command builds its options (`ckptconv.options`).
"""

from __future__ import annotations

from pathlib import Path

from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import open_dcp
from ckptconv.job.env import env_int, rank
from ckptconv.publish.outcheck import check_out
from ckptconv.remote.urls import url_path
from ckptconv.source.locate import dcp_source


class Early:
    """The checkpoint at `path`, or the error opening it raised; `take()` gives it up once."""

    def __init__(self, path: Path, ckpt: DcpCheckpoint | None, error: Exception | None) -> None:
        self.path, self._ckpt, self._error = path, ckpt, error

    def take(self) -> DcpCheckpoint:
        """The checkpoint (no longer held here), or its error raised."""
        ckpt, error = self._ckpt, self._error
        self.drop()
        if error is not None:
            raise error
        if ckpt is None:
            raise RuntimeError(f"{self.path}: the early checkpoint was taken already")
        return ckpt

    def drop(self) -> None:
        """Let go of the checkpoint (the conversion reads another one)."""
        self._ckpt = self._error = None


def reads_metadata() -> bool:
    """Whether this process is the one that reads `.metadata`: the only one, or rank 0 under torchrun (read
    as `world_from_env` and `exits` read them). A WORLD_SIZE the run will refuse: no."""
    try:
        size = env_int("WORLD_SIZE", 1)
    except CkptconvError:
        return False
    return size <= 1 or rank() == 0


def open_early(src: Path, out: Path | None = None, overwrite: bool = False) -> Early | None:
    """`open_dcp` of the checkpoint `src` names, where this process is the one that will read it and it is on
    a file system, and the conversion will not refuse `out` (None: a dry run, nothing is checked) before
    reading it; None otherwise. Call it with checked options (`ckptconv.options`)."""
    if not reads_metadata() or url_path(src) is not None:
        return None
    try:
        if out is not None and url_path(out) is None:
            check_out(out, overwrite)
        path = dcp_source(src)
    except Exception:  # the conversion says what is wrong, in its order
        return None
    try:
        return Early(path, open_dcp(path), None)
    except CkptconvError as e:  # its traceback would keep the loaded records alive
        return Early(path, None, e.with_traceback(None))
    except Exception as e:  # a bug: its traceback is the report
        return Early(path, None, e)
