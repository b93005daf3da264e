"""Megatron-Core `torch_dist` checkpoints: what tells one apart, and its common state read without running it.

`dist_checkpointing.save` writes a torch DCP directory plus `metadata.json` (`"sharded_backend":
"torch_dist"`) and `common.pt`, a `torch.save` of every value that is not sharded: `iteration`, `args` (an
`argparse.Namespace`), `checkpoint_version`, the LR scheduler and the optimizer's param_groups (see
docs/notes/megatron-torch-dist.md). `torch.load(weights_only=True)` refuses the Namespace, and a real
Megatron-LM `args` also holds megatron's own enums and classes.

`read_common` reads `common.pt` from its pickle opcodes with an unpickler whose every global is a stand-in
(formats/opaque): a Namespace becomes a dict, a dtype its name, a path a string, and anything else an
`Opaque` record of the class name that swallows its arguments. Nothing from the checkpoint is imported or
called, and the read, the zip's inflation and the walk of what it made share one `limits.Budget`. What
JSON holds exactly is kept as values; every place an opaque object or a tensor sat is listed, so the caller
can say which parts were left out.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.documents import load_json
from ckptconv.formats.files import mode_of, read_regular
from ckptconv.formats.opaque import load_opaque, readable
from ckptconv.formats.safe_pickle import short
from ckptconv.job.limits import Budget

__all__ = ["Common", "is_megatron", "load_opaque", "read_common", "readable"]

MARKER_FILE = "metadata.json"
COMMON_FILE = "common.pt"
MAX_COMMON_BYTES = 64 * 2**20


def is_megatron(root: Path) -> bool:
    """Whether `root` holds Megatron-Core's `metadata.json` naming the torch_dist backend."""
    path = root / MARKER_FILE
    if mode_of(path) is None:
        return False
    try:
        doc = load_json(read_regular(path, root, limit=2**20), path)
    except (CkptconvError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist"


@dataclass(frozen=True)
class Common:
    """Megatron's common state: `values[key]` is the readable part of each top-level entry (None when
    nothing of it is readable); `unreadable[key]` lists `key.path (what)` for each part of it left out."""

    values: dict[str, Any]
    unreadable: dict[str, tuple[str, ...]]
    raw: bytes


def read_common(root: Path) -> Common | None:
    """`root/common.pt` read without running it; None when the checkpoint has no common.pt."""
    path = root / COMMON_FILE
    if mode_of(path) is None:
        return None
    raw = read_regular(path, root, limit=MAX_COMMON_BYTES)
    budget = Budget(path)
    try:
        value = load_opaque(raw, path, budget)
    except (pickle.UnpicklingError, zipfile.BadZipFile, ValueError, EOFError, KeyError, TypeError) as e:
        raise CkptconvError(
            f"{path}: not a readable torch.save file ({type(e).__name__}: {str(e)[:200]}); "
            "re-copy the checkpoint"
        ) from None
    if not isinstance(value, dict):
        raise CkptconvError(f"{path}: holds a {type(value).__name__}, not Megatron's common state dict")
    values: dict[str, Any] = {}
    unreadable: dict[str, tuple[str, ...]] = {}
    for key, item in value.items():
        left_out: list[str] = []
        name = key if isinstance(key, str) else short(key)
        values[name] = readable(item, name, left_out, budget)
        unreadable[name] = tuple(left_out)
    return Common(values, unreadable, raw)
