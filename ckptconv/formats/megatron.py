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
can say which parts were left out. Megatron-Core 0.19 writes no common.pt: the same state is the DCP bytes
item `common_state/shard_0_1`, read the same way (`read_common_state`). `megatron_info` says what a Megatron
checkpoint (this format or Megatron-FSDP's, formats/megatron_fsdp) tells of itself: iteration, TP and PP size.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from ckptconv.core.specs import Common, DcpCheckpoint, MegatronInfo, NonTensorItem
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp_transforms import record
from ckptconv.formats.documents import load_json
from ckptconv.formats.files import mode_of, naming, open_regular, pread_exact, read_regular
from ckptconv.formats.opaque import bytes_io, load_opaque, readable
from ckptconv.formats.safe_pickle import short
from ckptconv.job.limits import Budget
from ckptconv.remote.files import RemoteFiles

__all__ = ["Common", "is_megatron", "load_opaque", "megatron_info", "read_common", "readable"]

MARKER_FILE = "metadata.json"
COMMON_FILE = "common.pt"
COMMON_STATE = "common_state"  # Megatron-Core 0.19's DCP item of the common state (no common.pt then)
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
    return common_of(read_regular(path, root, limit=MAX_COMMON_BYTES), path)


def read_common_state(ckpt: DcpCheckpoint, remote: RemoteFiles | None = None) -> Common | None:
    """Megatron-Core 0.19's common state: the DCP bytes item `common_state/shard_0_1` (torch's torch.save of
    the BytesIO megatron hands it, of torch.save bytes of `[state_dict]`) read without running it, as
    `read_common` reads 0.16's common.pt; None without it."""
    item = next((i for fqn, i in ckpt.items.items() if fqn.startswith(COMMON_STATE + "/shard_")), None)
    if item is None:
        return None
    raw = item_bytes(ckpt.path, item, remote, ckpt.transforms)
    where = f"{ckpt.path / item.file}: {item.fqn!r}"
    try:  # megatron saves a BytesIO of torch.save bytes, which DCP torch.saves once more
        inner = bytes_io(raw, Budget(where))
    except (pickle.UnpicklingError, zipfile.BadZipFile, ValueError, EOFError, KeyError, TypeError):
        inner = None  # then read as it is (and refused as what it is)
    common = common_of(raw if inner is None else inner, where, listed=True)
    return dataclasses.replace(common, raw=raw, source=item.fqn, raw_key=item.fqn, items=(item.fqn,))


def item_bytes(
    root: Path, item: NonTensorItem, remote: RemoteFiles | None = None, transforms: tuple[str, ...] = ()
) -> bytes:
    """The torch.save bytes of the DCP bytes item `item`, at most `MAX_COMMON_BYTES` of them (an item
    `.metadata` says is larger is refused before a byte of it is read); decompressed when the checkpoint's
    records are (`transforms`: `DcpCheckpoint.transforms`)."""
    where = f"{root / item.file}: {item.fqn!r}"
    if item.byte_length > MAX_COMMON_BYTES:
        raise CkptconvError(
            f"{where}: {item.byte_length} bytes, more than the {MAX_COMMON_BYTES} Megatron's common state "
            "may have; refusing to read it (is the checkpoint corrupt?)"
        )
    if remote is not None:
        raw = remote.read(item.file, item.byte_offset, item.byte_length)
    else:
        fd = open_regular(root / item.file, root)
        try:
            buf = bytearray(item.byte_length)
            pread_exact(fd, root / item.file, item.byte_offset, memoryview(buf))
            raw = bytes(buf)
        finally:
            os.close(fd)
    if not transforms:
        return raw
    return bytes(record(lambda at, n: raw[at : at + n], len(raw), MAX_COMMON_BYTES, where))


def common_of(raw: bytes, where: object, *, listed: bool = False, **fields: Any) -> Common:
    """The `Common` of the torch.save bytes `raw` of a dict of common values (`listed`: of a one-element
    list holding it), read without running it; `fields`: `Common`'s naming fields."""
    budget = Budget(where)
    value = _load(raw, where, budget)
    if listed and isinstance(value, list | tuple) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        raise CkptconvError(f"{where}: holds a {type(value).__name__}, not Megatron's common state dict")
    values: dict[str, Any] = {}
    unreadable: dict[str, tuple[str, ...]] = {}
    for key, item in value.items():
        left_out: list[str] = []
        name = key if isinstance(key, str) else short(key)
        values[name] = readable(item, name, left_out, budget)
        unreadable[name] = tuple(left_out)
    return Common(values, unreadable, raw, **fields)


def readable_item(raw: bytes, where: object, name: str) -> tuple[Any, tuple[str, ...]]:
    """The readable part of the one value the torch.save bytes `raw` hold (named `name` in what is left out),
    and `name.path (what)` for each part left out; read without running it, within one read's limits."""
    budget = Budget(where)
    left_out: list[str] = []
    return readable(_load(raw, where, budget), name, left_out, budget), tuple(left_out)


def _load(raw: bytes, where: object, budget: Budget) -> Any:
    try:
        return load_opaque(raw, where, budget)
    except (pickle.UnpicklingError, zipfile.BadZipFile, ValueError, EOFError, KeyError, TypeError) as e:
        raise CkptconvError(
            f"{where}: not a readable torch.save file ({type(e).__name__}: {str(e)[:200]}); "
            "re-copy the checkpoint"
        ) from None


def megatron_info(ckpt: DcpCheckpoint) -> MegatronInfo | None:
    """What a Megatron checkpoint (`kind` megatron or fsdp_dtensor) says of itself; None for another."""
    if ckpt.kind not in ("megatron", "fsdp_dtensor"):
        return None
    values = ckpt.common.values if ckpt.common is not None else {}
    args = values.get("args") if isinstance(values.get("args"), dict) else None
    got = args or {}
    chunks = {m.group(1) for fqn in ckpt.tensors if (m := FSDP_PREFIX.match(fqn)) and m.group(1)}
    vpp = _int(got.get("virtual_pipeline_model_parallel_size"))
    return MegatronInfo(
        format="fsdp_dtensor" if ckpt.kind == "fsdp_dtensor" else "torch_dist",
        iteration=_int(values.get("iteration")),
        checkpoint_version=_number(values.get("checkpoint_version")),
        tensor_model_parallel_size=_int(got.get("tensor_model_parallel_size")),
        pipeline_model_parallel_size=_int(got.get("pipeline_model_parallel_size")),
        virtual_pipeline_chunks=len(chunks) if chunks else vpp,
        args=args,
    )


# Megatron-FSDP's model prefix: `model.module.`, or a virtual pipeline chunk's `model<N>.module.` (group 1
# the chunk's number)
FSDP_PREFIX = re.compile(r"model([0-9]*)\.module\.")


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _number(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) else None


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
