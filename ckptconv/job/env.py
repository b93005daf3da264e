"""The `CKPTCONV_*` environment variables, read and validated in one place.

A bad value is bad input like a bad flag: one line naming the variable and what it takes, exit 2.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from ckptconv.errors import CkptconvError

VARIABLES = {
    "CKPTCONV_TIMEOUT_S": "seconds a collective waits for a peer before the job fails (default 600)",
    "CKPTCONV_WRITE_THREADS": "files each rank writes at once in hf-to-dcp (default 2)",
    "CKPTCONV_LOG_EVERY_S": "seconds between progress log lines when stderr is not a terminal (default 10)",
    "CKPTCONV_DEBUG": "1 or true: a traceback instead of the one-line error (0, false or empty: off)",
    "CKPTCONV_READ_DEPTH": "levels of nesting a reader of pickles, JSON and TOML follows (default 100)",
    "CKPTCONV_READ_OBJECTS": "objects a reader builds or visits beyond a file's own (default 2000000)",
    "CKPTCONV_READ_BYTES": "bytes a reader inflates or joins from one file (default 268435456)",
}
_FLAGS = {"": False, "0": False, "false": False, "1": True, "true": True}


def env_int(name: str, default: int, minimum: int = 1, maximum: int = 10**9) -> int:
    """The whole number in `name` (from `minimum` to `maximum`), or `default` when unset or empty."""
    return int(_number(name, default, int, minimum, maximum, "a whole number"))


def env_float(name: str, default: float, minimum: float = 0.0) -> float:
    """The finite number in `name` (>= `minimum`), or `default` when unset or empty."""
    return _number(name, default, float, minimum, math.inf, "a number")


def _number(
    name: str, default: float, parse: Callable[[str], float], minimum: float, maximum: float, what: str
) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = math.nan
    if not minimum <= value <= maximum or math.isinf(value):
        low = _show(minimum)
        bound = f"from {low} to {_show(maximum)}" if math.isfinite(maximum) else f">= {low}"
        raise CkptconvError(f"{name}={raw!r}: must be {what} {bound}; fix or unset it")
    return value


def env_flag(name: str) -> bool:
    """On or off: 1 or true, 0 or false (any case), unset or empty being off."""
    raw = os.environ.get(name, "")
    if raw.strip().lower() not in _FLAGS:
        raise CkptconvError(f"{name}={raw!r}: must be 1 or true (on), 0 or false (off); fix or unset it")
    return _FLAGS[raw.strip().lower()]


def debug() -> bool:
    """Whether CKPTCONV_DEBUG is on; never raises (it is read while an error is being reported: a bad value
    is off here, and `check_all` refuses it before any work)."""
    return _FLAGS.get(os.environ.get("CKPTCONV_DEBUG", "").strip().lower(), False)


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def check_all() -> None:
    """Validate every variable a command may read, before any work: a bad one fails at once, on every rank
    (the read budget's variables are checked by `limits.check_all`, which reads them through this module)."""
    env_int("CKPTCONV_TIMEOUT_S", 600, maximum=10**7)
    env_int("CKPTCONV_WRITE_THREADS", 2, maximum=256)
    env_float("CKPTCONV_LOG_EVERY_S", 10.0)
    env_flag("CKPTCONV_DEBUG")


def rank() -> int:
    """This process's rank under torchrun (0 outside it, or when RANK is not a number)."""
    raw = os.environ.get("RANK", "0").strip()
    return int(raw) if raw.isdigit() else 0
