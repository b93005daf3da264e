"""dcp-to-hf's reference model (`--reference`, or `--copy-from`'s weights): where its files are (a hub repo
id's small files fetched into the hub cache), read once by rank 0 for every rank before planning (the plan
follows it: `plan.follow`), then the planned output compared with it before anything is written.
Collective: call each step on every rank with the same arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.hf import INDEX_FILE, is_hf_dir, open_hf
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main
from ckptconv.options import DcpToHfOptions
from ckptconv.plan import reference as compare
from ckptconv.plan.base import Base
from ckptconv.plan.types import HfSavePlan
from ckptconv.source.hub_reference import HubBase, fetch


@dataclass(frozen=True)
class Bases:
    """Where `--copy-from`'s and `--reference`'s files are on this machine: the directories given, or for a
    hub repo id its snapshot folder in the hub cache (its small files; its headers read in `hub`)."""

    copy_from: Path | None = None
    """--copy-from's directory (a repo id's snapshot: its side files, never its weights)."""
    reference: Path | None = None
    """--reference's directory (a repo id's snapshot: its index and config.json)."""
    hub: dict[str, HubBase] = field(default_factory=dict)
    """flag -> the hub repo it named, with its headers where they are the reference."""


def locate_bases(world: World, options: DcpToHfOptions) -> Bases:
    """Every rank: where --copy-from and --reference are; rank 0 fetches a repo id's small files and reads
    its headers for all."""

    def find() -> Bases:
        hub: dict[str, HubBase] = {}
        copied, alone = None, options.reference is None  # --copy-from's headers: only as the reference
        if options.copy_from is not None:
            copied = fetch(options.copy_from, "--copy-from", side_files=True, headers=alone)
        referred = fetch(options.reference, "--reference") if options.reference is not None else None
        for flag, found in (("--copy-from", copied), ("--reference", referred)):
            if found is not None:
                hub[flag] = found
        return Bases(
            options.copy_from if copied is None else copied.directory,
            options.reference if referred is None else referred.directory,
            hub,
        )

    if options.copy_from is None and options.reference is None:
        return Bases()
    return everyone(world, from_main, world, find)


def reference_of(options: DcpToHfOptions, bases: Bases | None = None) -> tuple[str, Path] | None:
    """The flag and directory the output is compared with: `--reference`, else `--copy-from`'s when it
    holds weights (a directory of config and tokenizer files alone is no reference); None: no check."""
    if options.reference is not None:
        return "--reference", options.reference
    hub = None if bases is None else bases.hub.get("--copy-from")
    if hub is not None and options.copy_from is not None:
        return ("--copy-from", options.copy_from) if hub.checkpoint is not None else None
    if options.copy_from is not None and is_hf_dir(options.copy_from):
        return "--copy-from", options.copy_from
    return None


def _read(flag: str, path: Path, hub: HubBase | None = None) -> Base:
    """The reference's tensors from its index and headers alone (a quantized weight as its logical tensor),
    in file order, then in the order of their data in each file (a hub repo's as `hub` read them)."""
    try:
        hf = open_hf(path) if hub is None else hub.checkpoint
    except CkptconvError as e:
        raise CkptconvError(f"{flag} {path}: {e}", exit_code=e.exit_code) from None
    if hf is None:
        raise CkptconvError(f"{flag} {path}: holds no safetensors files; name the base model's repo")
    stored = sorted(hf.tensors.values(), key=lambda t: (hf.files.index(t.file), t.data_offset))
    return Base(
        flag,
        str(path),
        {t.key: (t.shape, t.dtype_name) for t in stored},
        {t.key: t.file.name for t in stored},
        indexed=(hf.path / INDEX_FILE).is_file(),
    )


def read_base(world: World, ui: Ui, options: DcpToHfOptions, bases: Bases | None = None) -> Base | None:
    """Every rank: the reference model (rank 0 reads its index and headers for all); None without one, or
    for `--lora adapter` (an adapter's keys are its LoRA factors: nothing to follow or compare)."""
    chosen = everyone(world, from_main, world, lambda: reference_of(options, bases))
    if options.file_split == "reference":
        if chosen is None:
            raise CkptconvError(
                "--file-split reference: names no reference; pass --reference BASE (or --copy-from BASE "
                "holding its weights), or --file-split size"
            )
        if options.lora is not None and options.lora.mode == "adapter":
            raise CkptconvError(
                "--file-split reference: --lora adapter writes one adapter_model.safetensors, as PEFT reads "
                "it; leave --file-split out"
            )
    if chosen is None:
        return None
    flag, path = chosen
    if options.lora is not None and options.lora.mode == "adapter":
        if flag == "--reference":
            ui.info(f"--reference {path}: not compared, --lora adapter writes an adapter, not base keys")
        return None
    hub = None if bases is None else bases.hub.get(flag)
    return everyone(world, from_main, world, lambda: _read(flag, path, hub))


def check_reference(
    world: World, ui: Ui, plan: HfSavePlan, options: DcpToHfOptions, base: Base | None
) -> dict[str, Any] | None:
    """Compare the plan with the reference; refuse (exit 2, one line) a key or shape difference unless
    `allow_layout_change`, then each is a warning. Say what the plan adopted from it. The --json report's
    `reference` (None: no reference)."""
    if base is None:
        return None
    # a --quantize'd output's dtypes differ on purpose; otherwise dtypes are compared, and only told
    found = compare.compare(compare.planned_tensors(plan), base.tensors, dtypes=options.quantize is None)
    refusal = compare.refusal(base.path, found)
    if refusal is not None and not options.allow_layout_change:
        raise CkptconvError(refusal, agreed=world.distributed)
    if plan.adopted is not None:
        for line in plan.adopted.lines(base):
            ui.info(line)
    for difference in found:
        if difference.refuses:
            ui.warn(f"--allow-layout-change: {difference.text} ({base.text})")
    note = compare.dtype_note(base.path, found)
    if note is not None:
        ui.info(note)
    adopted = None if plan.adopted is None else plan.adopted.to_json()
    return {"path": base.path, "differences": [d.to_json() for d in found], "adopted": adopted}
