"""The one user-facing error tree.

`CkptconvError` is bad input or an environment problem the user can fix: the CLI prints its message as one
line and exits 2. `VerifyMismatch` means two checkpoints differ: exit 1. Anything else is a bug in ckptconv
and keeps its traceback.
"""

from __future__ import annotations


class CkptconvError(Exception):
    """A problem with the user's input, flags or environment; the message says what, where and how to fix."""

    exit_code = 2

    def __init__(self, message: str, *, exit_code: int | None = None, agreed: bool = False) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.agreed = agreed  # every rank raised it together; only rank 0 needs to print it
        self.said = False  # the command has said it already (`exits.say_agreed`)


class VerifyMismatch(CkptconvError):
    """Two checkpoints that should be equal are not."""

    exit_code = 1
