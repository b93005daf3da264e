"""The reference model of dcp-to-hf (`--reference`, or `--copy-from`'s weights) and of save_hf (`reference`,
or `copy_from`'s): where its files are (a hub repo id's small files fetched into the hub cache), read once by
rank 0 for every rank before planning (the plan follows it: `plan.follow`),
then the planned output compared with it before anything is written. Collective: call each step on every rank
with the same arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.core.specs import HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.hf import INDEX_FILE, is_hf_dir, open_hf
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main
from ckptconv.plan import reference as compare
from ckptconv.plan.base import Base, Following, Words
from ckptconv.plan.types import HfSavePlan
from ckptconv.source.hub_reference import HubBase, fetch


@dataclass(frozen=True)
class Bases:
    """Where the copied model's and the reference's files are on this machine: the directories given, or for
    a hub repo id its snapshot folder in the hub cache (its small files; its headers read in `hub`)."""

    copy_from: Path | None = None
    """The copied model's directory (a repo id's snapshot: its side files, never its weights)."""
    reference: Path | None = None
    """The reference's directory (a repo id's snapshot: its index and config.json)."""
    hub: dict[str, HubBase] = field(default_factory=dict)
    """option -> the hub repo it named, with its headers where they are the reference."""


def locate_bases(world: World, following: Following) -> Bases:
    """Every rank: where the copied model and the reference are; rank 0 fetches a repo id's small files and
    reads its headers for all."""
    words = following.words

    def find() -> Bases:
        hub: dict[str, HubBase] = {}
        copied, alone = None, following.reference is None  # the copied model's headers: only as the reference
        if following.copy_from is not None:
            copied = fetch(following.copy_from, words.copy_from, side_files=True, headers=alone)
        referred = None
        if following.reference is not None:
            referred = fetch(following.reference, words.reference)
        for flag, found in ((words.copy_from, copied), (words.reference, referred)):
            if found is not None:
                hub[flag] = found
        return Bases(
            following.copy_from if copied is None else copied.directory,
            following.reference if referred is None else referred.directory,
            hub,
        )

    if following.copy_from is None and following.reference is None:
        return Bases()
    return everyone(world, from_main, world, find)


def reference_of(following: Following, bases: Bases | None = None) -> tuple[str, Path] | None:
    """The option and directory the output is compared with: the reference named alone, else the copied
    model's when it holds weights (a directory of config and tokenizer files alone is no reference); None: no
    check."""
    words = following.words
    if following.reference is not None:
        return words.reference, following.reference
    hub = None if bases is None else bases.hub.get(words.copy_from)
    if hub is not None and following.copy_from is not None:
        return (words.copy_from, following.copy_from) if hub.checkpoint is not None else None
    if following.copy_from is not None and is_hf_dir(following.copy_from):
        return words.copy_from, following.copy_from
    return None


def open_base(named: str, path: Path, hub: HubBase | None = None) -> HfCheckpoint:
    """A base model's tensors from its index and headers alone (a hub repo's as `hub` read them already);
    an error is one line starting with `named` (`--reference BASE`)."""
    try:
        hf = open_hf(path) if hub is None else hub.checkpoint
    except CkptconvError as e:
        raise CkptconvError(f"{named}: {e}", exit_code=e.exit_code) from None
    if hf is None:
        raise CkptconvError(f"{named}: holds no safetensors files; name the base model's repo")
    return hf


def _read(flag: str, path: Path, words: Words, hub: HubBase | None = None) -> Base:
    """The reference's tensors from its index and headers alone (a quantized weight as its logical tensor),
    in file order, then in the order of their data in each file (a hub repo's as `hub` read them)."""
    hf = open_base(f"{words.lead}{flag}{words.assign}{path}", path, hub)
    number = {file: i for i, file in enumerate(hf.files)}  # a file's place, once: not a list scan per tensor
    stored = sorted(hf.tensors.values(), key=lambda t: (number[t.file], t.data_offset))
    return Base(
        flag,
        str(path),
        {t.key: (t.shape, t.dtype_name) for t in stored},
        {t.key: t.file.name for t in stored},
        indexed=(hf.path / INDEX_FILE).is_file(),
        words=words,
    )


def read_base(world: World, ui: Ui, following: Following, bases: Bases | None = None) -> Base | None:
    """Every rank: the reference model (rank 0 reads its index and headers for all); None without one, or
    for a LoRA adapter (an adapter's keys are its LoRA factors: nothing to follow or compare)."""
    words = following.words
    chosen = everyone(world, from_main, world, lambda: reference_of(following, bases))
    if following.by_files:
        if chosen is None:
            raise CkptconvError(
                f"{words.lead}{words.split_reference}: names no reference; pass "
                f"{words.reference}{words.assign}BASE (or {words.copy_from}{words.assign}BASE holding its "
                f"weights), or {words.split_size}"
            )
        if following.adapter:
            raise CkptconvError(
                f"{words.lead}{words.split_reference}: {words.lora_adapter} writes one "
                f"adapter_model.safetensors, as PEFT reads it; leave {words.file_split} out"
            )
    if chosen is None:
        return None
    flag, path = chosen
    if following.adapter:
        if flag == words.reference:
            said = f"{words.lora_adapter} writes an adapter, not base keys"
            ui.info(f"{flag}{words.assign}{path}: not compared, {said}")
        return None
    hub = None if bases is None else bases.hub.get(flag)
    return everyone(world, from_main, world, lambda: _read(flag, path, words, hub))


def check_reference(
    world: World, ui: Ui, plan: HfSavePlan, following: Following, base: Base | None
) -> dict[str, Any] | None:
    """Compare the plan with the reference; refuse (exit 2, one line, on every rank) a key or shape
    difference unless `allow_layout_change`, then each is a warning. Say what the plan adopted from it. The
    --json report's `reference` (None: no reference)."""
    if base is None:
        return None
    words = following.words
    # a quantized output's dtypes differ on purpose; otherwise dtypes are compared, and only told
    found = compare.compare(compare.planned_tensors(plan), base.tensors, dtypes=not following.quantized)
    refusal = compare.refusal(base.path, found, fixes=words.fixes, allow=words.allow, out=words.out)
    if refusal is not None and not following.allow_layout_change:
        raise CkptconvError(f"{words.lead}{refusal}", agreed=world.distributed)
    if plan.adopted is not None:
        for line in plan.adopted.lines(base):
            ui.info(line)
    for difference in found:
        if difference.refuses:
            ui.warn(f"{words.allow}: {difference.text} ({base.text})")
    note = compare.dtype_note(base.path, found, words.dtypes)
    if note is not None:
        ui.info(note)
    adopted = None if plan.adopted is None else plan.adopted.to_json()
    return {"path": base.path, "differences": [d.to_json() for d in found], "adopted": adopted}
