"""The tensor-parallel size a Megatron checkpoint was saved at, as the mapping config reads it. Pure.

Megatron-FSDP on Megatron-LM main stores a gated delta net's fused `in_proj` / `conv1d` as the concatenation
over TP ranks of each rank's [q | k | v | z | beta | alpha] rows, so splitting them needs the TP size of the
job that saved them. Read with another TP size they still load, scrambled; so the size is never guessed.

The run layer puts it in the config a mapping reads, as `gdn_tensor_parallel_size` (and, when config.json
lacks it, `tensor_model_parallel_size`): from the checkpoint's own `args.tensor_model_parallel_size`, else
from `--megatron-tp N`. A flag that contradicts the args is refused; a mapping that needs the size where
neither says it is refused naming the first tensor that needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.megatron import megatron_info
from ckptconv.mapping import expr
from ckptconv.mapping.rules import KeyMapping, map_keys
from ckptconv.mapping.types import Rule

TP_NAME = "gdn_tensor_parallel_size"  # the config name fused GDN rules group by
TP_KEY = "tensor_model_parallel_size"  # Megatron's own name, set too when config.json lacks it
_SIZE_FIELDS = (
    "sizes",
    "groups",
    "hf_groups",
    "narrow",
    "padded",
    "multiple",
    "heads",
    "hf_shape",
    "runtime_shape",
)


def saved_tp(ckpt: DcpCheckpoint) -> int | None:
    """The TP size a Megatron checkpoint's args say it was saved at; None when they do not (or not one)."""
    info = megatron_info(ckpt)
    return None if info is None else info.tensor_model_parallel_size


def with_tp(config: Mapping[str, Any] | None, saved: int | None, flag: int | None) -> dict[str, Any]:
    """`config` with the TP size the checkpoint was saved at: `saved` (its args say), else `flag`
    (`--megatron-tp`); a `flag` contradicting `saved` is refused. Neither: `config` as it is."""
    out = dict(config or {})
    if flag is not None and saved is not None and flag != saved:
        raise CkptconvError(
            f"--megatron-tp {flag}: the checkpoint was saved at TP {saved} (its args say); leave the flag out"
        )
    tp = saved if saved is not None else flag
    if tp is None:
        return out
    out[TP_NAME] = tp
    out.setdefault(TP_KEY, tp)
    return out


def check_tp_known(
    mapping: KeyMapping, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]
) -> None:
    """Refuse, naming the first tensor that needs it, a mapping whose rules for these tensors (in the layout
    detected from them) group by `gdn_tensor_parallel_size` when the config does not give it."""
    if TP_NAME in config or not any(_reads_tp(rule) for rule in mapping.rules):
        return
    rules = {rule.number for rule in mapping.rules if _reads_tp(rule)}
    # the mapping run with any size for it (1 always divides): which targets its rules made, from what
    probe = map_keys(mapping, "to_hf", shapes, {**config, TP_NAME: 1}, allow_unmapped=True)
    for target in probe.targets:
        if target.rule in rules:
            raise CkptconvError(
                f"{target.sources[0]!r}: stored grouped by the tensor-parallel size of the job that saved "
                "it, which the checkpoint's args do not say; pass --megatron-tp N (the TP size of the job "
                "that saved it)"
            )


def _reads_tp(rule: Rule) -> bool:
    """Whether a size of `rule` is an expression reading `gdn_tensor_parallel_size`."""
    for name in _SIZE_FIELDS:
        value = getattr(rule, name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, str) and TP_NAME in expr.names(v) for v in values):
            return True
    return False
