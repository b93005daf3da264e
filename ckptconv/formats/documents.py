"""JSON and TOML documents parsed within the read limits: nesting and objects counted in the text first.

Python's `json` and `tomllib` have no limits of their own: a deeply nested document stops them with a
RecursionError, a 64 MB file of `[[],[],...]` makes 1.4 GB of lists, and a TOML key dotted 200,000 times
over makes tomllib's work quadratic (gigabytes from 400 KB). So the text is scanned first, strings and
comments skipped as the parser skips them: nesting deeper than the depth limit, more containers and strings
than the objects limit, or (TOML) a dotted key of more parts than the depth limit is refused before the
parser starts. Only what that scan passed reaches the parser.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from typing import Any

from ckptconv.core.jsonkeys import unique
from ckptconv.errors import CkptconvError
from ckptconv.job.limits import Budget

# JSON outside its strings: a string (one never closed runs to the end: the parser stops there anyway), or a
# bracket; possessive loops, so no text is scanned twice
_JSON = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"?|[\[\]{}]', re.S)


def load_json(raw: bytes | str, where: object, **options: Any) -> Any:
    """`json.loads(raw, **options)` once the text is within the limits; `ValueError` (which
    `json.JSONDecodeError`, `UnicodeDecodeError` and `DuplicateKey` are) when it is not JSON or names a key
    twice in one object, `LimitExceeded` past a limit."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass") if isinstance(raw, bytes) else raw
    scan_json(text, Budget(where))
    options.setdefault("object_pairs_hook", unique)  # a key twice in one object: refused (jsonkeys)
    try:
        return json.loads(text, **options)
    except ValueError as e:
        raise _long_number(e) or e from None  # the callers name the file


def scan_json(text: str, budget: Budget) -> None:
    """Charge `budget` for the nesting and the containers and strings of a JSON text."""
    opened = text.count("[") + text.count("{")
    at_most = opened + text.count('"') // 2
    if opened <= budget.depth and at_most <= budget.objects_left():  # no deeper than its brackets
        budget.objects(at_most)
        return
    level = 0
    for match in _JSON.finditer(text):
        token = match.group()
        if token in "[{":
            level += 1
            budget.nested(level, "JSON nesting")
            budget.objects(1, "JSON containers and strings")
        elif token in "]}":
            level -= 1
        else:
            budget.objects(1, "JSON containers and strings")


# TOML outside its strings and comments: the four kinds of string (one never closed runs as far as it can:
# tomllib stops there anyway), a comment, a bracket, a dot, or a token that ends a key (=, comma, newline);
# possessive loops, so no text is scanned twice
_TOML = re.compile(
    r"""'''(?:[^']|''?+(?!'))*+(?:'{3,5})?"""
    r'|"""(?:[^"\\]|\\[\s\S]|""?+(?!"))*+(?:"{3,5})?'
    r'|"(?:[^"\\\n]|\\.)*+"?'
    r"|'[^'\n]*+'?"
    r"|#[^\n]*+"
    r"|[\[\]{}.=,\n]"
)


def load_toml(text: str, where: object) -> dict[str, Any]:
    """`tomllib.loads(text)` once the text is within the limits (`tomllib.TOMLDecodeError` when it is not
    TOML, `LimitExceeded` past a limit). Table headers and dotted keys nest tables without brackets, so
    the depth of what tomllib made is checked too (without recursing) before anything reads it."""
    budget = Budget(where)
    scan_toml(text, budget)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except ValueError as e:  # an integer past Python's int string limit: not a TOML error, so said here
        long = _long_number(e)
        if long is None:
            raise
        raise CkptconvError(f"{where}: {long}") from None
    check_depth(doc, budget)
    return doc


def _long_number(e: ValueError) -> ValueError | None:
    """The error of an integer longer than Python converts (`sys.get_int_max_str_digits`), said in terms of
    the document, not of the interpreter; None for any other error."""
    if not str(e).startswith("Exceeds the limit"):
        return None
    digits = sys.get_int_max_str_digits()
    return ValueError(f"an integer of more than {digits} digits; write it with fewer digits")


def scan_toml(text: str, budget: Budget) -> None:
    """Charge `budget` for the bracket nesting (tomllib recurses into each level), the parts of each dotted
    key (its work is quadratic in them) and the containers and values of a TOML text."""
    level = dots = 0
    for match in _TOML.finditer(text):
        first = match.group()[0]
        if first == ".":  # dots since the last token that ends a key: one dotted key's (or a float's)
            dots += 1
            budget.nested(dots + 1, "parts of a dotted TOML key")
            continue
        if first in "'\"":  # a string: a value, or a quoted part of a dotted key
            budget.objects(1, "TOML containers and values")
            continue
        if first == "#":
            continue
        dots = 0
        if first in "[{":
            level += 1
            budget.nested(level, "TOML nesting")
            budget.objects(1, "TOML containers and values")
        elif first in "]}":
            level -= 1
        elif first in "=,":
            budget.objects(1, "TOML containers and values")


def check_depth(value: Any, budget: Budget) -> None:
    """Refuse a parsed document nested deeper than the depth limit (a loop, not recursion)."""
    todo = [(value, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, dict | list):
            budget.nested(level, "nesting")
            todo.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))


def json_error(where: object, e: Exception, what: str = "JSON") -> CkptconvError:
    """The one-line error for a document that is not valid `what`."""
    why = "too deeply nested" if isinstance(e, RecursionError) else str(e).split("\n")[0][:200]
    return CkptconvError(f"{where}: not valid {what} ({why})")
