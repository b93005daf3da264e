"""torch's distributed HF writer output as a DCP source: `HuggingFaceStorageWriter(save_distributed=True)`
(what NeMo Automodel's training saves) writes one `shard-0000R-model-0000I-of-0000N.safetensors` per rank and
file, each holding that rank's blocks, with `DCP_SHARDING_INFO` in the header's `__metadata__`: every key's
`saved_offsets` in the global tensor. There is no `.metadata`: the global shapes come from the blocks, which
must tile each tensor exactly (checked as DCP chunks are). The result is a `DcpCheckpoint` whose chunks are
safetensors tensors, so dcp-to-hf, verify and inspect read it like any DCP: at flat memory, on any number of
ranks, integer tensors included (torch's own consolidation holds whole tensors, and breaks on integers).

The writer puts each key in file I of N (`fqn_to_index_mapping`, in the `model-0000I-of-0000N` part of the
names); NeMo Automodel also leaves that mapping in `.hf_metadata/fqn_to_file_index_mapping.json`, beside the
model's config.json and generation_config.json. `DcpCheckpoint.file_split` keeps it (the JSON file wins over
the names), for `dcp-to-hf --keep-file-split`.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

from ckptconv.core.layout import tiling_problem
from ckptconv.core.specs import ChunkSpec, DcpCheckpoint, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.documents import load_json
from ckptconv.formats.files import KEY_MAP_BYTES, inside, is_directory, listdir, mode_of, read_regular
from ckptconv.formats.hf import SHARDING_KEY, read_header

MAX_SHARDING_CHARS = 64 * 2**20
HF_METADATA_DIR = ".hf_metadata"
SPLIT_FILE = "fqn_to_file_index_mapping.json"


def sharding_of(metadata: dict[str, str], path: Path) -> dict[str, tuple[int, ...]] | None:
    """The `saved_offsets` of every key, from a safetensors header's `__metadata__`; None without any."""
    raw = metadata.get(SHARDING_KEY)
    if raw is None:
        return None
    try:
        if len(raw) > MAX_SHARDING_CHARS:
            raise ValueError("too large")
        doc: Any = load_json(raw, path)
        return {
            str(key): tuple(_offset(x) for x in entry["saved_offsets"]) for key, entry in dict(doc).items()
        }
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise CkptconvError(
            f"{path}: its {SHARDING_KEY} header entry is malformed ({str(e)[:120]}); re-save the checkpoint"
        ) from None


def _offset(x: Any) -> int:
    if type(x) is not int or x < 0:
        raise ValueError(f"offset {x!r} is not a non-negative integer")
    return x


_NAME = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors")


def _shards(path: Path) -> list[str]:
    return sorted(n for n in listdir(path) if n.endswith(".safetensors"))


def _check_ranks(path: Path, names: list[str]) -> None:
    """torch numbers the shard files by rank from 1: a gap means a rank's file is missing. (A missing last
    rank leaves no gap; its absence shows only where its blocks leave a hole inside a tensor.)"""
    ranks = sorted({int(m.group(1)) for m in map(_NAME.fullmatch, names) if m} - {0})
    # the first rank from 1 with no file: found among the names, never by counting up to the largest number
    missing = next((want for want, rank in enumerate(ranks, 1) if rank != want), None)
    if missing is not None:
        raise CkptconvError(
            f"{path}: no shard file of rank {missing} (shard-{missing:05d}-model-*.safetensors); "
            "the checkpoint is incomplete, re-copy it"
        )


def is_sharded_dir(path: Path) -> bool:
    """A directory of safetensors files whose first one carries DCP_SHARDING_INFO (reads one header)."""
    mode = mode_of(path)
    if mode is None or not stat.S_ISDIR(mode):
        return False
    names = _shards(path)
    if not names:
        return False
    try:
        return sharding_of(read_header(path / names[0], path)[1], path / names[0]) is not None
    except CkptconvError:  # an unreadable file: not this layout; whoever reads it as HF names the problem
        return False


def open_sharded(path: Path) -> DcpCheckpoint:
    """Every shard file's header; the global tensors they tile (a missing shard file is a hole, named)."""
    chunks: dict[str, list[ChunkSpec]] = {}
    dtypes: dict[str, str] = {}
    stamps = {}
    split: dict[str, int] = {}
    names = _shards(path)
    _check_ranks(path, names)
    for name in names:
        file = path / name
        m = _NAME.fullmatch(name)
        stored, metadata = read_header(file, path)
        offsets = sharding_of(metadata, file)
        if offsets is None:
            raise CkptconvError(
                f"{file}: has no {SHARDING_KEY}, unlike the other shards; remove it or re-save"
            )
        for key, tensor in stored.items():
            if key not in offsets or len(offsets[key]) != len(tensor.shape):
                raise CkptconvError(
                    f"{file}: {SHARDING_KEY} gives no offsets of {len(tensor.shape)} dims for {key!r}"
                )
            if dtypes.setdefault(key, tensor.dtype_name) != tensor.dtype_name:
                raise CkptconvError(
                    f"{file}: {key!r} is {tensor.dtype_name} here, {dtypes[key]} in another shard"
                )
            if m:
                split[key] = int(m.group(2))
            end = tensor.data_offset + tensor.nbytes
            chunks.setdefault(key, []).append(
                ChunkSpec(offsets[key], tensor.shape, name, 0, end, "safetensors")
            )
            if tensor.stamp is not None:
                stamps[name] = tensor.stamp
    if not chunks:
        raise CkptconvError(f"{path}: its shard files hold no tensors")
    tensors = {}
    for key, parts in chunks.items():
        ranks = {len(c.sizes) for c in parts}
        if len(ranks) != 1:
            raise CkptconvError(f"{path}: the shards of {key!r} disagree on its number of dims")
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in parts) for d in range(ranks.pop()))
        problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in parts])
        if problem:
            raise CkptconvError(
                f"{path}: {key!r} {list(shape)}: {problem}; a rank's shard file is missing or stale"
            )
        tensors[key] = TensorSpec(key, dtypes[key], shape, tuple(parts))
    split = _split_file(path) or split
    paths: dict[str, tuple[str | int, ...]] = {key: (key,) for key in tensors}
    return DcpCheckpoint(path, tensors, {}, paths, stamps, kind="torch-hf-distributed", file_split=split)


def _split_file(path: Path) -> dict[str, int] | None:
    """`.hf_metadata/fqn_to_file_index_mapping.json` ({key: 1-based file index}), None when absent; like every
    file of `.hf_metadata/`, it must resolve inside the checkpoint `path`."""
    file = path / HF_METADATA_DIR / SPLIT_FILE
    if mode_of(file) is None:
        return None
    try:
        doc = load_json(read_regular(file, path, limit=KEY_MAP_BYTES), file)
        if not isinstance(doc, dict) or not all(
            isinstance(k, str) and type(v) is int and v >= 1 for k, v in doc.items()
        ):
            raise ValueError("not an object of key -> file number (from 1)")
    except (ValueError, RecursionError) as e:
        raise CkptconvError(f"{file}: unreadable ({str(e)[:120]}); fix or remove it") from None
    return dict(doc)


def metadata_dir(path: Path) -> Path | None:
    """NeMo Automodel's `.hf_metadata/` in the checkpoint `path` (config.json, generation_config.json, ...
    that dcp-to-hf copies), None without one. One resolving out of the checkpoint (a symlink to another
    directory) is refused: its files are read and copied only from inside `path`."""
    meta = path / HF_METADATA_DIR
    if not is_directory(meta):
        return None
    inside(meta, path)
    return meta
