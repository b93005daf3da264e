"""Hypothesis strategies over DCP checkpoints built with torch's own classes: `.metadata` edited through
DCP's Metadata, TensorStorageMetadata, ChunkStorageMetadata, BytesStorageMetadata, MetadataIndex and
`_StorageInfo` (shapes, offsets, sizes, dtypes, keys and storage entries chosen by hypothesis: overlaps,
gaps, negative, huge, empty, thousands of chunks) and pickled by pickle itself; and a non-tensor item's
bytes replaced by any bytes (its record appended to a `.distcp`, its storage entry pointed at it).
"""

from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path
from typing import Any

import torch
from fuzz_oracle import Shown, mostly
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

DIMS = [0, 1, 2, 3, 4, 5, 6, 8, 2**31, 2**40, 2**62, 2**63 - 1, -1, -(2**63)]
KEYS = ["", ".", "model.", "model..w", "model.embed.weight", "model.norm.weight", "é", "model." + "x" * 300]
KEYS += ["model.layers.99999999999999999999.w", "step", "args", "model.a\nb"]
PATHS = [
    "__0_0.distcp",
    "",
    ".",
    "..",
    "../x.distcp",
    "/etc/hostname",
    ".metadata",
    "nope.distcp",
    "a/../__0_0.distcp",
]
OFFSETS = [0, 1, 7, -1, 2**31, 2**63 - 1, 10**30]
DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.uint16,
    torch.qint8, torch.quint4x2,
]  # fmt: skip


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(8, 4, generator=g),
            "layers.0.w": torch.randn(6, 4, generator=g).to(torch.bfloat16),
            "norm.weight": torch.randn(4, generator=g),
            "counts": torch.arange(5, dtype=torch.int64),
            "wide": torch.randn(1, 4096, generator=g),  # a record that holds any one row of the stairs edit
            "flags": torch.tensor([True, False, True]),
        },
        "step": 7,
        "args": {"lr": 0.1, "name": "run"},
    }


def save(path: Path) -> Path:
    """A real one-process DCP checkpoint of `state()` (dcp.save)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state(), checkpoint_id=str(path), no_dist=True)
    return path


def read_metadata(ckpt: Path) -> Metadata:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt)).read_metadata()


def write_metadata(ckpt: Path, md: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def _size(draw: st.DrawFn, ndim: int | None = None) -> torch.Size:
    n = draw(st.integers(0, 4)) if ndim is None else ndim
    return torch.Size(draw(st.lists(st.sampled_from(DIMS), min_size=n, max_size=n)))


def _tensors(md: Metadata) -> list[str]:
    return sorted(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))


@st.composite
def metadata_edits(draw: st.DrawFn, base: Metadata) -> Shown[Metadata]:
    """`base` (deep-copied) with 1-4 edits (named in the note)."""
    md = copy.deepcopy(base)
    done: list[str] = []
    for _ in range(draw(mostly(1, [2, 3, 4]))):
        tensors = _tensors(md)
        edit = draw(
            st.sampled_from(
                [
                    "size", "chunk", "split", "many", "stairs", "dup_chunk", "drop_chunk", "dtype",
                    "to_bytes", "to_tensor", "rename", "delete", "storage", "drop_storage", "index",
                    "planner", "claim",
                ]
            )
        )  # fmt: skip
        if not tensors and edit not in ("to_tensor", "rename", "delete", "storage", "planner"):
            continue
        fqn = draw(st.sampled_from(tensors)) if tensors else ""
        entry = md.state_dict_metadata.get(fqn)
        chunks = entry.chunks if isinstance(entry, TensorStorageMetadata) else []
        if edit == "size":
            entry.size = _size(draw, draw(st.sampled_from([len(entry.size), None])))
        elif edit == "chunk" and chunks:
            i = draw(st.integers(0, len(chunks) - 1))
            ndim = draw(st.sampled_from([len(entry.size), None]))
            chunks[i] = ChunkStorageMetadata(offsets=_size(draw, ndim), sizes=_size(draw, ndim))
        elif edit == "claim":  # one chunk claiming the whole of a huge tensor
            entry.size = _size(draw, len(entry.size))
            entry.chunks = [ChunkStorageMetadata(torch.Size([0] * len(entry.size)), entry.size)]
        elif edit == "split" and chunks and len(entry.size) > 0:
            c = chunks.pop(0)
            at = draw(st.sampled_from([0, 1, c.sizes[0] // 2, c.sizes[0], c.sizes[0] + 1]))
            first = torch.Size([at, *c.sizes[1:]])
            rest = torch.Size([c.sizes[0] - at, *c.sizes[1:]])
            second = torch.Size([c.offsets[0] + at, *c.offsets[1:]])
            chunks += [ChunkStorageMetadata(c.offsets, first), ChunkStorageMetadata(second, rest)]
            _point(md, fqn, [c.offsets, second])
        elif edit == "many":  # a tensor of n rows in n one-row chunks, each with a storage entry
            n = draw(st.sampled_from([2, 100, 3000, 20000]))
            width = list(entry.size[1:])
            # every row is the one stored row: a tensor that may well convert, so at most 16 MiB of it
            # (the bounds are for bombs, not for a large tensor honestly converted)
            row = max(1, math.prod(width) * entry.properties.dtype.itemsize)
            n = min(n, max(2, 2**24 // row))
            entry.size = torch.Size([n, *width])
            rows = [torch.Size([i] + [0] * len(width)) for i in range(n)]
            entry.chunks = [ChunkStorageMetadata(r, torch.Size([1, *width])) for r in rows]
            _point(md, fqn, [c.offsets for c in entry.chunks])
        elif edit == "stairs":  # [n, n+1], row i cut at column i+1: 2n chunks, a grid of n * (n+1) cells
            n = draw(st.sampled_from([3, 100, 3000]))
            entry.size = torch.Size([n, n + 1])
            left = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, i + 1])) for i in range(n)]
            right = [ChunkStorageMetadata(torch.Size([i, i + 1]), torch.Size([1, n - i])) for i in range(n)]
            entry.chunks = left + right
            _point(md, fqn, [c.offsets for c in entry.chunks], "model.wide")
        elif edit == "dup_chunk" and chunks:
            chunks.append(copy.deepcopy(draw(st.sampled_from(chunks))))
        elif edit == "drop_chunk" and chunks:
            chunks.pop(draw(st.integers(0, len(chunks) - 1)))
        elif edit == "dtype":
            entry.properties = TensorProperties(dtype=draw(st.sampled_from(DTYPES)))
        elif edit == "to_bytes":
            md.state_dict_metadata[fqn] = BytesStorageMetadata()
        elif edit == "to_tensor":
            items = sorted(
                k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
            )
            if items:
                size = _size(draw)
                chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
                props = TensorProperties(dtype=draw(st.sampled_from(DTYPES)))
                md.state_dict_metadata[draw(st.sampled_from(items))] = TensorStorageMetadata(
                    props, size, [chunk]
                )
        elif edit == "rename":
            old = draw(st.sampled_from(sorted(md.state_dict_metadata))) if md.state_dict_metadata else ""
            if old:
                new = draw(st.sampled_from(KEYS))
                md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
                if draw(st.booleans()):  # its storage entries follow it
                    md.storage_data = {
                        (MetadataIndex(new, k.offset, k.index) if k.fqn == old else k): v
                        for k, v in md.storage_data.items()
                    }
        elif edit == "delete" and md.state_dict_metadata:
            del md.state_dict_metadata[draw(st.sampled_from(sorted(md.state_dict_metadata)))]
        elif edit == "storage" and md.storage_data:
            key = draw(st.sampled_from(list(md.storage_data)))
            info = md.storage_data[key]
            md.storage_data[key] = _StorageInfo(
                draw(st.sampled_from([info.relative_path, *PATHS])),
                draw(st.sampled_from([info.offset, *OFFSETS])),
                draw(st.sampled_from([info.length, 0, 1, -1, 2**40, info.length + 1])),
            )
        elif edit == "drop_storage" and md.storage_data:
            del md.storage_data[draw(st.sampled_from(list(md.storage_data)))]
        elif edit == "index" and md.storage_data:  # an index entry with another offset or hint
            key = draw(st.sampled_from(list(md.storage_data)))
            info = md.storage_data.pop(key)
            offset = draw(st.sampled_from([None, key.offset, _size(draw)]))
            md.storage_data[MetadataIndex(key.fqn, offset, draw(st.sampled_from([None, 0, 5, -1])))] = info
        elif edit == "planner":  # the nesting paths hf-to-dcp restores
            path = draw(st.sampled_from([(), ("model",), ("model", 3), ("a",) * 200, ("model", ""), (None,)]))
            planner = dict(md.planner_data or {})
            if planner:
                planner[draw(st.sampled_from(sorted(planner)))] = path
            md.planner_data = planner
        else:
            continue
        done.append(f"{edit} {fqn!r}" if fqn else edit)
    return Shown(md, "; ".join(done))


def _point(md: Metadata, fqn: str, offsets: list[torch.Size], source: str | None = None) -> None:
    """Storage entries for new chunks of `fqn`, each its own record (as a writer leaves them) pointing at the
    bytes of the first old chunk (of `source`'s, where it still has one)."""
    old = [k for k in md.storage_data if k.fqn == fqn]
    records = [k for k in md.storage_data if k.fqn == source] or old
    if not records:
        return
    info = md.storage_data[records[0]]
    for k in old:
        del md.storage_data[k]
    for i, offset in enumerate(offsets):
        md.storage_data[MetadataIndex(fqn, offset, i)] = copy.copy(info)


def inject_item(ckpt: Path, key: str, raw: bytes) -> None:
    """Make the non-tensor item `key` of `ckpt` hold `raw`: the bytes appended to its `.distcp` file and its
    storage entry pointed at them (through DCP's own classes)."""
    md = read_metadata(ckpt)
    index = next(k for k in md.storage_data if k.fqn == key)
    info = md.storage_data[index]
    target = ckpt / info.relative_path
    start = target.stat().st_size
    with open(target, "ab") as f:
        f.write(raw)
    md.storage_data[index] = _StorageInfo(info.relative_path, start, len(raw))
    write_metadata(ckpt, md)
