"""hf-to-dcp's reference: the model tensors of a training checkpoint's `.metadata`, and the planned DCP's, as
`plan.reference.compare` takes them. Pure: the caller reads `.metadata`.

What is compared is what `dcp.load` with strict keys would hold the model's state dict to: every tensor key
(its full name, the prefix's groups included), shape and dtype. A training checkpoint holds more than the
model: its optimizer and trainer state groups (`plan.release.NON_MODEL_GROUPS`, `_extra_state`), 0-d progress
tensors at the top (`step`) and its non-tensor items (`step`, `args`: `BytesStorageMetadata`) are not
weights hf-to-dcp could write, so they are left out of the comparison, not told as missing.
"""

from __future__ import annotations

from ckptconv.core.dtype_names import short_name
from ckptconv.core.specs import DcpCheckpoint
from ckptconv.plan.reference import Tensors
from ckptconv.plan.release import NON_MODEL_GROUPS, group_of, kind_of
from ckptconv.plan.types import DcpSavePlan

FIXES = "--prefix or --mapping"  # the flags that change hf-to-dcp's keys and shapes


def reference_tensors(ckpt: DcpCheckpoint) -> Tensors:
    """The model tensors of the training checkpoint `ckpt`, by their full DCP key, in its order."""
    found: Tensors = {}
    for fqn, spec in ckpt.tensors.items():
        group = group_of(ckpt, fqn)
        if group in NON_MODEL_GROUPS or kind_of(group, fqn) == "trainer":
            continue  # optimizer, LR scheduler, dataloader, RNG, train_state, `_extra_state`
        if not spec.shape and group is None and "." not in fqn and "/" not in fqn:
            continue  # a 0-d progress tensor at the top (`step`), as dcp-to-hf stashes it
        found[fqn] = (spec.shape, spec.dtype_name)
    return found


def planned_tensors(plan: DcpSavePlan) -> Tensors:
    """The planned DCP's tensors by their full key (the prefix included), in the plan's order."""
    return {t.key: (t.shape, short_name(t.dtype)) for t in plan.tensors}
