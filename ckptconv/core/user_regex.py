"""Regular expressions a user gives (`--fp32`, `--quantize-skip`, `rank_pattern` / `alpha_pattern`), matched
by RE2: in time linear in the key, whatever the pattern, where Python's `re` backtracks (`(a+)+$` against a
long key takes longer than the age of the universe).

RE2 takes the patterns people write for keys (literals, `.`, classes, `\\d \\w \\s \\b`, groups, `|`,
`* + ? {m,n}`, `^ $`, `(?i)`) with `re`'s results on them. It has no look-around, back-references, atomic
groups or possessive quantifiers, nor `(?x)` or `\\Z` (RE2 writes `\\z`): such a pattern, a malformed one and
one too large for RE2's memory budget are one-line errors naming the flag or file. Where the two differ on
keys nobody writes: `\\d \\w \\s \\b` are ASCII in RE2 (Unicode in `re`), and `$` is the end of the key
(`re` also matches before a final newline).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import re2

from ckptconv.errors import CkptconvError

SHOWN_CHARS = 100  # of a pattern quoted in an error
MAX_MEM = 2**20  # RE2's memory budget per pattern: its program, and the DFA states it caches as it matches


class UserRegex:
    """One compiled pattern: `search` (anywhere in the key, as `re.search`) and `match` (from its start, as
    `re.match`), each a bool. Compiling it is the error, if there is one: `what` names where it came from
    and `shown` the user's part of it (the whole pattern by default)."""

    def __init__(self, pattern: str, what: str, shown: str | None = None) -> None:
        self.pattern = pattern
        self._regex = _compiled(pattern, what, pattern if shown is None else shown)

    def search(self, text: str) -> bool:
        return self._regex.search(_utf8(text)) is not None

    def match(self, text: str) -> bool:
        return self._regex.match(_utf8(text)) is not None


def _utf8(text: str) -> bytes:
    """A key as RE2 reads it: UTF-8, a lone surrogate (JSON may hold one) kept as one character, as in re."""
    return text.encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str, what: str, shown: str) -> Any:
    """RE2's compiled `pattern`, or a CkptconvError quoting `shown` (the user's part of it) after `what`."""
    shown = shown if len(shown) <= SHOWN_CHARS else shown[:SHOWN_CHARS] + "..."
    try:
        return re2.compile(_as_re_reads_it(pattern).encode("utf-8"), _OPTIONS)
    except UnicodeEncodeError:
        reason = "it is not valid Unicode"
    except re2.error as e:
        raw = e.args[0] if e.args else ""
        reason = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    raise CkptconvError(
        f"{what} {shown!r} is not a valid regular expression ({reason[:SHOWN_CHARS]}; ckptconv matches RE2 "
        "syntax, in linear time: no look-around, back-references or possessive quantifiers)"
    ) from None


_OPEN_MIN = re.compile(r"\{,(\d*)\}")  # re's {,n}: RE2 reads it as text
_CODE_POINT = re.compile(r"u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})")  # re's \\uHHHH, \\UHHHHHHHH: RE2 has none


def _as_re_reads_it(pattern: str) -> str:
    """`pattern` with what RE2 spells otherwise spelled its way: `{,n}` (re: `{0,n}`; RE2: the text "{,n}")
    made `{0,n}`, and `\\uHHHH` / `\\UHHHHHHHH` made `\\x{...}`. One pass, tracking escapes and classes."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            code = _CODE_POINT.match(pattern, i + 1)
            if code:
                out.append("\\x{" + (code.group(1) or code.group(2)) + "}")
                i = code.end()
            else:
                out.append(pattern[i : i + 2])
                i += 2
            continue
        start = i
        if in_class:
            in_class = c != "]"
            i += 1
        elif c == "[":  # a `]` first in a class (after any `^`) is one of its characters
            i += 1 + pattern.startswith("^", i + 1)
            i += pattern.startswith("]", i)
            in_class = True
        elif (repeat := _OPEN_MIN.match(pattern, i)) is not None:
            out.append("{0," + repeat.group(1) + "}")
            i = repeat.end()
            continue
        else:
            i += 1
        out.append(pattern[start:i])
    return "".join(out)


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # RE2 would log a malformed pattern to stderr, besides raising
    options.max_mem = MAX_MEM
    return options


_OPTIONS = _options()
