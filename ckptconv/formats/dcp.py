"""DCP checkpoints on a file system: `.metadata` -> specs, safely and without importing torch.

Call order: `open_dcp(path)` on every rank (reads `.metadata` and the file sizes, no tensor bytes), then
`dcp_reader.DcpReader(ckpt)` on the ranks that read chunks. Writing is `dcp_writer.write_dcp`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..dtype_names import ITEMSIZE
from ..errors import CkptconvError
from ..gcpause import paused
from ..layout import tiling_problem
from ..specs import ChunkFormat, ChunkSpec, NonTensorItem, TensorSpec
from . import safe_pickle as md
from .files import Stamp, inside, mode_of, open_regular, read_error, read_regular, stamp, stat_regular
from .hf import MAX_HEADER_BYTES  # a larger safetensors header inside a .distcp is refused too
from .megatron import Common, is_megatron, read_common
from .safe_pickle import load_dcp_metadata

METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class DcpCheckpoint:
    """Everything `.metadata` says, validated; tensors and items keep the order the job saved them in."""

    path: Path
    tensors: dict[str, TensorSpec]
    items: dict[str, NonTensorItem]
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)  # fqn -> nesting in the saved dict
    stamps: dict[str, Stamp] = field(default_factory=dict)  # file -> identity when .metadata was read
    kind: str = "dcp"  # "megatron": Megatron-Core torch_dist (keys without nesting, common.pt beside)
    common: Common | None = None  # Megatron's common.pt, read without running it
    file_split: dict[str, int] | None = None  # key -> output file number, from torch's distributed HF writer

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def is_dcp_dir(path: Path) -> bool:
    """Whether `path` is a directory with a `.metadata` (of any kind: `open_dcp` refuses a FIFO by name), or
    the per-rank safetensors shards torch's distributed HF writer leaves (`hf_sharded`)."""
    mode = mode_of(path)
    if mode is None or not stat.S_ISDIR(mode):
        return False
    if mode_of(path / METADATA_FILE) is not None:
        return True
    from .hf_sharded import is_sharded_dir

    return is_sharded_dir(path)


def open_dcp(path: Path) -> DcpCheckpoint:
    """Read and validate `path/.metadata`; raise CkptconvError naming the problem and the fix.

    `.metadata` and every file it names must be regular files resolving inside `path`. A directory of torch's
    distributed HF writer shards (no `.metadata`) is read from their headers (`hf_sharded.open_sharded`)."""
    md_path = path / METADATA_FILE
    if mode_of(md_path) is None:
        from .hf_sharded import is_sharded_dir, open_sharded

        if is_sharded_dir(path):
            return open_sharded(path)
    data = read_regular(md_path, path)
    with paused():  # a million records, none of them garbage: see gcpause
        metadata = load_dcp_metadata(data, str(md_path))
        del data
        try:
            ckpt = _specs_from_metadata(path, metadata)
        except (AttributeError, TypeError, ValueError) as e:
            raise CkptconvError(
                f"{md_path}: malformed DCP metadata ({e}); re-save or re-copy the checkpoint"
            ) from None
    if is_megatron(path):
        ckpt = dataclasses.replace(ckpt, kind="megatron", common=read_common(path))
    return ckpt


def _specs_from_metadata(root: Path, metadata: md.Metadata) -> DcpCheckpoint:
    where = root / METADATA_FILE
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CkptconvError(f"{where}: has no storage index (not written by FileSystemWriter?)")
    locations: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for index, info in storage.items():
        if type(index) is not md.MetadataIndex:
            raise CkptconvError(f"{where}: malformed storage index entry")
        offset = None if index.offset is None else _int_tuple(index.offset, str(index.fqn), where)
        locations[(index.fqn, offset)] = info
    metadata.storage_data = storage = None  # its index records go now: a million chunks' worth of memory
    file_sizes = _FileSizes(root)
    planner_paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tensors: dict[str, TensorSpec] = {}
    items: dict[str, NonTensorItem] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise CkptconvError(f"{where}: a key is not a string")
        raw_path = planner_paths.get(fqn)
        paths[fqn] = tuple(raw_path) if isinstance(raw_path, (tuple, list)) else (fqn,)
        if isinstance(entry, md.BytesStorageMetadata):
            file, start, length = _location(locations, fqn, None, file_sizes, where)
            items[fqn] = NonTensorItem(fqn, paths[fqn], file, start, length)
        elif isinstance(entry, md.TensorStorageMetadata):
            tensors[fqn] = _tensor_spec(fqn, entry, locations, file_sizes, where)
            entry.chunks = []  # its records go as the specs grow: the peak holds one of the two
        else:
            raise CkptconvError(f"{where}: key {fqn!r} has an unknown storage type")
    formats = _sniff_formats(root, tensors.values())
    other = {file for file, fmt in formats.items() if fmt != "torch_save"}
    if other:  # chunks were made as torch_save records: re-make those of the files that are not
        tensors = {
            fqn: dataclasses.replace(
                t,
                chunks=tuple(
                    dataclasses.replace(c, fmt=formats[c.file]) if c.file in other else c for c in t.chunks
                ),
            )
            for fqn, t in tensors.items()
        }
    return DcpCheckpoint(root, tensors, items, paths, file_sizes.stamps)


def _tensor_spec(fqn: str, entry: Any, locations: dict, file_sizes: _FileSizes, where: Path) -> TensorSpec:
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CkptconvError(f"{where}: tensor {fqn!r} has no valid dtype")
    shape = _int_tuple(entry.size, fqn, where)
    chunks = []
    for chunk in entry.chunks:
        offsets = _int_tuple(chunk.offsets, fqn, where)
        sizes = _int_tuple(chunk.sizes, fqn, where)
        file, start, length = _location(locations, fqn, offsets, file_sizes, where)
        needed = math.prod(sizes) * ITEMSIZE[dtype]
        if needed > length:  # so no shape in the metadata makes ckptconv allocate more than the files hold
            raise CkptconvError(
                f"{where}: tensor {fqn!r}: a chunk of shape {list(sizes)} needs {needed} bytes, its record "
                f"in {file} holds {length}; the metadata is corrupt"
            )
        chunks.append(ChunkSpec(offsets, sizes, file, start, length, "torch_save"))
    problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in chunks])
    if problem:
        raise CkptconvError(f"{where}: tensor {fqn!r} {list(shape)}: {problem}; the checkpoint is incomplete")
    return TensorSpec(fqn, dtype, shape, tuple(chunks))


_INT = {int}


def _int_tuple(value: Any, fqn: str, where: Path) -> tuple[int, ...]:
    if type(value) is tuple and set(map(type, value)) <= _INT:  # as a torch.Size loads: no copy
        out: tuple[int, ...] = value
    else:
        try:
            out = tuple(int(x) for x in value)
        except (TypeError, ValueError):
            raise CkptconvError(f"{where}: tensor {fqn!r} has a malformed size or offset") from None
    if out and min(out) < 0:
        raise CkptconvError(f"{where}: tensor {fqn!r} has a negative size or offset")
    return out


def _location(
    locations: dict, fqn: str, offsets: tuple[int, ...] | None, file_sizes: _FileSizes, where: Path
) -> tuple[str, int, int]:
    info = locations.get((fqn, offsets))
    if info is None:
        raise CkptconvError(
            f"{where}: no stored data for {fqn!r} at offset {offsets}; the metadata is corrupt"
        )
    rel = getattr(info, "relative_path", None)
    start, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(rel, str) or not isinstance(start, int) or not isinstance(length, int):
        raise CkptconvError(f"{where}: malformed storage entry for {fqn!r}")
    if getattr(info, "transform_descriptors", None):
        raise CkptconvError(
            f"{where}: {fqn!r} is stored with transforms {info.transform_descriptors} "
            "(compression or another DCP extension), which ckptconv does not read yet"
        )
    if rel not in file_sizes.checked:  # each file's name is checked once, not once per chunk
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts or "\0" in rel:
            raise CkptconvError(
                f"{where}: {fqn!r} points outside the checkpoint ({rel!r}); refusing to read it"
            )
        file_sizes.checked.add(rel)
    size = file_sizes.size(rel)
    if size is None:
        raise CkptconvError(f"{where.parent / rel}: missing; the checkpoint is incomplete (re-copy it)")
    if start < 0 or length < 0 or start + length > size:
        raise CkptconvError(
            f"{where.parent / rel}: truncated ({size} bytes, {fqn!r} needs bytes up to {start + length}); "
            "re-copy the checkpoint"
        )
    return rel, start, length


class _FileSizes:
    """The size of each file `.metadata` names, once: a regular file resolving inside the checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._sizes: dict[str, int | None] = {}
        self.stamps: dict[str, Stamp] = {}
        self.checked: set[str] = set()  # names `_location` found to stay inside the checkpoint

    def size(self, rel: str) -> int | None:
        """The size of `rel`, None when it is missing; anything else wrong with it is a CkptconvError."""
        if rel not in self._sizes:
            path = self.root / rel
            if mode_of(Path(os.path.realpath(path))) is None:
                inside(path, self.root)  # a dangling link out of the checkpoint is refused as such
                self._sizes[rel] = None
            else:
                st = stat_regular(path, self.root)
                self._sizes[rel], self.stamps[rel] = st.st_size, stamp(st)
        return self._sizes[rel]


def _sniff_formats(root: Path, tensors: Iterable[TensorSpec]) -> dict[str, ChunkFormat]:
    """Tell the two chunk serializations apart by the bytes where a file's first tensor chunk starts.

    torch_save items are zip archives ("PK"); in the safetensors serialization every tensor item of a file
    points at one safetensors blob (8-byte header length, then a JSON header).
    """
    first: dict[str, int] = {}
    for t in tensors:
        for c in t.chunks:
            first[c.file] = min(first.get(c.file, c.byte_offset), c.byte_offset)
    formats: dict[str, ChunkFormat] = {}
    for rel, offset in first.items():
        head = bytearray(9)
        fd = open_regular(root / rel, root)
        try:
            n = os.preadv(fd, [head], offset)
        except OSError as e:
            raise read_error(root / rel, e) from None
        finally:
            os.close(fd)
        head = head[:n]
        if head[:4] == b"PK\x03\x04":
            formats[rel] = "torch_save"
        elif len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= MAX_HEADER_BYTES:
            formats[rel] = "safetensors"
        else:
            raise CkptconvError(
                f"{root / rel}: no torch.save record nor safetensors header at byte {offset}; "
                "the checkpoint is corrupt, re-save or re-copy it"
            )
    return formats
