"""What a release carries: the model's tensors, and the training progress a user reads back. Pure.

A training checkpoint holds more than the model. Its top-level groups (the nesting DCP records in
`planner_data`; for Megatron-Core, whose keys are global names with no nesting record, the first dotted or
slashed part of the key) say what each entry is:

  model                the weights (when the checkpoint has such a group, only it is converted; of
                       Megatron-FSDP, `model.module.` and each virtual pipeline chunk's `model<N>.module.`,
                       stripped and joined)
  optimizer state      `optim`, `optimizer`, ...: never written to an HF directory
  trainer state        dataloader, LR scheduler, RNG, module `_extra_state` (TransformerEngine's FP8
                       metadata): what a job needs to resume, not a release; left out unless
                       `--keep-trainer-state`, and named in the notes
  progress             everything else that is not a weight: `step`, `iteration`, tokens seen, `args`,
                       0-d tensors in non-model groups (an older torchtitan's `train_state.step`) and
                       Megatron's common state (common.pt, 0.19's common_state item, Megatron-FSDP's
                       `args` / `iteration` / `checkpoint_version`) as values: stashed in
                       `ckptconv_state.json`
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ckptconv.core.specs import DcpCheckpoint, NonTensorItem, StashedItem, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.megatron_fsdp import PREFIX, model_key

if TYPE_CHECKING:
    from ckptconv.lora.select import LoraPlan
    from ckptconv.plan.types import TiedHead

MODEL_GROUP = "model"
OPTIMIZER_GROUPS = frozenset({"optim", "optimizer", "optimizers", "optim_state", "optimizer_state"})
TRAINER_GROUPS = frozenset(
    {
        "lr_scheduler",
        "lr_schedulers",
        "scheduler",
        "schedulers",
        "opt_param_scheduler",  # Megatron-LM's LR / weight-decay scheduler
        "dataloader",
        "dataloaders",
        "data_loader",
        "rng",
        "rng_state",
        "rng_states",
        "rerun_state_machine",  # Megatron-LM's fault-tolerance state
    }
)
# top-level groups of a training checkpoint that are not model weights: their tensors never land in HF files
NON_MODEL_GROUPS = OPTIMIZER_GROUPS | TRAINER_GROUPS | {"train_state"}
_EXTRA_STATE = re.compile(r"(^|\.)_extra_state(/shard_[0-9._]+)?$")
Kind = Literal["optimizer", "trainer", "progress"]


@dataclass(frozen=True)
class Selection:
    """Which checkpoint tensors become which HF keys, what is stashed, and why."""

    keys: tuple[tuple[str, str], ...]  # (hf_key, fqn)
    stash: tuple[NonTensorItem, ...]  # non-tensor items, loaded when the stash is written
    notes: tuple[str, ...]
    scalars: tuple[TensorSpec, ...] = ()  # 0-d progress tensors, stashed as values
    common: tuple[StashedItem, ...] = ()  # Megatron's common.pt values, already read
    warnings: tuple[str, ...] = ()
    lora: LoraPlan | None = None  # what `--lora` made of the keys (`outs.mapped_tensors`)
    tied: tuple[TiedHead, ...] = ()  # heads a tied embedding leaves out (`outs.mapped_tensors`)


def group_of(ckpt: DcpCheckpoint, fqn: str) -> str | None:
    """The top-level group of `fqn`, None for a top-level entry (or, in Megatron, a model key)."""
    path = ckpt.paths.get(fqn, (fqn,))
    if len(path) > 1:
        return str(path[0])
    if ckpt.kind == "megatron":
        head = re.split(r"[./]", fqn, maxsplit=1)[0]
        return head if head in NON_MODEL_GROUPS else None
    return None


def kind_of(group: str | None, fqn: str) -> Kind:
    if group in OPTIMIZER_GROUPS:
        return "optimizer"
    if group in TRAINER_GROUPS or _EXTRA_STATE.search(fqn):
        return "trainer"
    return "progress"


def select_tensors(ckpt: DcpCheckpoint, prefix: str | None, keep_trainer_state: bool = False) -> Selection:
    """Pick the model's tensors and what to stash; strip `prefix` (or the `model` group) from the keys."""
    notes: list[str] = []
    groups = {group_of(ckpt, fqn) for fqn in ckpt.tensors}
    if prefix is not None:
        strip = prefix if prefix.endswith(".") else prefix + "."
        chosen = [fqn for fqn in ckpt.tensors if fqn.startswith(strip)]
        if not chosen:
            starts = sorted({fqn.split(".", 1)[0] + "." for fqn in ckpt.tensors})[:8]
            raise CkptconvError(
                f"--prefix {prefix!r} matched no tensor key; keys start with: {', '.join(starts) or '(none)'}"
            )
        skipped = len(ckpt.tensors) - len(chosen)
        if skipped:
            notes.append(f"--prefix {prefix!r}: {len(chosen)} tensors kept, {skipped} outside it skipped")
    elif ckpt.kind == "fsdp_dtensor":
        strip, chosen = "", []
        fsdp_keys, note = _fsdp_model(ckpt, groups)
        notes.append(note)
    elif MODEL_GROUP in groups:
        strip = MODEL_GROUP + "."
        chosen = [fqn for fqn in ckpt.tensors if group_of(ckpt, fqn) == MODEL_GROUP]
        others = sorted(str(g) for g in groups - {MODEL_GROUP} if g is not None)
        left = [repr(g) for g in others]
        if None in groups:  # tensors outside any group (a trainer's `step`: stashed, not converted)
            loose = sum(1 for fqn in ckpt.tensors if group_of(ckpt, fqn) is None)
            left.append(f"{loose} other top-level tensor(s)")
        notes.append(
            f"taking the {MODEL_GROUP!r} group ({len(chosen)} tensors)"
            + (f"; not converting {', '.join(left)}" if left else "")
        )
    else:
        strip = ""
        chosen = [fqn for fqn in ckpt.tensors if group_of(ckpt, fqn) not in NON_MODEL_GROUPS]
        dropped = sorted(  # a 0-d progress tensor (train_state.step) is stashed, not dropped
            {
                str(g)
                for f, spec in ckpt.tensors.items()
                if (g := group_of(ckpt, f)) in NON_MODEL_GROUPS
                and (spec.shape or kind_of(g, f) != "progress")
            }
        )
        if dropped:
            notes.append(f"not converting the {', '.join(repr(g) for g in dropped)} state")
    keys = tuple((fqn[len(strip) :], fqn) for fqn in chosen)
    if ckpt.kind == "fsdp_dtensor" and prefix is None:
        keys, chosen = fsdp_keys, [fqn for _, fqn in fsdp_keys]
    for hf_key, fqn in keys:
        if not hf_key and prefix is not None:
            raise CkptconvError(f"--prefix {prefix!r} leaves the key {fqn!r} empty; use a shorter prefix")
        if not hf_key:  # an HF file cannot name a tensor with nothing (nor could a model load it)
            raise CkptconvError(
                f"{ckpt.path}: holds a tensor with an empty name ({fqn!r}); ckptconv converts named tensors "
                "only: re-save the checkpoint with a name for it"
            )
    left_out: dict[str, int] = {}

    def kept(fqn: str, group: str | None) -> bool:
        kind = kind_of(group, fqn)
        if kind == "trainer" and not keep_trainer_state:
            name = "_extra_state" if _EXTRA_STATE.search(fqn) else str(group)
            left_out[name] = left_out.get(name, 0) + 1
        return kind == "progress" or (kind == "trainer" and keep_trainer_state)

    through_common = set(ckpt.common.items) if ckpt.common is not None else set()
    stash = tuple(
        item
        for fqn, item in ckpt.items.items()
        if fqn not in through_common and kept(fqn, group_of(ckpt, fqn))
    )
    taken = set(chosen)
    scalars = tuple(
        spec
        for fqn, spec in ckpt.tensors.items()
        if fqn not in taken
        and not spec.shape
        and _progress_place(ckpt, fqn)
        and kept(fqn, group_of(ckpt, fqn))
    )
    common, warnings = _common(ckpt, keep_trainer_state, left_out)
    if left_out:
        what = ", ".join(f"{name!r} ({n})" for name, n in sorted(left_out.items()))
        notes.append(
            f"leaving out trainer state {what}: a job needs it to resume, a release does not "
            "(--keep-trainer-state keeps it in ckptconv_state.json)"
        )
    return Selection(keys, stash, tuple(notes), scalars, common, warnings)


def _progress_place(ckpt: DcpCheckpoint, fqn: str) -> bool:
    """In a non-model group, or a top-level entry with no dot in its name (such as `step`)."""
    group = group_of(ckpt, fqn)
    return group in NON_MODEL_GROUPS or (group is None and "." not in fqn and "/" not in fqn)


def _common(
    ckpt: DcpCheckpoint, keep_trainer_state: bool, left_out: dict[str, int]
) -> tuple[tuple[StashedItem, ...], tuple[str, ...]]:
    """Megatron's common.pt: its readable progress values as stash items, and a warning naming what of
    them could not be read (the whole file is then stashed as bytes too)."""
    common = ckpt.common
    if common is None:
        return (), ()
    items: list[StashedItem] = []
    unreadable: list[str] = []
    for key, value in common.values.items():
        kind = kind_of(key, key)
        if kind == "optimizer":
            continue
        if kind == "trainer" and not keep_trainer_state:
            left_out[key] = left_out.get(key, 0) + 1
            continue
        unreadable += common.unreadable.get(key, ())
        if value is not None:
            items.append(StashedItem(key, (key,), b"", value, True))
    if not unreadable:
        return tuple(items), ()
    raw_key = common.raw_key
    items.append(StashedItem(raw_key, (raw_key,), common.raw, None, False, "holds classes"))
    if common.items:  # DCP items: name the item, and where its bytes went
        where, kept = f"{ckpt.path}: {common.source!r}", f"the whole {common.source!r} item is kept as bytes"
        kept += f" in ckptconv_state.json ({raw_key!r})"
    else:
        where, kept = str(ckpt.path / common.source), f"the whole {common.source} is kept as bytes"
        kept += " in ckptconv_state.json"
    warning = f"{where}: left out {', '.join(unreadable)}: ckptconv never runs a checkpoint's classes; {kept}"
    return tuple(items), (warning,)


def _fsdp_model(ckpt: DcpCheckpoint, groups: set[str | None]) -> tuple[tuple[tuple[str, str], ...], str]:
    """A Megatron-FSDP checkpoint's model tensors, `model.module.` (or each virtual pipeline chunk's
    `model<N>.module.`) stripped, the chunks' keys together; a key in two chunks is refused. And the note
    saying what was taken."""
    seen: dict[str, str] = {}
    chunks: set[str] = set()
    for fqn in ckpt.tensors:
        found = model_key(fqn)
        if found is None and PREFIX.fullmatch(fqn):  # the prefix alone: a tensor with an empty name
            found = (fqn, "")
        if found is None:
            continue
        chunk, key = found
        chunks.add(chunk)
        if key in seen:
            raise CkptconvError(
                f"{ckpt.path}: {seen[key]!r} and {fqn!r} are one tensor in two virtual pipeline chunks; "
                "the checkpoint is inconsistent (re-save it)"
            )
        seen[key] = fqn
    others = sorted(str(g) for g in groups if g is not None and not re.fullmatch(r"model[0-9]*", str(g)))
    under = ", ".join(repr(c) for c in sorted(chunks))
    note = f"Megatron-FSDP: taking the model under {under} ({len(seen)} tensors)"
    if others:
        note += f"; not converting {', '.join(repr(g) for g in others)}"
    return tuple((key, fqn) for key, fqn in seen.items()), note
