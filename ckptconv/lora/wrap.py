"""hf-to-dcp `--lora-adapter`: a base model's tensors and a PEFT adapter's, under the names a PEFT-wrapped
model has (the inverse of `select`'s adapter mode). Pure.

    base     X.weight  (X targeted)          -> base_model.model.X.base_layer.weight
             Y.weight  (Y not)               -> base_model.model.Y.weight
    adapter  base_model.model.X.lora_A.weight  -> base_model.model.X.lora_A.NAME.weight
             base_model.model.X.lora_embedding_A   -> base_model.model.X.lora_embedding_A.NAME
             base_model.model.X.lora_magnitude_vector  -> base_model.model.X.lora_magnitude_vector.NAME.weight
             base_model.model.X.base_layer.weight  (a targeted embedding's, which PEFT saves): replaces
                                                   the base model's X.weight, as PEFT's loading does

Every parameter of a targeted module (its bias too) moves under `base_layer`.
"""

from __future__ import annotations

import re
from typing import TypeVar

from ckptconv.errors import CkptconvError
from ckptconv.lora.keys import PEFT_PREFIX

_SAVED = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?:(?P<linear>lora_[AB])\.weight|(?P<embedding>lora_embedding_[AB])"
    r"|(?P<magnitude>lora_magnitude_vector)|base_layer\.(?P<base>[^.]+))$"
)

T = TypeVar("T")


def _check_fit(factors: dict[str, T], weight: T, where: str) -> None:
    """A module's factors fit its weight W and each other (`lora.checks`' rules): linear A [r, in], B [out, r]
    of W [out, in], embedding A [r, vocab], B [dim, r] of W [vocab, dim], r >= 1, DoRA's magnitude [out]."""
    w = tuple(getattr(weight, "shape", ()))
    shapes = {key: tuple(getattr(value, "shape", ())) for key, value in factors.items()}
    a = next((k for k in shapes if ".lora_A." in k or ".lora_embedding_A." in k), None)
    b = next((k for k in shapes if ".lora_B." in k or ".lora_embedding_B." in k), None)
    if a is None or b is None:
        missing = "A" if a is None else "B"
        raise CkptconvError(f"{where}: {next(iter(shapes))!r}: its LoRA {missing} factor is missing")
    out_in = (w[1], w[0]) if ".lora_embedding_" in a and len(w) == 2 else w
    ra = shapes[a][0] if shapes[a] else 0
    fits = len(w) == 2 and ra >= 1 and shapes[a] == (ra, out_in[1]) and shapes[b] == (out_in[0], ra)
    if ".lora_embedding_" not in a:  # DoRA's magnitude of a linear layer: one per output row
        fits &= all(shape == w[:1] for key, shape in shapes.items() if ".lora_magnitude_vector." in key)
    if not fits:
        raise CkptconvError(
            f"{where}: its LoRA factors {a!r} {list(shapes[a])} and {b!r} {list(shapes[b])} do not fit the "
            f"weight {list(w)} (A [r, in], B [out, r], r >= 1); is it an adapter of this model?"
        )


def wrap(base: dict[str, T], adapter: dict[str, T], name: str, where: str) -> dict[str, T]:
    """`base` (HF key -> stored tensor) and `adapter` (PEFT's saved keys -> stored tensor) as one dict keyed
    by the PEFT-wrapped model's names (each value is kept as it is: it is read where it is stored). `where`
    names the adapter in errors."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
        raise CkptconvError(f"--lora-name {name!r}: an adapter name is letters, digits, '_' or '-'")
    factors: dict[str, dict[str, T]] = {}  # module -> new key -> tensor
    replaced: dict[str, T] = {}  # base key -> the adapter's copy (a targeted embedding's base layer)
    for key, value in adapter.items():
        match = _SAVED.match(key)
        if match is None:
            raise CkptconvError(
                f"{where}: {key!r} is not a LoRA factor as PEFT saves one (...lora_A.weight, "
                "...lora_embedding_A, ...lora_magnitude_vector); only LoRA and DoRA adapters are read"
            )
        module = match["module"]
        mine = factors.setdefault(module, {})
        if match["base"]:
            replaced[f"{module}.{match['base']}"] = value
        elif match["linear"]:
            mine[f"{PEFT_PREFIX}{module}.{match['linear']}.{name}.weight"] = value
        elif match["embedding"]:
            mine[f"{PEFT_PREFIX}{module}.{match['embedding']}.{name}"] = value
        else:
            mine[f"{PEFT_PREFIX}{module}.lora_magnitude_vector.{name}.weight"] = value
    targeted = {m for m, f in factors.items() if f}
    for module in sorted(targeted):
        if module.endswith(".base_layer") or f"{module}.weight" not in base:
            nested = module.endswith(".base_layer") or any(k.startswith(module + ".") for k in base)
            why = (
                "an adapter of target_parameters (stacked experts): --lora-adapter does not read those yet"
                if nested
                else "is it an adapter of this model?"
            )
            raise CkptconvError(f"{where}: adapts {module!r}, which has no weight in the base model; {why}")
    for key in replaced:
        if key not in base:
            raise CkptconvError(f"{where}: holds {key!r}, which the base model does not have")
    for module in sorted(targeted):
        _check_fit(factors[module], replaced.get(f"{module}.weight", base[f"{module}.weight"]), where)
    out: dict[str, T] = {}
    for key, value in base.items():
        module, _, param = key.rpartition(".")
        value = replaced.get(key, value)
        if module in targeted:
            out[f"{PEFT_PREFIX}{module}.base_layer.{param}"] = value
            if param == "weight":
                out.update(factors[module])
        else:
            out[PEFT_PREFIX + key] = value
    return out
