"""`python -m ckptconv ARGS` whose ranks each pause after recording their first finished file (`--resume`'s
record), or, into S3, after sending their first part (hf-to-dcp: completing their first data file): each
makes the file $PAUSE_DIR/RANK and waits (on the fsync thread, the main one writing on; in hf-to-dcp on the
writer thread, the others writing on; in S3 by parts on the main thread) until it is removed, so a test can
interrupt or kill the run at a known point: some files recorded (parts sent), some not."""

import os
import sys
import time
from pathlib import Path

from ckptconv.publish import multipart, resume, upload

_done = resume.Recorder.done
_whole = resume.Resume.record_whole
_send = multipart.PartStream._send
_commit = upload.Stream.commit
_paused: list[int] = []


def paused_done(self: resume.Recorder, path: object, pieces: object = None) -> None:
    _done(self, path, pieces)  # type: ignore[arg-type]
    _pause()


def paused_whole(self: resume.Resume, *args: object) -> None:
    _whole(self, *args)  # type: ignore[arg-type]
    _pause()


def paused_send(self: multipart.PartStream, number: int, buf: bytearray) -> None:
    _send(self, number, buf)
    _pause()


def paused_commit(self: upload.Stream) -> None:
    _commit(self)
    if self.url.name.endswith(".distcp"):
        _pause()


def _pause() -> None:
    if _paused:
        return
    _paused.append(1)
    flag = Path(os.environ["PAUSE_DIR"]) / os.environ.get("RANK", "0")
    flag.touch()
    deadline = time.monotonic() + 120
    while flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


resume.Recorder.done = paused_done  # type: ignore[method-assign]
resume.Resume.record_whole = paused_whole  # type: ignore[method-assign]
multipart.PartStream._send = paused_send  # type: ignore[method-assign]
upload.Stream.commit = paused_commit  # type: ignore[method-assign]
from ckptconv.cli.app import run  # noqa: E402

sys.argv[0] = "ckptconv"
run()
