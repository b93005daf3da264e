"""What the CLI prints besides its messages: JSON documents (rank 0 only) and the --trust-pickle notice."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def rank() -> int:
    from .exits import rank

    return rank()


@contextmanager
def trust(enabled: bool) -> Iterator[None]:
    """--trust-pickle for the command run inside; says afterwards what was loaded that way."""
    if not enabled:
        yield
        return
    from .formats.safe_pickle import trusting

    with trusting() as loaded:
        yield
    if loaded and rank() == 0:
        sys.stderr.write(
            f"warning: --trust-pickle loaded with a full unpickler: {', '.join(dict.fromkeys(loaded))}\n"
        )


def print_json(doc: dict[str, Any]) -> None:
    if rank() == 0:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
