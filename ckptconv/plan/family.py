"""Without `--mapping`, a source in transformers 5's runtime layout released the way its base stores it. Pure.

A transformers-5 training job (FSDP2, accelerate, TRL) saves its modules' state dict: some families hold
their MoE experts fused there (`mlp.experts.gate_up_proj [E, 2I, H]`) while `save_pretrained`, and so the
base model on the Hub, stores one `mlp.experts.{e}.gate_proj.weight [I, H]` per expert. When the reference
shows such a layout and config.json names a family `--mapping transformers` covers, that family's mapping is
taken, without the flag, where it makes the output match the reference and the keys as they are do not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ckptconv.errors import CkptconvError
from ckptconv.mapping import load_mapping
from ckptconv.mapping.family import TRANSFORMERS, covered_spec, model_type
from ckptconv.mapping.types import KeyMapping
from ckptconv.plan.base import Base
from ckptconv.plan.follow import follow_experts
from ckptconv.plan.reference import compare, planned_tensors
from ckptconv.plan.types import HfSavePlan

P = TypeVar("P")


def family_plan(
    plan: P, fits: Callable[[P], bool], config: Mapping[str, Any], replan: Callable[[KeyMapping], P]
) -> tuple[P, str | None]:
    """`plan` (made with no mapping) when it `fits` the reference, else the plan of config.json's
    transformers family (`replan` with its mapping) when that one fits, with the line that says so. A source
    the family's mapping cannot read (not in its layout) keeps `plan`; the reference check then tells."""
    if fits(plan):
        return plan, None
    spec = covered_spec(config)
    if spec is None:
        return plan, None
    try:
        other = replan(load_mapping(spec))
    except CkptconvError:  # a key its rules do not map: the source is not in that layout
        return plan, None
    if not fits(other):
        return plan, None
    return other, f"transformers' runtime layout of {model_type(config)} (--mapping {TRANSFORMERS})"


def refuses(plan: HfSavePlan, base: Base) -> bool:
    """Whether the plan's keys or shapes differ from the reference's (dtypes aside)."""
    return any(d.refuses for d in compare(planned_tensors(plan), base.tensors, dtypes=False))


def follow_family(
    plan: HfSavePlan,
    base: Base | None,
    config: Mapping[str, Any],
    hf_experts: str | None,
    replan: Callable[[KeyMapping, str | None], HfSavePlan],
) -> HfSavePlan:
    """dcp-to-hf / save_hf: `plan`, or the plan of config.json's transformers family where the reference
    `base` calls for it (`family_plan`; its HF expert form followed as any mapping's), with a note."""
    if base is None:
        return plan

    def again(mapping: KeyMapping) -> HfSavePlan:
        followed, experts = follow_experts(mapping, base, config, hf_experts)
        return replan(followed or mapping, experts)

    chosen, said = family_plan(plan, lambda p: not refuses(p, base), config, again)
    if said is None:
        return plan
    note = f"the checkpoint holds {said}; written as save_pretrained stores it, as in {base.text}"
    return dataclasses.replace(chosen, notes=(*chosen.notes, note))
