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
from itertools import chain, repeat
from operator import add, attrgetter, gt, mul
from pathlib import Path, PurePosixPath
from typing import Any

from ckptconv.core.dtype_names import CONVERTIBLE, ITEMSIZE
from ckptconv.core.layout import tiling_problem
from ckptconv.core.specs import (
    ChunkFormat,
    DcpCheckpoint,
    NonTensorItem,
    Stamp,
    TensorSpec,
    new_chunk,
)
from ckptconv.errors import CkptconvError
from ckptconv.formats import safe_pickle as md
from ckptconv.formats.dcp_columns import Columns, load_dcp_metadata
from ckptconv.formats.dcp_transforms import MAX_RATIO, ZSTD_MAGIC, layers
from ckptconv.formats.files import (
    BoundedReader,
    inside,
    mode_of,
    open_regular,
    read_error,
    stamp,
    stat_regular,
)
from ckptconv.formats.hf import (
    MAX_HEADER_BYTES,  # a larger safetensors header inside a .distcp is refused too
)
from ckptconv.formats.megatron import MARKER_FILE as MEGATRON_MARKER
from ckptconv.formats.megatron import is_megatron, read_common, read_common_state
from ckptconv.formats.megatron_fsdp import is_fsdp_dtensor, read_items
from ckptconv.job.gcpause import paused
from ckptconv.remote.files import RemoteFiles
from ckptconv.remote.urls import UrlPath

METADATA_FILE = ".metadata"


def is_dcp_dir(path: Path) -> bool:
    """Whether `path` is a directory with a `.metadata` (of any kind: `open_dcp` refuses a FIFO by name), or
    the per-rank safetensors shards torch's distributed HF writer leaves (`hf_sharded`), or verl's and
    accelerate's per-rank torch.save model files (`rank_shards`)."""
    if isinstance(path, UrlPath):
        return METADATA_FILE in RemoteFiles(path).sizes()
    mode = mode_of(path)
    if mode is None or not stat.S_ISDIR(mode):
        return False
    if mode_of(path / METADATA_FILE) is not None:
        return True
    from ckptconv.formats.deepspeed import is_deepspeed_dir
    from ckptconv.formats.hf_sharded import is_sharded_dir
    from ckptconv.formats.rank_files import is_rank_dir

    return is_sharded_dir(path) or is_rank_dir(path) or is_deepspeed_dir(path)


def open_dcp(path: Path) -> DcpCheckpoint:
    """Read and validate `path/.metadata`; raise CkptconvError naming the problem and the fix.

    `.metadata` and every file it names must be regular files resolving inside `path`. A directory of torch's
    distributed HF writer shards (no `.metadata`) is read from their headers (`hf_sharded.open_sharded`)."""
    md_path = path / METADATA_FILE
    remote = RemoteFiles(path) if isinstance(path, UrlPath) else None
    if remote is None and mode_of(md_path) is None:
        from ckptconv.formats.hf_sharded import is_sharded_dir, open_sharded

        if is_sharded_dir(path):
            return open_sharded(path)
        from ckptconv.formats.rank_files import is_rank_dir
        from ckptconv.formats.rank_shards import open_rank_shards

        if is_rank_dir(path):
            return open_rank_shards(path)
        from ckptconv.formats.deepspeed import is_deepspeed_dir
        from ckptconv.formats.deepspeed_open import open_deepspeed

        if is_deepspeed_dir(path):
            return open_deepspeed(path)
    with paused():  # a million records, none of them garbage: see gcpause
        if remote is not None:
            metadata, columns = load_dcp_metadata(_remote_metadata(remote), str(md_path))
        else:  # streamed: the file's bytes are never all held beside the records they make
            with os.fdopen(open_regular(md_path, path), "rb", buffering=1 << 20) as f:
                try:
                    metadata, columns = load_dcp_metadata(
                        BoundedReader(f, os.fstat(f.fileno()).st_size), str(md_path)
                    )
                except OSError as e:
                    raise read_error(md_path, e) from None
        try:
            ckpt = _specs_from_metadata(path, metadata, columns, remote)
        except (AttributeError, TypeError, ValueError) as e:
            raise CkptconvError(
                f"{md_path}: malformed DCP metadata ({e}); re-save or re-copy the checkpoint"
            ) from None
    if remote is None and is_megatron(path):  # common.pt beside, or (0.19) the common_state item inside
        common = read_common(path) or read_common_state(ckpt)
        ckpt = dataclasses.replace(ckpt, kind="megatron", common=common)
    elif is_fsdp_dtensor(ckpt):
        ckpt = dataclasses.replace(ckpt, kind="fsdp_dtensor", common=read_items(ckpt, remote))
    return ckpt


def _remote_metadata(remote: RemoteFiles) -> bytes:
    """`.metadata` of a checkpoint in object storage (Megatron-Core's are read from a file system only)."""
    sizes = remote.sizes()
    if METADATA_FILE not in sizes:
        raise CkptconvError(f"{remote.root}: not a DCP checkpoint (no .metadata object under it)")
    if MEGATRON_MARKER in sizes and b"torch_dist" in remote.read_all(MEGATRON_MARKER)[: 1 << 20]:
        raise CkptconvError(
            f"{remote.root}: a Megatron-Core checkpoint; ckptconv reads those from a file system only "
            "(copy it to a local or mounted path)"
        )
    return remote.read_all(METADATA_FILE)


def _specs_from_metadata(
    root: Path, metadata: md.Metadata, columns: Columns, remote: RemoteFiles | None = None
) -> DcpCheckpoint:
    where = root / METADATA_FILE
    if not isinstance(metadata.storage_data, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CkptconvError(f"{where}: has no storage index (not written by FileSystemWriter?)")
    # {fqn: {offsets: storage row}} as stored: a chunk's validated offsets find their entry, a malformed one
    # matches no chunk (then "no stored data"), so the index needs no check of its own
    locations = _Locations(columns)
    transforms = locations.transforms(where)
    ratio = MAX_RATIO ** layers(transforms, where)
    file_sizes = _FileSizes(root, remote)
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
            file, start, length = _location(locations, fqn, file_sizes, where)
            items[fqn] = NonTensorItem(fqn, paths[fqn], file, start, length)
        elif isinstance(entry, md.TensorStorageMetadata) and isinstance(getattr(entry, "rows", None), range):
            tensors[fqn] = _tensor_spec(fqn, entry, locations, file_sizes, where, ratio)
        else:
            raise CkptconvError(f"{where}: key {fqn!r} has an unknown storage type")
    formats = _sniff_formats(root, tensors.values(), remote, bool(transforms))
    other = {file for file, fmt in formats.items() if fmt != "torch_save"}
    if other:  # chunks were made as torch_save records: re-make those of the files that are not
        tensors = {
            fqn: dataclasses.replace(
                t,
                chunks=tuple(c._replace(fmt=formats[c.file]) if c.file in other else c for c in t.chunks),
            )
            for fqn, t in tensors.items()
        }
    return DcpCheckpoint(root, tensors, items, paths, file_sizes.stamps, transforms=transforms)


class _Locations:
    """Where each stored entry is: `rows(fqn, offsets)`, the storage row of each chunk (None: not stored)."""

    def __init__(self, columns: Columns) -> None:
        self.columns = columns
        self.by_fqn = columns.locations()

    def rows(self, fqn: str, offsets: list[Any]) -> list[int | None]:
        return list(map(self.by_fqn.get(fqn, {}).get, offsets))

    def files(self, rows: list[int]) -> tuple[list[Any], list[int], list[int]]:
        """(files, starts, lengths) of storage rows."""
        c = self.columns
        return (
            list(map(c.paths.__getitem__, rows)),
            list(map(c.starts.__getitem__, rows)),
            list(map(c.lengths.__getitem__, rows)),
        )

    def transforms(self, where: Path) -> tuple[str, ...]:
        """The transform descriptors every record is stored with (torch's writer applies its `_extensions`
        to all of them), () for none; records stored with different ones are refused."""
        found = self.columns.transforms
        if not found:
            return ()
        kinds = set(found.values())
        if len(kinds) > 1 or len(found) != len(self.columns.paths):
            raise CkptconvError(
                f"{where}: its records are stored with different transforms ({sorted(kinds)}, or none), "
                "which torch's writer never does; re-save the checkpoint"
            )
        return kinds.pop()


_FILE, _BYTE_OFFSET = attrgetter("file"), attrgetter("byte_offset")


def _tensor_spec(
    fqn: str, entry: Any, locations: _Locations, file_sizes: _FileSizes, where: Path, ratio: int = 1
) -> TensorSpec:
    """The spec of one tensor, its chunks checked in bulk: each check is one pass in C over all the chunks
    (a million of them at 1 TB), and the per-chunk message is found only when a check fails. `ratio`: the
    most a stored byte decompresses to (1: the records are not compressed)."""
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CkptconvError(f"{where}: tensor {fqn!r} has no valid dtype")
    if dtype not in CONVERTIBLE:
        raise CkptconvError(
            f"{where}: tensor {fqn!r} is {dtype}, a torch dtype with no element operations (quantized, "
            "bits or sub-byte); ckptconv converts floating, integer and bool tensors only"
        )
    shape = _int_tuple(entry.size, fqn, where)
    rows = entry.rows
    offsets = _int_tuples(locations.columns.offsets[rows.start : rows.stop], fqn, where)
    sizes = _int_tuples(locations.columns.sizes[rows.start : rows.stop], fqn, where)
    found = locations.rows(fqn, offsets)
    if None in found:
        missing = offsets[found.index(None)]
        raise CkptconvError(
            f"{where}: no stored data for {fqn!r} at offset {missing}; the metadata is corrupt"
        )
    stored: list[int] = found  # type: ignore[assignment]  # no None in it
    files, starts, lengths = locations.files(stored)
    if set(map(type, files)) - {str}:
        raise CkptconvError(f"{where}: malformed storage entry for {fqn!r}")
    if stored and (min(starts) < 0 or min(lengths) < 0):
        raise CkptconvError(
            f"{where}: negative storage offset or length for {fqn!r}; the metadata is corrupt"
        )
    ends = list(map(add, starts, lengths))
    file_size = file_sizes.known
    for rel in set(files).difference(file_size):
        file_sizes.size(rel, fqn, where)
    if any(map(gt, ends, map(file_size.__getitem__, files))):
        i = next(i for i, (rel, end) in enumerate(zip(files, ends, strict=True)) if end > file_size[rel])
        raise CkptconvError(
            f"{where.parent / files[i]}: truncated ({file_size[files[i]]} bytes, {fqn!r} needs bytes up to "
            f"{ends[i]}); re-copy the checkpoint"
        )
    needed = list(map(mul, map(math.prod, sizes), repeat(ITEMSIZE[dtype])))
    # compressed, no shape needs more than the stored frames can decompress to
    most = list(map(mul, lengths, repeat(ratio))) if ratio > 1 else lengths
    if any(map(gt, needed, most)):  # no shape makes ckptconv allocate more than is stored
        i = next(i for i, (n, length) in enumerate(zip(needed, most, strict=True)) if n > length)
        held = f"holds {most[i]}" if ratio == 1 else f"decompresses to {most[i]} at most"
        raise CkptconvError(
            f"{where}: tensor {fqn!r}: a chunk of shape {list(sizes[i])} needs {needed[i]} bytes, its record "
            f"in {files[i]} {held}; the metadata is corrupt"
        )
    problem = tiling_problem(shape, list(zip(offsets, sizes, strict=True)))
    if problem:
        raise CkptconvError(f"{where}: tensor {fqn!r} {list(shape)}: {problem}; the checkpoint is incomplete")
    chunks = tuple(
        map(
            new_chunk,
            zip(offsets, sizes, files, starts, lengths, repeat("torch_save", len(files)), strict=True),
        )
    )
    return TensorSpec(fqn, dtype, shape, chunks)


_INT = {int}


def _int_tuples(values: list[Any], fqn: str, where: Path) -> list[tuple[int, ...]]:
    """`_int_tuple` of each value, in one pass in C when all are tuples of non-negative ints (as torch.Size
    loads)."""
    if set(map(type, values)) <= {tuple}:
        flat = list(chain.from_iterable(values))
        if set(map(type, flat)) <= _INT and (not flat or min(flat) >= 0):
            return values
    return [_int_tuple(v, fqn, where) for v in values]


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


def _location(locations: _Locations, fqn: str, file_sizes: _FileSizes, where: Path) -> tuple[str, int, int]:
    """Where a non-tensor item is stored: (file, start, length)."""
    row = locations.rows(fqn, [None])[0]
    if row is None:
        raise CkptconvError(f"{where}: no stored data for {fqn!r}; the metadata is corrupt")
    (rel,), (start,), (length,) = locations.files([row])
    if not isinstance(rel, str):
        raise CkptconvError(f"{where}: malformed storage entry for {fqn!r}")
    size = file_sizes.size(rel, fqn, where)
    if start < 0 or length < 0 or start + length > size:
        raise CkptconvError(
            f"{where.parent / rel}: truncated ({size} bytes, {fqn!r} needs bytes up to {start + length}); "
            "re-copy the checkpoint"
        )
    return rel, start, length


class _FileSizes:
    """The size of each file `.metadata` names, once: a regular file resolving inside the checkpoint."""

    def __init__(self, root: Path, remote: RemoteFiles | None = None) -> None:
        self.root = root
        self.remote = remote
        self.known: dict[str, int] = {}  # file -> size, of the files checked
        self.stamps: dict[str, Stamp] = {}

    def size(self, rel: str, fqn: str, where: Path) -> int:
        """The size of `rel`, which `fqn`'s data is in; a name leading out of the checkpoint, a missing file
        or anything else wrong with it is a CkptconvError."""
        size = self.known.get(rel)
        if size is not None:
            return size
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts or "\0" in rel:
            raise CkptconvError(
                f"{where}: {fqn!r} points outside the checkpoint ({rel!r}); refusing to read it"
            )
        path = self.root / rel
        if self.remote is not None:
            remote_size = self.remote.sizes().get(rel)
            if remote_size is None:
                raise CkptconvError(f"{path}: missing; the checkpoint is incomplete (re-copy it)")
            self.known[rel], self.stamps[rel] = remote_size, (0, 0, remote_size, 0)
            return remote_size
        if mode_of(Path(os.path.realpath(path))) is None:
            inside(path, self.root)  # a dangling link out of the checkpoint is refused as such
            raise CkptconvError(f"{path}: missing; the checkpoint is incomplete (re-copy it)")
        st = stat_regular(path, self.root)
        self.known[rel], self.stamps[rel] = st.st_size, stamp(st)
        return st.st_size


def _sniff_formats(
    root: Path, tensors: Iterable[TensorSpec], remote: RemoteFiles | None = None, compressed: bool = False
) -> dict[str, ChunkFormat]:
    """Tell the two chunk serializations apart by the bytes where one of a file's tensor chunks starts (the
    first listed: each one starts a record).

    torch_save items are zip archives ("PK"); in the safetensors serialization every tensor item of a file
    points at one safetensors blob (8-byte header length, then a JSON header). `compressed`: the records
    are zstd frames (dcp_transforms) of torch_save items, the only kind torch's writer compresses.
    """
    first: dict[str, int] = {}
    for t in tensors:  # each file's first chunk here, found in C: of equal keys, dict() keeps the last
        backwards = t.chunks[::-1]
        for rel, offset in dict(
            zip(map(_FILE, backwards), map(_BYTE_OFFSET, backwards), strict=True)
        ).items():
            first.setdefault(rel, offset)
    formats: dict[str, ChunkFormat] = {}
    for rel, offset in first.items():
        head = _head(root, rel, offset, remote)
        if compressed:
            if head[:4] != ZSTD_MAGIC:
                raise CkptconvError(
                    f"{root / rel}: no zstd frame at byte {offset}, where .metadata says a compressed record "
                    "starts; the checkpoint is corrupt, re-save or re-copy it"
                )
            formats[rel] = "torch_save"
        elif head[:4] == b"PK\x03\x04":
            formats[rel] = "torch_save"
        elif len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= MAX_HEADER_BYTES:
            formats[rel] = "safetensors"
        else:
            raise CkptconvError(
                f"{root / rel}: no torch.save record nor safetensors header at byte {offset}; "
                "the checkpoint is corrupt, re-save or re-copy it"
            )
    return formats


def _head(root: Path, rel: str, offset: int, remote: RemoteFiles | None) -> bytes:
    """Up to 9 bytes of `rel` at `offset`."""
    if remote is not None:
        return remote.read(rel, offset, min(9, remote.sizes()[rel] - offset))
    head = bytearray(9)
    fd = open_regular(root / rel, root)
    try:
        n = os.preadv(fd, [head], offset)
    except OSError as e:
        raise read_error(root / rel, e) from None
    finally:
        os.close(fd)
    return bytes(head[:n])
