"""Size expressions of mapping rules: integers and config.json keys with + - * / and parentheses.

    "num_key_value_heads * head_dim"
    "text_config.linear_num_key_heads * text_config.linear_key_head_dim"   (a dotted key reads a nested table)
    "num_attention_heads / num_key_value_heads * head_dim"                 (division must be exact)

A mapping's `[mapping.defaults]` table gives a key's value when config.json lacks it (Megatron's
`make_vocab_size_divisible_by = 128`); a key config.json has always wins. Parsed with `ast` and evaluated by
walking only the node types above: never `eval`. Pure.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from ckptconv.errors import CkptconvError

MAX_EXPR_CHARS = 200
MAX_SIZE = 2**63 - 1  # no tensor dim is larger (torch's sizes are int64): a size beyond it is refused


class MissingKey(CkptconvError):
    """A config.json key an expression needs is absent (or not an integer)."""


def lookup(config: Mapping[str, Any], dotted: str) -> Any:
    """`config["a"]["b"]` for "a.b"; None when any step is missing."""
    node: Any = config
    for step in dotted.split("."):
        if not isinstance(node, Mapping) or step not in node:
            return None
        node = node[step]
    return node


def size(
    value: int | str, config: Mapping[str, Any], where: str, defaults: Mapping[str, int] | None = None
) -> int:
    """An int, or an expression over config.json integers (a key it lacks: from `defaults`), as an int."""
    if isinstance(value, bool):
        raise CkptconvError(f"{where}: {value!r} is not a size")
    if isinstance(value, int):
        return _bounded(value, where, "an integer size")
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_EXPR_CHARS:
        raise CkptconvError(f"{where}: {value!r} is not a size (an integer or an expression of config keys)")
    try:
        tree = ast.parse(value.strip(), mode="eval")
    except SyntaxError:
        raise CkptconvError(f"{where}: size {value!r} is not an expression of config keys") from None
    return _eval(tree.body, _Keys(config, defaults or {}), where, value)


def names(value: int | str) -> list[str]:
    """The config keys an expression reads (for messages and validation)."""
    if isinstance(value, int):
        return []
    try:
        tree = ast.parse(value.strip(), mode="eval")
    except SyntaxError:
        return []
    return [_dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Name | ast.Attribute) and _dotted(n)]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    return ""


class _Keys:
    """config.json, and the defaults for the keys it lacks."""

    def __init__(self, config: Mapping[str, Any], defaults: Mapping[str, int]) -> None:
        self.config, self.defaults = config, defaults

    def get(self, dotted: str) -> Any:
        value = lookup(self.config, dotted)
        return self.defaults.get(dotted) if value is None else value


def _bounded(value: int, where: str, what: str) -> int:
    """`value`, if no larger in magnitude than any tensor dim can be (every step of an expression is checked,
    so no intermediate grows either); else a CkptconvError saying `what` it is (never the value's digits)."""
    if -MAX_SIZE <= value <= MAX_SIZE:
        return value
    raise CkptconvError(f"{where}: {what} is larger than any tensor dim can be (2**63 - 1); fix the value")


def _eval(node: ast.AST, config: _Keys, where: str, text: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value, where, f"size {text!r}")
    if isinstance(node, ast.Name | ast.Attribute):
        key = _dotted(node)
        value = config.get(key) if key else None
        if type(value) is not int:
            raise MissingKey(f"{where}: size {key!r} is not an integer in config.json; pass --config")
        return _bounded(value, where, f"config key {key!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, config, where, text)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        a, b = _eval(node.left, config, where, text), _eval(node.right, config, where, text)
        if isinstance(node.op, ast.Add):
            return _bounded(a + b, where, f"size {text!r}")
        if isinstance(node.op, ast.Sub):
            return _bounded(a - b, where, f"size {text!r}")
        if isinstance(node.op, ast.Mult):
            return _bounded(a * b, where, f"size {text!r}")
        if b == 0 or a % b:
            raise CkptconvError(f"{where}: size {text!r} divides {a} by {b}, which is not exact")
        return a // b
    raise CkptconvError(f"{where}: size {text!r} may only use integers, config keys, + - * / and ()")
