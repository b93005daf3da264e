"""A closed stdout or stderr (`ckptconv verify A B | head -1`, `inspect --json | head -c 10`) is not an error.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises BrokenPipeError, which click turns
into exit 1: the code of a verify mismatch, for two checkpoints that match. Inside `closed_pipes_dropped`
every write to a stream whose reader has gone is dropped instead (and the stream's descriptor pointed at
/dev/null, so the interpreter's last flush is quiet too): the command runs to its end and exits with its own
code, 0 for a match, 1 for a mismatch, 2 for bad input, with nothing said about the pipe. (Not 141, the code
of a process SIGPIPE kills: under `set -o pipefail` that would fail a pipeline whose command succeeded.)
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any


class _Dropping:
    """A text stream whose writes are dropped once its reader has gone; everything else is the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self._gone = True
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # what the stream still buffers goes nowhere, quietly
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def closed_pipes_dropped() -> Iterator[None]:
    """sys.stdout and sys.stderr, for the block, drop what is written once their reader has gone."""
    out, err = sys.stdout, sys.stderr
    wrapped = _Dropping(out), _Dropping(err)
    sys.stdout, sys.stderr = wrapped
    try:
        yield
    finally:
        for stream in wrapped:  # what is still buffered, flushed here: a reader gone is dropped, not reported
            stream.flush()  # by the interpreter's last flush (exit 120)
        sys.stdout, sys.stderr = out, err
