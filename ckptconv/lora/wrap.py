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

from ..errors import CkptconvError
from .keys import PEFT_PREFIX

_SAVED = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?:(?P<linear>lora_[AB])\.weight|(?P<embedding>lora_embedding_[AB])"
    r"|(?P<magnitude>lora_magnitude_vector)|base_layer\.(?P<base>[^.]+))$"
)

T = TypeVar("T")


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
