"""Per-rank `torch.save` files of DTensor state dicts as a DCP source: verl's FSDP checkpoints and
accelerate's FSDP2 `SHARDED_STATE_DICT` saved with `use_dcp=False`.

- verl (`FSDPCheckpointManager.save_checkpoint`): `model_world_size_{N}_rank_{R}.pt` per rank (the
  model's `state_dict()`), beside `optim_world_size_{N}_rank_{R}.pt`,
  `extra_state_world_size_{N}_rank_{R}.pt`,
  `fsdp_config.json` (`{"FSDP_version": 2, "world_size": N}`) and `huggingface/` (config.json, tokenizer:
  used like `--copy-from` when none is given, `model_files`).
- accelerate (`save_fsdp_model(..., use_dcp=False)`): `pytorch_model_fsdp_{i}_rank{R}.bin` per rank (the
  `get_model_state_dict` of model i), beside `optimizer_{i}_rank{R}.bin`.

Only the model files are opened: the optimizer and extra-state files are told apart by name and never read.
Each model file's zip directory and `data.pkl` are read (dtensor_pickle: stand-ins, nothing run); each
local tensor's bytes stay in place, located by the offset of its `data/N` entry, and each becomes one chunk
(or one per run of rows, dtensor_layout) at the global offsets its spec gives. The chunks must tile every
tensor exactly, as DCP's do. The result is a `DcpCheckpoint` whose chunks are `torch_entry`s (raw bytes at
an offset), so dcp-to-hf, verify and inspect read it like any DCP.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

from ckptconv.core.dtype_names import ITEMSIZE
from ckptconv.core.layout import tiling_problem
from ckptconv.core.specs import ChunkSpec, DcpCheckpoint, Stamp, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats import safe_pickle as sp
from ckptconv.formats.documents import load_json
from ckptconv.formats.dtensor_layout import Block, LayoutError, local_blocks
from ckptconv.formats.dtensor_pickle import Local, load_rank_state, mesh_shape
from ckptconv.formats.files import (
    KEY_MAP_BYTES,
    mode_of,
    open_regular,
    pread_exact,
    read_error,
    read_regular,
    stamp,
)
from ckptconv.formats.rank_files import FSDP_CONFIG, matches
from ckptconv.formats.torch_record import TensorRecord
from ckptconv.formats.torch_zip import TorchZip
from ckptconv.job.limits import Budget

MAX_PICKLE = 256 * 2**20

def _rank_files(path: Path, kind: str, found: dict[str, re.Match[str]]) -> list[tuple[int, str]]:
    """(rank, file name) of every rank 0..N-1, checked complete: verl's names carry the world size N (one
    run's files only, agreeing with fsdp_config.json); accelerate's carry a model index (one model only)."""
    groups = {int(m.group(1)) for m in found.values()}
    ranks = {int(m.group(2)): n for n, m in found.items()}
    if kind == "verl-fsdp":
        if len(groups) > 1:
            raise CkptconvError(
                f"{path}: model files of world sizes {sorted(groups)}; keep one run's files in the directory"
            )
        world = groups.pop()
        _check_fsdp_config(path, world)
        missing = next((r for r in range(world) if r not in ranks), None)
        extra = next((r for r in sorted(ranks) if r >= world), None)
        if extra is not None:
            raise CkptconvError(
                f"{path / ranks[extra]}: rank {extra} of a world size of {world}; the file names disagree, "
                "re-copy the checkpoint"
            )
        name = f"model_world_size_{world}_rank_{missing}.pt"
    else:
        if len(groups) > 1:
            raise CkptconvError(
                f"{path}: holds the files of {len(groups)} models (pytorch_model_fsdp_"
                f"{{{','.join(map(str, sorted(groups)))}}}_rank*.bin); ckptconv converts one model: move "
                "the others' files out"
            )
        index = groups.pop()
        missing = next((r for r in range(len(ranks)) if r not in ranks), None)
        name = f"pytorch_model_fsdp_{index}_rank{missing}.bin"
    if missing is not None:
        raise CkptconvError(f"{path / name}: missing (the model file of rank {missing}); re-copy the files")
    return sorted(ranks.items())


def _check_fsdp_config(path: Path, world: int) -> None:
    file = path / FSDP_CONFIG
    if mode_of(file) is None:
        return
    try:
        doc: Any = load_json(read_regular(file, path, limit=KEY_MAP_BYTES), file)
        said = doc.get("world_size") if isinstance(doc, dict) else None
    except (ValueError, RecursionError) as e:
        raise CkptconvError(f"{file}: unreadable ({str(e)[:120]}); fix or remove it") from None
    if said is not None and said != world:
        raise CkptconvError(
            f"{file}: world_size {said!r}, but the model files are of world size {world}; re-copy the "
            "checkpoint"
        )


def _walk(value: Any, prefix: str, out: dict[str, Local], budget: Budget, level: int = 1) -> None:
    """The tensors of a state dict (nested dicts joined with dots), in the order saved. The walk is charged
    to the load's `budget` (a node once per reference, no deeper than its depth limit: pickle's unpickler
    nests without recursing, so nothing stopped a deep or memo-shared tree while it loaded); a name met
    twice (a nested `{"model": {"w": ...}}` beside a dotted `"model.w"`) is refused, not overwritten."""
    budget.objects(1, "nodes of the state dict walked")
    if isinstance(value, dict):
        budget.nested(level, "nesting of the state dict")
        budget.objects(len(value), "items of the state dict walked")  # a dict memo shares is walked again
        for key, item in value.items():
            if not isinstance(item, dict | Local | TensorRecord):
                continue  # not a tensor (nor holds one): never named
            if not isinstance(key, str):
                raise CkptconvError(
                    f"{budget.where}: a key of type {type(key).__name__} in its state dict, not a name; "
                    "the file is not a model's state dict, re-save it"
                )
            _walk(item, f"{prefix}{key}" if not prefix else f"{prefix}.{key}", out, budget, level + 1)
        return
    if isinstance(value, TensorRecord):  # a plain tensor (torch pickles it without the subclass wrapper)
        value = Local(value)
    if not isinstance(value, Local):
        return
    if prefix in out:
        raise CkptconvError(
            f"{budget.where}: {sp.clip(prefix)!r} twice in its state dict (a nested dict's key and a dotted "
            "key name the same tensor); re-save the checkpoint"
        )
    out[prefix] = value


class _RankFile:
    """One rank's model file: its tensors (`Local`s) and where each storage's bytes start in the file."""

    def __init__(self, path: Path, name: str, rank: int) -> None:
        self.file, self.name, self.rank = path / name, name, rank
        fd = open_regular(self.file, path)
        try:
            self.stamp: Stamp = stamp(os.fstat(fd))
            with os.fdopen(os.dup(fd), "rb") as f:
                self._read(f, fd)
        except (zipfile.BadZipFile, KeyError, EOFError) as e:
            raise CkptconvError(
                f"{self.file}: not a readable torch.save file ({type(e).__name__}: {str(e)[:120]}); "
                "re-copy it"
            ) from None
        except OSError as e:
            raise read_error(self.file, e) from None
        finally:
            os.close(fd)

    def _read(self, f: Any, fd: int) -> None:
        budget = Budget(self.file)
        archive = TorchZip(f, self.file, budget)
        if "byteorder" in archive.entries and archive.read("byteorder", 16) != b"little":
            raise CkptconvError(f"{self.file}: saved big-endian, which ckptconv does not read")
        try:
            state = load_rank_state(archive.read("data.pkl", MAX_PICKLE), budget)
        except CkptconvError:
            raise
        except sp.Refused as e:
            raise CkptconvError(
                f"{self.file}: refusing to load: its pickle references {e}, which is not part of a state "
                "dict of tensors and DTensors (a pickle payload); ckptconv never runs code from a checkpoint"
            ) from None
        except Exception as e:
            raise CkptconvError(
                f"{self.file}: not a readable state dict ({type(e).__name__}{f': {e}' if str(e) else ''}); "
                "the file is truncated or corrupt, re-copy it"
            ) from None
        self.tensors: dict[str, Local] = {}
        _walk(state, "", self.tensors, budget)
        size = os.fstat(fd).st_size
        self.starts: dict[str, tuple[int, int]] = {}  # storage key -> (data start, bytes)
        for local in self.tensors.values():
            key = local.record.storage_key
            if key not in self.starts:
                info = archive.entries[f"data/{key}"]
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CkptconvError(f"{self.file}: storage {key} is compressed; re-save with torch.save")
                header = bytearray(30)
                pread_exact(fd, self.file, info.header_offset, memoryview(header))
                if header[:4] != b"PK\x03\x04":
                    raise zipfile.BadZipFile(f"a broken local header of data/{key}")
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                self.starts[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
                if sum(self.starts[key]) > size:  # else inspect reports, and planning trusts, bytes not there
                    raise CkptconvError(
                        f"{self.file}: storage {key} claims {info.file_size} bytes, past the end of the file "
                        f"({size} bytes); it is truncated or corrupt, re-copy it"
                    )

    def chunks(self, key: str, world: int) -> tuple[Local, list[ChunkSpec]]:
        """The chunks of tensor `key` this file holds (none where another rank holds its copy)."""
        local = self.tensors[key]
        record, spec = local.record, local.spec
        itemsize = ITEMSIZE[str(record.dtype).removeprefix("torch.")]
        start, length = self.starts[record.storage_key]
        numel = 1
        for n in record.size:
            numel *= n
        if not record.is_contiguous:
            raise CkptconvError(f"{self.file}: {key!r} is saved as a strided view (not read by ckptconv)")
        if (record.storage_offset + numel) * itemsize > length:
            raise CkptconvError(f"{self.file}: {key!r} needs more bytes than its storage holds; re-copy it")
        if spec is None:
            if self.rank != 0:
                return local, []
            blocks = [((0,) * len(record.size), record.size, 0)]
        else:
            blocks = self._blocks(key, local, world)
        row_bytes = itemsize * (numel // record.size[0]) if record.size and record.size[0] else 0
        base = start + record.storage_offset * itemsize
        return local, [
            ChunkSpec(o, s, self.name, base + row * row_bytes, _numel(s) * itemsize, "torch_entry")
            for o, s, row in blocks
        ]

    def _blocks(self, key: str, local: Local, world: int) -> list[Block]:
        mesh = getattr(local.spec, "mesh", None)
        shape = mesh_shape(mesh)
        coordinate = getattr(mesh, "_coordinate_on_dim", None)
        where = f"{self.file}: {key!r}"
        if shape is None or not isinstance(coordinate, tuple):
            raise CkptconvError(f"{where}: a DTensor whose device mesh ckptconv cannot read; re-save it")
        if _numel(shape) > world:
            raise CkptconvError(
                f"{where}: a device mesh of {_numel(shape)} ranks, but {world} rank files; the world size "
                "disagrees with the file names, re-copy the checkpoint"
            )
        saved_by = getattr(mesh, "_rank", self.rank)
        if saved_by != self.rank:
            raise CkptconvError(
                f"{where}: saved by rank {sp.short(saved_by)}, not the rank its name says; re-copy"
            )
        meta = getattr(local.spec, "tensor_meta", None)
        told = (getattr(meta, "shape", None) or ()) if meta is not None else local.global_shape
        if not isinstance(told, tuple | list) or tuple(told) != local.global_shape:
            raise CkptconvError(f"{where}: its spec and its size disagree on its shape; re-save it")
        placements = getattr(local.spec, "placements", None) or ()
        if not isinstance(placements, tuple | list):
            raise CkptconvError(f"{where}: placements of type {type(placements).__name__}; re-save it")
        assert local.global_shape is not None
        try:
            placements = tuple(placements)
            order = getattr(local.spec, "shard_order", None)
            return local_blocks(local.global_shape, shape, coordinate, placements, local.record.size, order)
        except LayoutError as e:
            raise CkptconvError(f"{where} {list(local.global_shape)}: {e}; re-save the checkpoint") from None


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def open_rank_shards(path: Path) -> DcpCheckpoint:
    """Every model file's tensors, tiled into global tensors (a missing or stale rank file is named)."""
    found = matches(path)
    if found is None:
        raise CkptconvError(f"{path}: no per-rank model files")
    kind = found[0]
    ranks = _rank_files(path, kind, found[1])
    files = [_RankFile(path, name, rank) for rank, name in ranks]
    chunks: dict[str, list[ChunkSpec]] = {}
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    blocks: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for rf in files:
        for key in rf.tensors:
            local, parts = rf.chunks(key, len(files))
            dtype = str(local.record.dtype).removeprefix("torch.")
            shape = local.global_shape if local.global_shape is not None else local.record.size
            if dtypes.setdefault(key, dtype) != dtype or shapes.setdefault(key, shape) != shape:
                raise CkptconvError(
                    f"{rf.file}: {key!r} is {dtype} {list(shape)} here, {dtypes[key]} {list(shapes[key])} "
                    "in another rank's file; the files are of different runs, re-copy the checkpoint"
                )
            # a block every rank of another mesh dim holds (FSDP2 x TP: the dp sub-mesh of a parameter TP
            # leaves whole is a different mesh on each TP rank, each at coordinate 0): read once
            have = blocks.setdefault(key, set())
            for part in parts:
                if (part.offsets, part.sizes) not in have:
                    have.add((part.offsets, part.sizes))
                    chunks.setdefault(key, []).append(part)
            chunks.setdefault(key, [])
    if not chunks:
        raise CkptconvError(f"{path}: its model files hold no tensors")
    tensors = {}
    for key, parts in chunks.items():
        shape = shapes[key]
        if not parts and _numel(shape) == 0:
            parts = [ChunkSpec((0,) * len(shape), shape, files[0].name, 0, 0, "torch_entry")]
        problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in parts])
        if problem:
            raise CkptconvError(
                f"{path}: {key!r} {list(shape)}: {problem} in its rank files; a rank file is missing or "
                "stale, re-copy the checkpoint"
            )
        tensors[key] = TensorSpec(key, dtypes[key], shape, tuple(parts))
    paths: dict[str, tuple[str | int, ...]] = {key: (key,) for key in tensors}
    stamps = {rf.name: rf.stamp for rf in files}
    return DcpCheckpoint(path, tensors, {}, paths, stamps, kind=kind)

