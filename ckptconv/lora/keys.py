"""LoRA factors' names (PEFT's and torchtune's), read from a checkpoint's keys. Pure.

A model wrapped by PEFT (`get_peft_model`) and saved whole (FSDP2 + DCP, `get_model_state_dict`) names its
tensors, for an adapter called `default`:

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight      W  [out, in]   the base weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight  A  [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight  B  [out, r]
    base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight   m [out]  (DoRA)
    base_model.model.model.embed_tokens.lora_embedding_A.default            A  [r, vocab]  (an embedding)
    base_model.model.model.embed_tokens.lora_embedding_B.default            B  [dim, r]
    base_model.model.model.layers.0.self_attn.k_proj.weight                 an untargeted weight

`find_lora` splits such keys into the base model's keys (`base_model.model.` and `.base_layer` dropped: the
names the unwrapped model has) and each adapter's factors per targeted module. Other PEFT methods (LoHa,
LoKr, IA3, ...) and `modules_to_save` copies are refused by name.

torchtune's LoRA modules (`LoRALinear`, `DoRALinear`) keep the base weight where it was and name the
factors `M.lora_a.weight`, `M.lora_b.weight` (and `M.magnitude`): read as one adapter called `default`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from ckptconv.errors import CkptconvError

PEFT_PREFIX = "base_model.model."
EMBEDDING_NAMES = ("embed_tokens", "lm_head")  # PEFT saves these base weights with their factors
_FACTOR = re.compile(
    r"^(?P<module>.+)\.(?:lora_(?P<ab>[AB])\.(?P<name>[^.]+)\.weight"
    r"|lora_embedding_(?P<eab>[AB])\.(?P<ename>[^.]+)"
    r"|lora_magnitude_vector\.(?P<mname>[^.]+)(?:\.weight)?)$"
)
# torchtune's LoRALinear / DoRALinear: `M.weight` beside `M.lora_a.weight`, `M.lora_b.weight`, `M.magnitude`
_TUNE = re.compile(r"^(?P<module>.+)\.(?:lora_(?P<ab>[ab])\.weight|(?P<mag>magnitude))$")
TUNE_ADAPTER = "default"  # torchtune holds one adapter, unnamed
_BASE_LAYERS = re.compile(r"(?:\.base_layer)+\.")  # nested: one wrapper per targeted parameter
_TRAILING = re.compile(r"(?:\.base_layer)+$")
# markers of PEFT methods other than LoRA / DoRA, and of what ckptconv does not convert yet
_OTHER_KINDS = (
    (re.compile(r"\.hada_(w|t)\d"), "LoHa"),
    (re.compile(r"\.lokr_(w|t)\d"), "LoKr"),
    (re.compile(r"\.ia3_l\."), "IA3"),
    (re.compile(r"\.(oft_r|oft_s)\."), "OFT"),
    (re.compile(r"\.boft_"), "BOFT"),
    (re.compile(r"\.vera_lambda_"), "VeRA"),
    (re.compile(r"\.lora_E\."), "AdaLoRA"),
    (re.compile(r"\.lora_bias\."), "LoRA with lora_bias"),
    (
        re.compile(r"\.(modules_to_save|original_module)\."),
        "modules_to_save (a fully trained copy of a module)",
    ),
)


@dataclass(frozen=True)
class Factors:
    """One targeted module of one adapter: the keys of its A and B (and DoRA's magnitude), as selected."""

    module: str  # the module's name in the unwrapped model: "model.layers.0.self_attn.q_proj"
    kind: Literal["linear", "embedding", "param"]  # "param": PEFT's target_parameters (ParamWrapper)
    a: str
    b: str
    magnitude: str | None = None
    param: str | None = "weight"  # the parameter it adapts (a ParamWrapper's: found by `select`)
    depth: int = 0  # how many `base_layer`s down its wrapper is (target_parameters nest one per parameter)
    experts: int = 1  # a ParamWrapper of stacked experts [E, ., .]: A is [E * r, in], B [out, r * E]

    @property
    def weight(self) -> str:
        """The key of the weight it adapts, in the unwrapped model."""
        return f"{self.module}.{self.param}"

    @property
    def wrapper(self) -> str:
        """The wrapper's name: the module, then one `.base_layer` per level down."""
        return self.module + ".base_layer" * self.depth


@dataclass(frozen=True)
class LoraKeys:
    """What `find_lora` found: the base model's keys and every adapter's factors."""

    base: tuple[tuple[str, str], ...]  # (key in the unwrapped model, key as selected)
    adapters: dict[str, dict[str, Factors]] = field(default_factory=dict)  # name -> wrapper -> factors
    prefixed: bool = True  # the keys carry PEFT's `base_model.model.` prefix
    wrapped: dict[str, tuple[str, ...]] = field(default_factory=dict)  # ParamWrapper module -> its params

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def adapter(self, name: str | None) -> tuple[str, dict[str, Factors]]:
        """The adapter `--lora-name` picks (the only one when None)."""
        if name is None:
            if len(self.adapters) > 1:
                raise CkptconvError(
                    f"the checkpoint holds {len(self.adapters)} LoRA adapters ({', '.join(self.adapters)}); "
                    "pick one with --lora-name NAME"
                )
            name = next(iter(self.adapters))
        if name not in self.adapters:
            raise CkptconvError(
                f"--lora-name {name!r}: no such adapter; the checkpoint holds {', '.join(self.adapters)}"
            )
        return name, self.adapters[name]


def find_lora(keys: Iterable[str]) -> LoraKeys | None:
    """The LoRA structure of `keys` (selected HF-side keys), or None when they hold no LoRA factor."""
    keys = list(keys)
    for key in keys:
        for marker, kind in _OTHER_KINDS:
            if marker.search(key):
                raise CkptconvError(
                    f"{key!r}: a {kind} tensor; ckptconv converts LoRA and DoRA adapters only "
                    "(merge or save the adapter with PEFT itself)"
                )
    found: dict[str, dict[str, dict[str, str]]] = {}  # name -> wrapper -> role -> key
    base: list[tuple[str, str]] = []
    tune: dict[str, dict[str, str]] = {}  # torchtune's names: module -> role -> key
    for key in keys:
        match = _FACTOR.match(key)
        if match is None and (other := _TUNE.match(key)) is not None:
            role = f"linear_{other['ab'].upper()}" if other["ab"] else "magnitude"
            tune.setdefault(other["module"], {})[role] = key
            continue
        if match is None:
            base.append((_BASE_LAYERS.sub(".", key), key))
            continue
        ab, eab = match["ab"], match["eab"]
        name = match["name"] or match["ename"] or match["mname"]
        role = f"linear_{ab}" if ab else f"embedding_{eab}" if eab else "magnitude"
        roles = found.setdefault(name, {}).setdefault(match["module"], {})
        roles[role] = key
    for module, roles in tune.items():  # a lone `magnitude` is some module's own parameter, not DoRA's
        if set(roles) == {"magnitude"}:
            base.append((roles["magnitude"], roles["magnitude"]))
        else:
            found.setdefault(TUNE_ADAPTER, {})[module] = roles
    if not found:
        return None
    prefixed = all(k.startswith(PEFT_PREFIX) for k in keys)
    renamed = [(_unwrapped(k, prefixed), key) for k, key in base]
    plain: dict[str, str] = {}
    for k, key in renamed:
        if plain.setdefault(k, key) != key:  # `M.base_layer.weight` beside `M.weight`
            raise CkptconvError(
                f"{plain[k]!r} and {key!r} are both {k!r} once PEFT's wrappers are taken off; the checkpoint "
                "holds two weights for one parameter"
            )
    depths: dict[str, set[int]] = {}  # module -> the depths of its wrappers (any adapter)
    for mods in found.values():
        for wrapper in mods:
            module, depth = _module_depth(_unwrapped(wrapper, prefixed))
            depths.setdefault(module, set()).add(depth)
    # a module wrapped once, with a weight of its own, is a LoRA layer; any other is a ParamWrapper
    params = {
        m: _wrapped_params(m, renamed) for m, d in depths.items() if d != {0} or m + ".weight" not in plain
    }
    adapters = {
        name: {_unwrapped(w, prefixed): _factors(w, roles, prefixed, params) for w, roles in mods.items()}
        for name, mods in found.items()
    }
    for module in sorted(depths):
        if not (params.get(module) or module + ".weight" in plain):
            raise CkptconvError(
                f"LoRA factors of {module!r} but no base weight for it ({module}.base_layer.weight); "
                "the checkpoint does not hold the whole wrapped model"
            )
    return LoraKeys(tuple(renamed), adapters, prefixed, params)


def _module_depth(wrapper: str) -> tuple[str, int]:
    """`model.layers.0.mlp.experts.base_layer` -> (`model.layers.0.mlp.experts`, 1)."""
    module = _TRAILING.sub("", wrapper)
    return module, wrapper[len(module) :].count(".base_layer")


def _wrapped_params(module: str, renamed: list[tuple[str, str]]) -> tuple[str, ...]:
    """The parameters of a ParamWrapper's module: its own, stored under its `base_layer`s."""
    lead = module + "."
    return tuple(
        k[len(lead) :]
        for k, key in renamed
        if k.startswith(lead) and "." not in k[len(lead) :] and ".base_layer." in key
    )


def _unwrapped(key: str, prefixed: bool) -> str:
    return key.removeprefix(PEFT_PREFIX) if prefixed else key


def _factors(
    wrapper: str, roles: dict[str, str], prefixed: bool, params: dict[str, tuple[str, ...]]
) -> Factors:
    module, depth = _module_depth(_unwrapped(wrapper, prefixed))
    if "linear_A" in roles or "linear_B" in roles:
        kind, a, b = "linear", roles.get("linear_A"), roles.get("linear_B")
    else:
        kind, a, b = "embedding", roles.get("embedding_A"), roles.get("embedding_B")
    if a is None or b is None:
        present = next(iter(roles.values()))
        raise CkptconvError(f"{present!r}: its LoRA {'B' if b is None else 'A'} factor is missing")
    if module in params:  # which parameter it adapts is found from the config and the shapes (`select`)
        return Factors(module, "param", a, b, roles.get("magnitude"), None, depth)
    return Factors(module, kind, a, b, roles.get("magnitude"))  # type: ignore[arg-type]


def peft_key(f: Factors, role: Literal["a", "b", "magnitude", "base"]) -> str:
    """The key PEFT's `save_pretrained` gives a factor: the adapter's name left out, as
    `get_peft_model_state_dict` writes it (`...q_proj.lora_A.weight`, `...embed_tokens.lora_embedding_A`,
    `...q_proj.lora_magnitude_vector`); "base": a targeted embedding's base weight, which it saves too."""
    module = PEFT_PREFIX + f.wrapper
    if role == "base":
        return module + ".base_layer.weight"
    if role == "magnitude":
        return module + ".lora_magnitude_vector"
    letter = role.upper()
    if f.kind == "embedding":
        return f"{module}.lora_embedding_{letter}"
    return f"{module}.lora_{letter}.weight"
