"""PEFT's `target_parameters` (ParamWrapper): which stacked-expert parameter each wrapper's factors adapt.
Pure.

PEFT wraps a module once per targeted parameter, each wrapper inside the last, so a module with two
targeted parameters saves

    M.base_layer.base_layer.gate_up_proj   [E, 2I, H]      M.base_layer.base_layer.down_proj   [E, H, I]
    M.base_layer.lora_A.NAME.weight        [E * r, H]      M.base_layer.lora_B.NAME.weight     [2I, r * E]
    M.lora_A.NAME.weight                   [E * r, I]      M.lora_B.NAME.weight                [H, r * E]

The innermost wrapper adapts the first targeted parameter in the module's own order (the order its
parameters are saved in; the config's order does not matter), the outermost the last. The targeted ones are
those the config's `target_parameters` names (a suffix of `M.param`); without the config, all of the
module's parameters when there are as many as wrappers, else those whose shapes alone fit. Either way the
shapes must fit: [E, out, in] (or [E, in, out]) with A [E * r, in] and B [out, r * E].
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.lora.keys import Factors, LoraKeys


def resolve(
    found: LoraKeys,
    factors: dict[str, Factors],
    shapes: dict[str, tuple[int, ...]],
    config: dict[str, Any] | None,
) -> dict[str, Factors]:
    """`factors` with every ParamWrapper's `param` and `experts` filled in (`shapes`: selected key ->
    shape)."""
    if not any(f.kind == "param" for f in factors.values()):
        return factors
    selected = dict(found.base)
    depth_count: dict[str, int] = {}
    for mods in found.adapters.values():
        for f in mods.values():
            if f.kind == "param":
                depth_count[f.module] = max(depth_count.get(f.module, 0), f.depth + 1)
    targets = (config or {}).get("target_parameters") or None
    out = {}
    for wrapper, f in factors.items():
        if f.kind != "param":
            out[wrapper] = f
            continue
        shape_of = {p: shapes[selected[f"{f.module}.{p}"]] for p in found.wrapped[f.module]}
        fits = [p for p, shape in shape_of.items() if _fits(shape, shapes[f.a], shapes[f.b])]
        wrappers = depth_count[f.module]
        if targets is not None:
            ordered = [p for p in shape_of if any(f"{f.module}.{p}".endswith(str(t)) for t in targets)]
        elif len(shape_of) == wrappers:
            ordered = list(shape_of)
        else:
            ordered = fits if len(fits) == wrappers else []
        if len(ordered) != wrappers:
            raise CkptconvError(
                f"{f.module!r}: {wrappers} LoRA wrapper(s) of target_parameters, and which of its parameters "
                f"({', '.join(shape_of)}) they adapt is not clear; give --lora-config (the trainer's "
                "adapter_config.json, with target_parameters)"
            )
        param = ordered[wrappers - 1 - f.depth]
        if param not in fits:
            raise CkptconvError(
                f"{f.module}.{param} {list(shape_of[param])}: its LoRA factors {list(shapes[f.a])} and "
                f"{list(shapes[f.b])} do not fit it (A [E * r, in], B [out, r * E])"
            )
        out[wrapper] = dataclasses.replace(f, param=param, experts=shape_of[param][0])
    return out


def _fits(param: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    if len(param) != 3 or len(a) != 2 or len(b) != 2 or not param[0] or a[0] % param[0] or a[0] != b[1]:
        return False
    return param[1:] in ((b[0], a[1]), (a[1], b[0]))


def swapped(param: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether the stacked parameter is [E, out, in] (PEFT's `_did_swap_in_out_features`; its default for
    a module without `is_transposed`); else [E, in, out]. A square one is taken as [E, out, in], as PEFT
    takes it unless the module says otherwise."""
    return param[1:] == (b[0], a[1])
