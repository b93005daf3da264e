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

import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

from ckptconv.core.specs import Common
from ckptconv.errors import CkptconvError
from ckptconv.formats.documents import load_json
from ckptconv.formats.files import mode_of, naming, read_regular
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

BACKENDS = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
CHECKPOINT_VERSION = 3.0


def common_state(iteration: int | None) -> dict[str, float | int]:
    """The plain values `common.pt` holds (floats and ints only: no pickled class)."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0 if iteration is None else int(iteration)}


def write_side_files(directory: Path, iteration: int | None) -> None:
    """Rank 0, once the DCP files are in `directory`: Megatron-Core's `metadata.json` and `common.pt`."""
    import torch

    buffer = io.BytesIO()
    torch.save(common_state(iteration), buffer)
    with naming(directory / COMMON_FILE):
        (directory / COMMON_FILE).write_bytes(buffer.getvalue())
    with naming(directory / MARKER_FILE):  # megatron writes it last: a directory with it is complete
        (directory / MARKER_FILE).write_text(json.dumps(BACKENDS))
