"""DCP `.metadata` as loaded (dcp_columns) -> the checkpoint's specs, each record checked against the files.

The checks of a million chunks are passes in C over each tensor's columns; the message naming the first
chunk that fails one is found only when it fails.
"""

from __future__ import annotations

import dataclasses
import math
import os
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
from ckptconv.formats.dcp_columns import Columns
from ckptconv.formats.dcp_locations import Locations
from ckptconv.formats.dcp_transforms import MAX_RATIO, ZSTD_MAGIC, layers
from ckptconv.formats.files import (
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
from ckptconv.remote.files import RemoteFiles


def specs_from_metadata(
    root: Path, where: Path, metadata: md.Metadata, columns: Columns, remote: RemoteFiles | None = None
) -> DcpCheckpoint:
    """The checkpoint `where` (root's `.metadata`) describes, every record checked: names, sizes, tilings,
    where each chunk is stored (in a file of the checkpoint, within its size) and how (`_sniff_formats`)."""
    if not isinstance(metadata.storage_data, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CkptconvError(f"{where}: has no storage index (not written by FileSystemWriter?)")
    # {fqn: {offsets: storage row}} as stored: a chunk's validated offsets find their entry, a malformed one
    # matches no chunk (then "no stored data"), so the index needs no check of its own
    locations = Locations(columns)
    transforms = locations.transforms(where)
    ratio = MAX_RATIO ** layers(transforms, where)
    file_sizes = _FileSizes(root, remote)
    planner_paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tensors: dict[str, TensorSpec] = {}
    tilings: dict[Any, str | None] = {}
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
            tensors[fqn] = _tensor_spec(fqn, entry, locations, file_sizes, where, ratio, tilings)
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


_FILE, _BYTE_OFFSET = attrgetter("file"), attrgetter("byte_offset")


def _tensor_spec(
    fqn: str,
    entry: Any,
    locations: Locations,
    file_sizes: _FileSizes,
    where: Path,
    ratio: int = 1,
    tilings: dict[Any, str | None] | None = None,
) -> TensorSpec:
    """The spec of one tensor, its chunks checked in bulk: each check is one pass in C over all the chunks
    (a million of them at 1 TB), and the per-chunk message is found only when a check fails. `ratio`: the
    most a stored byte decompresses to (1: the records are not compressed). `tilings`: the tiling problem
    of each layout checked so far (the layers of a model repeat a few layouts)."""
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
    run = locations.span(fqn, offsets)  # torch's layout: one run of the columns
    if run is None:
        found = locations.rows(fqn, offsets)
        if None in found:
            missing = offsets[found.index(None)]
            raise CkptconvError(
                f"{where}: no stored data for {fqn!r} at offset {missing}; the metadata is corrupt"
            )
    stored: list[int] | range = found if run is None else run  # type: ignore[assignment]  # no None
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
    problem = _tiling(shape, offsets, sizes, {} if tilings is None else tilings)
    if problem:
        raise CkptconvError(f"{where}: tensor {fqn!r} {list(shape)}: {problem}; the checkpoint is incomplete")
    chunks = tuple(
        map(
            new_chunk,
            zip(offsets, sizes, files, starts, lengths, repeat("torch_save", len(files)), strict=True),
        )
    )
    return TensorSpec(fqn, dtype, shape, chunks)


def _tiling(
    shape: tuple[int, ...],
    offsets: list[tuple[int, ...]],
    sizes: list[tuple[int, ...]],
    known: dict[Any, Any],
) -> str | None:
    """`tiling_problem` of a tensor's chunks, once per layout: offsets and sizes are tuples of ints here
    (`_int_tuples`), so a layout equal to one checked before is the same layout."""
    layout = (shape, tuple(offsets), tuple(sizes))
    if layout not in known:
        known[layout] = tiling_problem(shape, list(zip(offsets, sizes, strict=True)))
    problem: str | None = known[layout]
    return problem


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


def _location(locations: Locations, fqn: str, file_sizes: _FileSizes, where: Path) -> tuple[str, int, int]:
    """Where a non-tensor item is stored: (file, start, length)."""
    run = locations.span(fqn, [None])
    row = run.start if run is not None else locations.rows(fqn, [None])[0]
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
    listed = list(tensors)
    # each file's first chunk, found in C: of equal keys, dict() keeps the last, so over the chunks backwards
    backwards = list(chain.from_iterable(t.chunks[::-1] for t in reversed(listed)))
    starts = dict(zip(map(_FILE, backwards), map(_BYTE_OFFSET, backwards), strict=True))
    del backwards
    order = dict.fromkeys(map(_FILE, chain.from_iterable(t.chunks for t in listed)))  # as first listed
    first = {rel: starts[rel] for rel in order}
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
