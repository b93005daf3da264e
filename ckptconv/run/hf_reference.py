"""hf-to-dcp's reference check: `--reference CKPT_DIR`, a training checkpoint of the target job, read from its
`.metadata` alone (the allowlist unpickler of `formats.dcp`): its model tensors' dtypes are the output's (no
`--dtype` given), and the planned DCP must hold its keys and shapes before anything is written. Collective:
call each step on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import is_dcp_dir, open_dcp
from ckptconv.formats.files import exists
from ckptconv.formats.hf import is_hf_dir
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main
from ckptconv.options import HfToDcpOptions
from ckptconv.plan import dcp_reference
from ckptconv.plan import reference as compare
from ckptconv.plan.types import DcpSavePlan


def check_path(path: Path | None) -> None:
    """`--reference` is a DCP checkpoint (None: none given); refused with one line naming it otherwise."""
    if path is None:
        return
    if not exists(path):
        raise CkptconvError(f"--reference {path}: no such file or directory")
    if not is_dcp_dir(path):
        hint = " (an HF model is dcp-to-hf's reference)" if is_hf_dir(path) else ""
        raise CkptconvError(
            f"--reference {path}: not a DCP checkpoint (no .metadata){hint}; give a checkpoint directory the "
            "target job saved with dcp.save"
        )


def _read(path: Path) -> compare.Tensors:
    """The reference's model tensors, from `.metadata` alone (no tensor bytes, nothing unpickled but DCP's
    own metadata classes)."""
    check_path(path)
    try:
        tensors = dcp_reference.reference_tensors(open_dcp(path))
    except CkptconvError as e:
        raise CkptconvError(f"--reference {path}: {e}", exit_code=e.exit_code) from None
    if not tensors:
        raise CkptconvError(f"--reference {path}: holds no model tensors to compare with")
    return tensors


def read_reference(world: World, options: HfToDcpOptions) -> compare.Tensors | None:
    """Every rank: the reference's model tensors, read by rank 0 for all (None: no `--reference`)."""
    path = options.reference
    if path is None:
        return None
    return everyone(world, from_main, world, lambda: _read(path))


def policy(options: HfToDcpOptions, reference: compare.Tensors | None) -> DtypePolicy:
    """The output dtypes: `--dtype` / `--fp32`; with a reference and no `--dtype`, each floating tensor the
    reference holds in the reference's floating dtype (`--fp32` still beats it), the others kept."""
    if reference is None:
        return options.dtype.policy()
    return options.dtype.policy({key: dtype for key, (_, dtype) in reference.items()})


def fits(plan: DcpSavePlan, reference: compare.Tensors) -> bool:
    """Whether the planned DCP has the reference's keys and shapes (dtypes aside)."""
    found = compare.compare(dcp_reference.planned_tensors(plan), reference, dtypes=False)
    return not any(d.refuses for d in found)


def check_reference(
    world: World, ui: Ui, plan: DcpSavePlan, options: HfToDcpOptions, reference: compare.Tensors | None
) -> dict[str, Any] | None:
    """Every rank: the plan against the reference; a key or shape difference refused (exit 2, one line)
    unless `allow_layout_change`, then each a warning; dtype differences one info line. The --json report's
    `reference` (None: no reference)."""
    if reference is None or options.reference is None:
        return None
    path = str(options.reference)
    found = compare.compare(dcp_reference.planned_tensors(plan), reference)
    refusal = compare.refusal(path, found, fixes=dcp_reference.FIXES)
    if refusal is not None and not options.allow_layout_change:
        raise CkptconvError(refusal)
    for difference in found:
        if difference.refuses:
            ui.warn(f"--allow-layout-change: {difference.text} (--reference {path})")
    note = compare.dtype_note(path, found)
    if note is not None:
        ui.info(note)
    return {"path": path, "differences": [d.to_json() for d in found]}
