"""Value checks of an adapter before anything is computed from it: the fields of its `adapter_config.json`
that ckptconv reads, `--lora-alpha`, and its factors' shapes. Pure.

    r, rank_pattern values     whole numbers >= 1 (a rank-0 factor has no update; r is a divisor)
    lora_alpha, alpha_pattern  finite numbers (the trainer's own, of any sign; --lora-alpha: > 0)
    use_rslora, use_dora, fan_in_fan_out    true, false or null (not read by truthiness)
    target_parameters          null or a list of non-empty strings
    A [r, in], B [out, r] of a weight W [out, in]  (an embedding W [vocab, dim]: A [r, vocab], B [dim, r]),
    r >= 1, DoRA's magnitude [out]; a ParamWrapper's A [E * r, in], B [out, r * E] (`params`)
"""

from __future__ import annotations

import math
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.lora.keys import Factors

FLAGS = ("use_rslora", "use_dora", "fan_in_fan_out")


def check_alpha(alpha: float) -> None:
    """`--lora-alpha`: a finite number > 0."""
    if not 0 < alpha < math.inf:
        raise CkptconvError(f"--lora-alpha {alpha}: must be a finite number > 0")


def check_config(config: dict[str, Any], source: str) -> None:
    """The fields of a PEFT LoRA config ckptconv reads; a CkptconvError naming `source` and the field."""
    _rank(config.get("r"), source, "'r'")
    _number(config.get("lora_alpha"), source, "'lora_alpha'")
    for flag in FLAGS:
        value = config.get(flag)
        if value is not None and not isinstance(value, bool):
            raise CkptconvError(f"{source}: {flag!r} is {_show(value)}; it must be true or false")
    for name, check in (("rank_pattern", _rank), ("alpha_pattern", _number)):
        table = config.get(name)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise CkptconvError(
                f"{source}: {name!r} is {_show(table)}; it must be an object (module pattern -> value)"
            )
        for pattern, value in table.items():
            check(value, source, f"{name}[{pattern!r}]")
    targets = config.get("target_parameters")
    listed = isinstance(targets, list) and all(isinstance(t, str) and t for t in targets)
    if targets is not None and not listed:
        raise CkptconvError(
            f"{source}: 'target_parameters' is {_show(targets)}; it must be a list of parameter names or null"
        )


def _rank(value: Any, source: str, field: str) -> None:
    if type(value) is not int or value < 1:
        raise CkptconvError(f"{source}: {field} is {_show(value)}; it must be a whole number >= 1")


def _number(value: Any, source: str, field: str) -> None:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise CkptconvError(f"{source}: {field} is {_show(value)}; it must be a finite number")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_factors(
    factors: dict[str, Factors], shapes: dict[str, tuple[int, ...]], selected: dict[str, str]
) -> None:
    """Every module's factors fit its weight and each other (`shapes`: selected key -> shape; `selected`:
    weight key in the unwrapped model -> selected key); a CkptconvError naming them otherwise."""
    for f in factors.values():
        a, b = shapes[f.a], shapes[f.b]
        if f.kind == "param":  # `params.resolve` fitted them to the stacked parameter
            fits = len(a) == 2 and a[0] > 0
            want = "A [E * r, in], B [out, r * E], r >= 1"
        else:
            w = shapes[selected[f.weight]]
            out_in = (w[1], w[0]) if f.kind == "embedding" and len(w) == 2 else w
            fits = len(w) == 2 and len(a) == len(b) == 2 and a[0] > 0 and a == (a[0], out_in[1])
            fits = fits and b == (out_in[0], a[0])
            want = "A [r, vocab], B [dim, r]" if f.kind == "embedding" else "A [r, in], B [out, r]"
            want = f"{want}, r >= 1, of {f.weight!r} {list(w)}"
        if fits and f.magnitude is not None and f.kind == "linear":
            fits = shapes[f.magnitude] == shapes[selected[f.weight]][:1]
            want += f"; DoRA's magnitude {f.magnitude!r} {list(shapes[f.magnitude])} [out]"
        if not fits:
            raise CkptconvError(
                f"LoRA factors {f.a!r} {list(a)} and {f.b!r} {list(b)} do not fit ({want}); the checkpoint "
                "is not one PEFT model"
            )
