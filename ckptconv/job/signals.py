"""SIGTERM and SIGHUP behave like Ctrl-C: the work in progress unwinds (staging removed, locks released),
then the command exits 128 + the signal's number with one line.

A batch scheduler's cancel (SIGTERM), a closed terminal or ssh session (SIGHUP) and Ctrl-C (SIGINT) all arrive
as `Interrupted`, a KeyboardInterrupt, so every `finally` and `except BaseException` that cleans up after
Ctrl-C cleans up after them too. Python runs the handler in the main thread, between bytecodes. The first
signal decides the exit code; the ones after it (torchrun's SIGTERM after a Ctrl-C, a second Ctrl-C) are
ignored while the run unwinds, so they cannot interrupt its cleanup.

A call to a store that makes something the cleanup must remove (an object put, a multipart upload started or
completed) runs on fsspec's I/O thread: interrupted while waiting for it, the main thread would unwind while
the call still lands, and what it made would be left behind. Such a call and the record of what it made run
`deferred()`: a signal arriving inside is raised once the block is left; another signal, or the same one
again after INSIST_S (a user insisting, not torchrun forwarding srun's SIGTERM), raises at once.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by `signum`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []  # the signals `as_interrupts` turned into `Interrupted`, in order
_deferring = 0  # the depth of `deferred()` blocks in progress
_pending: list[tuple[int, float]] = []  # (signal, when) that arrived inside one, raised on leaving it
# a repeat of the held signal sooner than this is the same request (torchrun forwards the SIGTERM srun sent
# every process of the step), not a user insisting
INSIST_S = 2.0


def exit_code() -> int:
    """128 + the signal that stopped the run: 143 for SIGTERM, 129 for SIGHUP, 130 for Ctrl-C. Kept here,
    not read off the exception: typer turns a KeyboardInterrupt into an exit code of 130."""
    return 128 + (_received[0] if _received else signal.SIGINT)


def _raise(signum: int, frame: FrameType | None) -> None:
    if _deferring and not _pending:
        _pending.append((signum, time.monotonic()))
        return
    if _pending:
        first, when = _pending[0]
        if frame is not None and signum == first and time.monotonic() - when < INSIST_S:
            return  # the same request again: still held
        _pending.clear()
        signum = first  # the first decides the exit code
    _received.append(signum)
    for sig in (*HANDLED, signal.SIGINT):  # a second signal while unwinding must not interrupt the cleanup
        if signal.getsignal(sig) is _raise:
            signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def _routed() -> tuple[int, ...]:
    """The signals `as_interrupts` handles: SIGTERM and SIGHUP, and SIGINT where Python's own handler has it
    (not where it is ignored, as in a job started in the background, or an embedding program's)."""
    ctrl_c = (signal.SIGINT,) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else ()
    return (*HANDLED, *ctrl_c)


@contextmanager
def as_interrupts() -> Iterator[None]:
    """Inside: SIGTERM, SIGHUP and Ctrl-C raise `Interrupted` in the main thread. Outside: the handlers
    before."""
    before = {sig: signal.getsignal(sig) for sig in _routed()}
    for sig in before:
        if before[sig] != signal.SIG_IGN:  # nohup's ignored SIGHUP stays ignored
            signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Inside: a signal `as_interrupts` routes is held until the block is left (then raised as
    `Interrupted`), so that a store call and the record of what it made are not split; another signal, or
    the same one again after INSIST_S, raises at once. Off the main thread (which signals never interrupt)
    it does nothing."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending:
            _raise(_pending[0][0], None)
