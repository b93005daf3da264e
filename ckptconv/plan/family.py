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
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.mapping import load_mapping
from ckptconv.mapping.family import TRANSFORMERS, covered_spec, model_type
from ckptconv.mapping.types import KeyMapping
from ckptconv.plan.base import Base
from ckptconv.plan.follow import follow_experts
from ckptconv.plan.reference import compare, planned_tensors
from ckptconv.plan.types import HfSavePlan

Replan = Callable[[KeyMapping, "str | None"], HfSavePlan]
"""Plans the output again with a mapping and the expert form it follows (`follow_experts`)."""


def refuses(plan: HfSavePlan, base: Base) -> bool:
    """Whether the plan's keys or shapes differ from the reference's (dtypes aside)."""
    return any(d.refuses for d in compare(planned_tensors(plan), base.tensors, dtypes=False))


def follow_family(
    plan: HfSavePlan,
    base: Base | None,
    config: Mapping[str, Any],
    hf_experts: str | None,
    replan: Replan,
) -> HfSavePlan:
    """`plan` (made with no mapping), or the plan of config.json's transformers family when `plan` does not
    match the reference `base` and that one does; a note then says so. A source the family's mapping cannot
    read (not in its runtime layout) keeps `plan`, and the reference check tells its differences."""
    if base is None or not refuses(plan, base):
        return plan
    spec = covered_spec(config)
    if spec is None:
        return plan
    mapping, experts = follow_experts(load_mapping(spec, hf_experts), base, config, hf_experts)
    assert mapping is not None
    try:
        other = replan(mapping, experts)
    except CkptconvError:  # a key its rules do not map: the source is not in that runtime layout
        return plan
    if refuses(other, base):
        return plan
    said = (
        f"the checkpoint holds transformers' runtime layout of {model_type(config)}; written as "
        f"save_pretrained stores it, as in {base.text} (--mapping {TRANSFORMERS})"
    )
    return dataclasses.replace(other, notes=(*other.notes, said))
