"""dcp-to-hf's reference model (`--reference`, or `--copy-from`'s weights): read once by rank 0 for every rank
before planning (the plan follows it: `plan.follow`), then the planned output compared with it before
anything is written. Collective: call each step on every rank with the same arguments."""

from __future__ import annotations

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


def reference_of(options: DcpToHfOptions) -> tuple[str, Path] | None:
    """The flag and directory the output is compared with: `--reference`, else `--copy-from`'s when it
    holds weights (a directory of config and tokenizer files alone is no reference); None: no check."""
    if options.reference is not None:
        return "--reference", options.reference
    if options.copy_from is not None and is_hf_dir(options.copy_from):
        return "--copy-from", options.copy_from
    return None


def _read(flag: str, path: Path) -> Base:
    """The reference's tensors from its index and headers alone (a quantized weight as its logical tensor),
    in file order, then in the order of their data in each file."""
    try:
        hf = open_hf(path)
    except CkptconvError as e:
        raise CkptconvError(f"{flag} {path}: {e}", exit_code=e.exit_code) from None
    stored = sorted(hf.tensors.values(), key=lambda t: (hf.files.index(t.file), t.data_offset))
    return Base(
        flag,
        str(path),
        {t.key: (t.shape, t.dtype_name) for t in stored},
        {t.key: t.file.name for t in stored},
        indexed=(path / INDEX_FILE).is_file(),
    )


def read_base(world: World, ui: Ui, options: DcpToHfOptions) -> Base | None:
    """Every rank: the reference model (rank 0 reads its index and headers for all); None without one, or
    for `--lora adapter` (an adapter's keys are its LoRA factors: nothing to follow or compare)."""
    chosen = everyone(world, from_main, world, lambda: reference_of(options))
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
    return everyone(world, from_main, world, lambda: _read(flag, path))


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
