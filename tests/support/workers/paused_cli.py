"""`python -m ckptconv ARGS` whose ranks each pause after recording their first finished file (`--resume`'s
record): each makes the file $PAUSE_DIR/RANK and waits (on the fsync thread, the main one writing on) until
it is removed, so a test can interrupt or kill the run at a known point: some files recorded, some not."""

import os
import sys
import time
from pathlib import Path

from ckptconv.publish import resume

_done = resume.Recorder.done
_paused: list[int] = []


def paused_done(self: resume.Recorder, path: object) -> None:
    _done(self, path)
    if _paused:
        return
    _paused.append(1)
    flag = Path(os.environ["PAUSE_DIR"]) / os.environ.get("RANK", "0")
    flag.touch()
    deadline = time.monotonic() + 120
    while flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


resume.Recorder.done = paused_done  # type: ignore[method-assign]
from ckptconv.cli.app import run  # noqa: E402

sys.argv[0] = "ckptconv"
run()
