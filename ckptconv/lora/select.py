"""What each `--lora` mode makes of a checkpoint's selected keys. Pure.

    adapter   the factors, named as PEFT's `save_pretrained` names them, in `adapter_model.safetensors`,
              with an `adapter_config.json` (`settings.adapter_config`)
    merge     the base model's keys, each targeted weight carrying its `Merge` (W + scaling * B @ A)
    drop      the base model's keys alone

A checkpoint with LoRA factors and no mode is refused: the keys `base_layer` / `lora_*` load into no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ckptconv.errors import CkptconvError
from ckptconv.formats.files import exists
from ckptconv.lora.checks import check_alpha, check_config, check_factors
from ckptconv.lora.keys import EMBEDDING_NAMES, Factors, find_lora, peft_key
from ckptconv.lora.params import resolve, swapped
from ckptconv.lora.settings import CONFIG_FILE, LoraSettings, adapter_config, read_config, settings

Mode = Literal["adapter", "merge", "drop"]
# experts_*: a ParamWrapper's stacked experts, [E, out, in] or [E, in, out] (`params`)
MergeKind = Literal["linear", "embedding", "experts_out_in", "experts_in_out"]
MODES: tuple[Mode, ...] = ("adapter", "merge", "drop")
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraRequest:
    """`--lora MODE` and the flags that go with it."""

    mode: Mode | None = None
    name: str | None = None  # --lora-name: which adapter
    alpha: float | None = None  # --lora-alpha
    config: Path | None = None  # --lora-config: the trainer's adapter_config.json
    rslora: bool = False  # --lora-rslora (without a config)
    base_model: str | None = None  # --lora-base: base_model_name_or_path of the adapter's config
    targets: tuple[str, ...] = ()  # --lora-targets: target_modules of the adapter's derived config

    def check(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise CkptconvError(f"--lora {self.mode!r} is not one of {', '.join(MODES)}")
        given = [flag for flag, value in self._flags() if value]
        if self.mode is None and given:
            raise CkptconvError(f"{given[0]} applies with --lora {'|'.join(MODES)}")
        if self.alpha is not None:
            check_alpha(self.alpha)
        if self.targets:
            self._check_targets()

    def _check_targets(self) -> None:
        """`--lora-targets`: names, for the adapter_config.json adapter mode derives (no --lora-config)."""
        if self.mode != "adapter":
            raise CkptconvError("--lora-targets applies with --lora adapter (the config it derives)")
        if self.config is not None:
            raise CkptconvError(
                f"--lora-targets: --lora-config {self.config} already says target_modules; give one of the "
                "two"
            )
        if not all(self.targets):
            raise CkptconvError(
                "--lora-targets: an empty module name; give names separated by commas (--lora-targets "
                "q_proj,v_proj)"
            )

    def _flags(self) -> list[tuple[str, Any]]:
        return [
            ("--lora-name", self.name),
            ("--lora-alpha", self.alpha is not None),
            ("--lora-config", self.config),
            ("--lora-rslora", self.rslora),
            ("--lora-base", self.base_model),
        ]


AS_STORED = LoraRequest()  # internal: LoRA keys read as they are (hf-to-dcp --lora-adapter's own output)


@dataclass(frozen=True)
class Merge:
    """A targeted weight's LoRA in merge mode: the selected keys of its factors, and PEFT's scaling."""

    a: str
    b: str
    kind: MergeKind
    scaling: float
    magnitude: str | None = None  # DoRA


@dataclass(frozen=True)
class LoraPlan:
    mode: Mode
    adapter: str
    keys: tuple[tuple[str, str], ...]  # (output key, selected key)
    merges: dict[str, Merge] = field(default_factory=dict)  # base weight key -> its merge
    config: dict[str, Any] | None = None  # adapter mode: the adapter_config.json to write
    note: str = ""
    sources: tuple[tuple[str, str], ...] = ()  # (selected key, checkpoint key) of each factor
    factors: dict[str, Factors] = field(default_factory=dict)  # adapter: weight key -> its factors
    base: tuple[tuple[str, str], ...] = ()  # adapter: (key in the unwrapped model, key as selected)


def lora_plan(
    keys: list[str],
    shapes: dict[str, tuple[int, ...]],
    request: LoraRequest | None,
    src: Path,
    read_trainer_config: bool = True,
    mapped: bool = False,
) -> LoraPlan | None:
    """The keys the mode makes of `keys` (selected keys, with their `shapes`); None when there is no LoRA.
    `src`: the checkpoint directory, where an `adapter_config.json` is read when no `--lora-config` is given
    (`read_trainer_config`; False for a checkpoint in object storage). `mapped`: a mapping renames the
    modules, and `settings.mapped_config` checks `--lora-targets` against the mapped names instead."""
    if request is AS_STORED:
        return None
    found = find_lora(keys)
    mode = request.mode if request is not None else None
    if found is None:
        if mode is not None:
            raise CkptconvError(f"--lora {mode}: {src} holds no LoRA factors (lora_A / lora_B keys)")
        return None
    if mode is None:
        name = ", ".join(found.names)
        raise CkptconvError(
            f"{src}: holds LoRA adapter(s) ({name}): pick what to write with --lora adapter (the adapter "
            "in PEFT's format), --lora merge (the model with the adapter merged in) or --lora drop (the "
            "base model alone)"
        )
    assert request is not None
    name, factors = found.adapter(request.name)
    base = tuple(found.base)
    others = [n for n in found.names if n != name]
    note = f"LoRA adapter {name!r}: {len(factors)} modules" + (
        f" (not converting adapter(s) {', '.join(others)})" if others else ""
    )
    if mode == "drop":
        return LoraPlan(mode, name, base, note=note + "; dropped, writing the base model")
    config, source = _trainer_config(request, src, read_trainer_config)
    factors = resolve(found, factors, shapes, config)
    check_factors(factors, shapes, dict(found.base))
    s = settings(factors, shapes, config, request.alpha, request.rslora, source)
    if mode == "merge":
        if s.fan_in_fan_out:
            raise CkptconvError(f"{s.source}: fan_in_fan_out (Conv1D weights) is not merged by ckptconv yet")
        merges = {f.weight: _merge(f, s, shapes, dict(found.base)) for f in factors.values()}
        return LoraPlan(mode, name, base, merges, note=note + f"; merged ({_describe(s)})")
    modules = {k.removesuffix(".weight") for k, _ in base if k.endswith(".weight")}
    targets = () if mapped else request.targets
    config = adapter_config(s, factors, modules, request.base_model, targets)
    written = _adapter_keys(factors, dict(found.base))
    by_weight = {f.weight: f for f in factors.values()}
    return LoraPlan(mode, name, written, {}, config, note + f" ({_describe(s)})", (), by_weight, base)


def _trainer_config(
    request: LoraRequest, src: Path, read_trainer_config: bool
) -> tuple[dict[str, Any] | None, str]:
    """The trainer's adapter_config.json (`--lora-config`, else one beside the checkpoint), and where from."""
    path = request.config
    if path is None and read_trainer_config and exists(src / CONFIG_FILE):
        path = src / CONFIG_FILE
    config = read_config(path, None if request.config else src) if path is not None else None
    if config is not None and request.alpha is not None:
        raise CkptconvError(f"--lora-alpha: the alpha comes from {path}; give one of the two")
    if config is not None and request.targets:
        raise CkptconvError(f"--lora-targets: target_modules come from {path}; leave --lora-targets out")
    source = f"--lora-config {path}" if request.config is not None else str(path)
    if config is not None:
        check_config(config, source)
    return config, source


def _merge(
    f: Factors, s: LoraSettings, shapes: dict[str, tuple[int, ...]], selected: dict[str, str]
) -> Merge:
    if f.magnitude and f.kind == "embedding":
        raise CkptconvError(f"{f.module!r}: DoRA on an embedding is not merged by ckptconv yet")
    if f.kind == "param":
        swap = swapped(shapes[selected[f.weight]], shapes[f.a], shapes[f.b])
        return Merge(f.a, f.b, "experts_out_in" if swap else "experts_in_out", s.scaling(f.module))
    return Merge(f.a, f.b, f.kind, s.scaling(f.module), f.magnitude)


def _adapter_keys(factors: dict[str, Factors], base: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The factors under PEFT's saved names; a targeted embedding's base weight too, as PEFT saves it."""
    keys: list[tuple[str, str]] = []
    for f in factors.values():
        if f.module.rsplit(".", 1)[-1] in EMBEDDING_NAMES:
            keys.append((peft_key(f, "base"), base[f.weight]))
        keys += [(peft_key(f, "a"), f.a), (peft_key(f, "b"), f.b)]
        if f.magnitude:
            keys.append((peft_key(f, "magnitude"), f.magnitude))
    return tuple(keys)


def _describe(s: LoraSettings) -> str:
    kind = "DoRA" if s.dora else "rsLoRA" if s.rslora else "LoRA"
    return f"{kind} r={s.r}, alpha={s.alpha:g}, settings from {s.source}"
