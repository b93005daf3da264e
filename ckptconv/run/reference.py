"""dcp-to-hf's reference check: the planned output against `--reference` (or `--copy-from`'s weights), before
anything is written. Collective: call it on every rank with the same plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.hf import is_hf_dir, open_hf
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main
from ckptconv.options import DcpToHfOptions
from ckptconv.plan import reference as compare
from ckptconv.plan.types import HfSavePlan


def reference_of(options: DcpToHfOptions) -> tuple[str, Path] | None:
    """The flag and directory the output is compared with: `--reference`, else `--copy-from`'s when it
    holds weights (a directory of config and tokenizer files alone is no reference); None: no check."""
    if options.reference is not None:
        return "--reference", options.reference
    if options.copy_from is not None and is_hf_dir(options.copy_from):
        return "--copy-from", options.copy_from
    return None


def _read(flag: str, path: Path) -> compare.Tensors:
    """The reference's tensors from its index and headers alone (a quantized weight as its logical tensor)."""
    try:
        tensors = open_hf(path).tensors
    except CkptconvError as e:
        raise CkptconvError(f"{flag} {path}: {e}", exit_code=e.exit_code) from None
    return {key: (t.shape, t.dtype_name) for key, t in tensors.items()}


def _check(world: World, plan: HfSavePlan, options: DcpToHfOptions, flag: str, path: Path) -> list[Any]:
    """Every rank: rank 0 reads the headers for all; the differences, refused unless allowed."""
    theirs = from_main(world, lambda: _read(flag, path))
    # a --quantize'd output's dtypes differ on purpose; otherwise dtypes are compared, and only told
    found = compare.compare(compare.planned_tensors(plan), theirs, dtypes=options.quantize is None)
    refusal = compare.refusal(str(path), found)
    if refusal is not None and not options.allow_layout_change:
        raise CkptconvError(refusal)
    return found


def check_reference(
    world: World, ui: Ui, plan: HfSavePlan, options: DcpToHfOptions
) -> dict[str, Any] | None:
    """Compare the plan with the reference; refuse (exit 2, one line) a key or shape difference unless
    `allow_layout_change`, then each is a warning. The --json report's `reference` (None: no reference)."""
    chosen = reference_of(options)
    if chosen is None:
        return None
    flag, path = chosen
    if options.lora is not None and options.lora.mode == "adapter":
        # an adapter's keys are its LoRA factors, not the base's weights: there is nothing to compare
        if flag == "--reference":
            ui.info(f"--reference {path}: not compared, --lora adapter writes an adapter, not base keys")
        return None
    found = everyone(world, _check, world, plan, options, flag, path)
    for difference in found:
        if difference.refuses:
            ui.warn(f"--allow-layout-change: {difference.text} ({flag} {path})")
    note = compare.dtype_note(str(path), found)
    if note is not None:
        ui.info(note)
    return {"path": str(path), "differences": [d.to_json() for d in found]}
