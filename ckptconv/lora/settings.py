"""An adapter's settings: r, alpha, rsLoRA, DoRA, per-module patterns, and the `adapter_config.json` PEFT
reads. Pure, apart from reading `--lora-config`.

They come from the trainer's PEFT config (`--lora-config FILE`, or `adapter_config.json` in the checkpoint
directory), else from the factors' shapes and the flags: r is A's rows (the most common one; the others go
to `rank_pattern`), alpha is `--lora-alpha`, `target_modules` the targeted modules' last names (or, when
that would also match an untargeted module, a regex of their full names), or `--lora-targets` when it
names exactly the targeted modules as PEFT matches them (`chosen_targets`). PEFT's scaling per module:

    scaling = alpha / r            (alpha / sqrt(r) with use_rslora)

with r and alpha taken from `rank_pattern` / `alpha_pattern` when a pattern matches the module's name.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.core.user_regex import UserRegex
from ckptconv.errors import CkptconvError
from ckptconv.formats.documents import load_json
from ckptconv.formats.files import CONFIG_BYTES, read_regular
from ckptconv.lora.checks import check_alpha, check_config
from ckptconv.lora.keys import Factors

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = CONFIG_BYTES  # formats/files.py holds the limits of every file read beside a checkpoint


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: float
    rslora: bool = False
    dora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    config: dict[str, Any] | None = None  # the trainer's adapter_config.json, as read
    source: str = "flags"  # where they came from, for messages

    def rank(self, module: str) -> int:
        return int(_pattern(self.rank_pattern, module, self.r, f"{self.source}: rank_pattern key"))

    def scaling(self, module: str) -> float:
        """PEFT's `scaling[adapter]` of `module` (a Python float, as PEFT multiplies by it)."""
        where = f"{self.source}: alpha_pattern key"
        r, alpha = self.rank(module), _pattern(self.alpha_pattern, module, self.alpha, where)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def _pattern(patterns: dict[str, Any], module: str, default: Any, what: str) -> Any:
    """PEFT's pattern lookup: the first key that matches the end of the module's dotted name (PEFT's
    `re.match(rf"(.*\\.)?({key})$", module)`, here by RE2: linear in the name, whatever the key)."""
    for key, value in patterns.items():
        if UserRegex(rf"(.*\.)?({key})$", what, shown=key).match(module):
            return value
    return default


def read_config(path: Path, root: Path | None = None) -> dict[str, Any]:
    """A PEFT LoRA `adapter_config.json` (one beside a checkpoint must resolve inside its `root`); anything
    else is a CkptconvError naming the file."""
    raw = read_regular(path, root, MAX_CONFIG_BYTES)  # a regular file (never a FIFO), size checked first
    try:
        config = load_json(raw, f"--lora-config {path}") if len(raw) <= MAX_CONFIG_BYTES else None
    except ValueError as e:
        raise CkptconvError(f"--lora-config {path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise CkptconvError(f"--lora-config {path}: not a PEFT adapter_config.json (a JSON object)")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise CkptconvError(
            f"--lora-config {path}: peft_type is {kind!r}; ckptconv converts LoRA (and DoRA) adapters only"
        )
    return config


def settings(
    factors: dict[str, Factors],
    shapes: dict[str, tuple[int, ...]],
    config: dict[str, Any] | None,
    alpha: float | None,
    rslora: bool,
    source: str,
) -> LoraSettings:
    """The settings of one adapter from its factors' shapes (`shapes`: selected key -> shape) and the
    trainer's config, else the flags; alpha is required (it is in no tensor)."""
    ranks = {f.module: shapes[f.a][0] // f.experts for f in factors.values()}
    dora = any(f.magnitude for f in factors.values())
    if config is not None:
        check_config(config, source)
        out = LoraSettings(
            r=config["r"],
            alpha=config["lora_alpha"],
            rslora=bool(config.get("use_rslora")),
            dora=bool(config.get("use_dora")),
            rank_pattern=dict(config.get("rank_pattern") or {}),
            alpha_pattern=dict(config.get("alpha_pattern") or {}),
            fan_in_fan_out=bool(config.get("fan_in_fan_out")),
            config=config,
            source=source,
        )
        for module, r in ranks.items():
            if out.rank(module) != r:
                raise CkptconvError(
                    f"{source}: says r={out.rank(module)} for {module!r}, whose factors have rank {r}; "
                    "is it the config of this run?"
                )
        if out.dora != dora:
            raise CkptconvError(
                f"{source}: use_dora is {out.dora}, but the checkpoint {'holds' if dora else 'holds no'} "
                "DoRA magnitude vectors; is it the config of this run?"
            )
        return out
    if alpha is None:
        raise CkptconvError(
            "the LoRA alpha is in no tensor: give --lora-alpha N, or --lora-config FILE (the trainer's PEFT "
            f"adapter_config.json; one named {CONFIG_FILE} in the checkpoint directory is read by itself)"
        )
    check_alpha(alpha)
    alpha = int(alpha) if float(alpha).is_integer() else alpha  # written as PEFT writes it (lora_alpha: 8)
    r = Counter(ranks.values()).most_common(1)[0][0]
    pattern = {module: rank for module, rank in ranks.items() if rank != r}
    return LoraSettings(r, alpha, rslora, dora, pattern, source="--lora-alpha")


def target_modules(factors: dict[str, Factors], modules: set[str]) -> list[str] | str:
    """PEFT's `target_modules` for the targeted modules among all the model's `modules`: their last names,
    when no untargeted module has one of them; else a regex of their full names (PEFT full-matches it)."""
    return _modules({f.module for f in factors.values() if f.kind != "param"}, modules)


def _modules(targeted: set[str], modules: set[str]) -> list[str] | str:
    if not targeted:
        return []
    leaves = {m.rsplit(".", 1)[-1] for m in targeted}
    if all(m in targeted for m in modules if m.rsplit(".", 1)[-1] in leaves):
        return sorted(leaves)
    return "^(?:" + "|".join(re.escape(m) for m in sorted(targeted)) + ")$"


def chosen_targets(targets: tuple[str, ...], targeted: set[str], modules: set[str]) -> list[str]:
    """`--lora-targets` as PEFT's `target_modules` (as given, once each), when PEFT would adapt exactly the
    `targeted` modules (those with factors) among all the model's `modules` with them; else a CkptconvError.
    PEFT matches an entry to a module named so, or whose name ends with "." + the entry."""
    names = list(dict.fromkeys(targets))
    for module in sorted(targeted):
        if not any(_matches(name, module) for name in names):
            raise CkptconvError(
                f"--lora-targets: no name matches {module!r}, which has LoRA factors (PEFT would not load "
                f"them); add {module.rsplit('.', 1)[-1]!r} or its full name"
            )
    for name in names:
        if not any(_matches(name, m) for m in targeted):
            leaves = ", ".join(sorted({m.rsplit(".", 1)[-1] for m in targeted}))
            raise CkptconvError(
                f"--lora-targets: {name!r} matches no module with LoRA factors (PEFT refuses a target that "
                f"matches nothing); the adapted modules are {leaves}"
            )
        extra = sorted(m for m in modules - targeted if _matches(name, m))
        if extra:
            raise CkptconvError(
                f"--lora-targets: {name!r} also matches {extra[0]!r}, which has no LoRA factors (PEFT would "
                "give it an untrained adapter, missing from the file); name the adapted modules more fully"
            )
    return names


def _matches(name: str, module: str) -> bool:
    """PEFT's match of a `target_modules` list entry: the module's name, or its end after a dot."""
    return module == name or module.endswith("." + name)


def target_parameters(factors: dict[str, Factors]) -> list[str] | None:
    """PEFT's `target_parameters`: each ParamWrapper's parameter as `parent.module.param` (PEFT matches a
    suffix of the parameter's full name), in a stable order; None without any."""
    names = {
        ".".join([*f.module.split(".")[-2:], str(f.param)]) for f in factors.values() if f.kind == "param"
    }
    return sorted(names) or None


def adapter_config(
    s: LoraSettings,
    factors: dict[str, Factors],
    modules: set[str],
    base_model: str | None,
    targets: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The adapter_config.json written with adapter mode: the trainer's own when it was given, else one
    derived from the shapes and the flags (`targets`: `--lora-targets`), with PEFT's defaults for the rest."""
    if s.config is not None:
        return s.config
    targeted = {f.module for f in factors.values() if f.kind != "param"}
    chosen = chosen_targets(targets, targeted, modules) if targets else target_modules(factors, modules)
    return {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model,
        "task_type": None,
        "r": s.r,
        "lora_alpha": s.alpha,
        "target_modules": chosen,
        "target_parameters": target_parameters(factors),
        "rank_pattern": s.rank_pattern,
        "alpha_pattern": {},
        "use_rslora": s.rslora,
        "use_dora": s.dora,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def mapped_config(
    config: dict[str, Any], ranks: dict[str, int], modules: set[str], targets: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`config` for an adapter whose factors a mapping renamed: `target_modules` and `rank_pattern` said
    again with the mapped modules' names (`ranks`: each adapted module's r; `modules`: all of the mapped
    model's); `targets` (`--lora-targets`, in the mapped names) checked against them and written as given.
    An `alpha_pattern`, keyed by the trainer's names, has no such translation: refused."""
    if config.get("alpha_pattern"):
        raise CkptconvError(
            "--lora adapter with --mapping: the config's alpha_pattern names the trainer's modules and is "
            "not translated yet; convert without --mapping, or merge"
        )
    r = config["r"]
    adapted = set(ranks)
    chosen = chosen_targets(targets, adapted, modules) if targets else _modules(adapted, modules)
    return {
        **config,
        "target_modules": chosen,
        "rank_pattern": {m: n for m, n in sorted(ranks.items()) if n != r},
    }
