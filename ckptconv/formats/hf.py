"""Hugging Face checkpoints: safetensors headers (bounded, validated), the index, the hub; no torch.

Reading and writing tensor bytes is `safetensors_io`.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dtype_names import ITEMSIZE, ST_TO_NAME, torch_dtype
from ..errors import CkptconvError

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json` as transformers' save_pretrained writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class StoredTensor:
    key: str
    dtype_name: str  # torch's name (`bfloat16`), as `specs.TensorSpec` keeps it
    shape: tuple[int, ...]
    file: Path
    data_offset: int  # absolute offset of the first byte in `file`
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)


def parse_header(raw: bytes, path: object) -> dict[str, Any]:
    """The JSON object of a safetensors header's bytes; `path` names the file in the error."""
    try:
        header = json.loads(raw)
    except ValueError:
        raise CkptconvError(
            f"{path}: the safetensors header is not valid JSON; the file is corrupt"
        ) from None
    if not isinstance(header, dict):
        raise CkptconvError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
    return header


def read_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse and validate one safetensors header: (tensors by key, __metadata__). Reads no tensor bytes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CkptconvError(f"{path}: too short to be a safetensors file (truncated?)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CkptconvError(
                    f"{path}: header length {length} is impossible; the file is corrupt or truncated"
                )
            raw = f.read(length)
    except OSError as e:
        raise CkptconvError(f"{path}: cannot read ({e.strerror})") from None
    header = parse_header(raw, path)
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + length
    tensors: dict[str, StoredTensor] = {}
    spans = []
    for key, info in header.items():
        tensors[key] = _stored(path, key, info, start, size)
        spans.append((tensors[key].data_offset, tensors[key].data_offset + tensors[key].nbytes, key))
    spans.sort()
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < end:
            raise CkptconvError(f"{path}: tensors {a!r} and {b!r} overlap; the file is corrupt")
    return tensors, {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}


def _stored(path: Path, key: str, info: Any, start: int, size: int) -> StoredTensor:
    try:
        dtype = ST_TO_NAME.get(info["dtype"])
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CkptconvError(f"{path}: malformed header entry for {key!r}") from None
    if dtype is None:
        raise CkptconvError(f"{path}: tensor {key!r} has unknown dtype {info.get('dtype')!r}")
    if any(s < 0 for s in shape) or end - begin != math.prod(shape) * ITEMSIZE[dtype] or begin < 0:
        raise CkptconvError(
            f"{path}: tensor {key!r}: shape {list(shape)} does not match its {end - begin} bytes"
        )
    if start + end > size:
        raise CkptconvError(f"{path}: tensor {key!r} lies past the end of the file (truncated?)")
    return StoredTensor(key, dtype, shape, path, start + begin, end - begin)


@dataclass(frozen=True)
class HfCheckpoint:
    path: Path  # the directory, or the single .safetensors file
    tensors: dict[str, StoredTensor]  # in file order, then header order
    files: tuple[Path, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and ((path / INDEX_FILE).is_file() or any(path.glob("*.safetensors")))


def open_hf(path: Path) -> HfCheckpoint:
    """Read the headers of a safetensors file or HF directory (with or without an index); validate them."""
    if path.is_file():
        return HfCheckpoint(path, read_header(path)[0], (path,))
    index_path = path / INDEX_FILE
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise CkptconvError(f"{index_path}: not a valid safetensors index (no weight_map)") from None
        names = list(dict.fromkeys(weight_map.values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise CkptconvError(f"{path}: no .safetensors files; not a Hugging Face safetensors checkpoint")
    tensors: dict[str, StoredTensor] = {}
    files = []
    for name in names:
        file = path / name
        if not file.is_file():
            raise CkptconvError(f"{index_path}: names {name}, which is missing; re-download the model")
        files.append(file)
        for key, stored in read_header(file)[0].items():
            if key in tensors:
                raise CkptconvError(f"{path}: key {key!r} is in both {tensors[key].file.name} and {name}")
            if weight_map is not None and weight_map.get(key) != name:
                raise CkptconvError(f"{index_path}: does not list {key!r} of {name}; the index is stale")
            tensors[key] = stored
    if weight_map is not None:
        missing = [k for k in weight_map if k not in tensors]
        if missing:
            raise CkptconvError(
                f"{index_path}: lists {missing[0]!r} in {weight_map[missing[0]]}, which does not hold it"
            )
    return HfCheckpoint(path, tensors, tuple(files))


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what hf-to-dcp and inspect fetch from the hub: weights, index, config, and a ckptconv stash if any
HUB_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "ckptconv_state.json",
]


def looks_like_repo_id(src: str) -> bool:
    return bool(_REPO_ID.match(src)) and not Path(src).exists()


def download(repo_id: str, revision: str | None) -> Path:
    """The local snapshot of a hub repo (weights and config only), through huggingface_hub's cache.

    Honors HF_HOME and HF_HUB_OFFLINE: offline, a cached snapshot is used and an uncached one is an error.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError:
        raise CkptconvError(
            f"{where}: not in the local Hugging Face cache and the hub cannot be reached "
            "(HF_HUB_OFFLINE is set or no network); download it once online, or pass a local directory"
        ) from None
    except RevisionNotFoundError:
        raise CkptconvError(f"{where}: no such revision; check --revision") from None
    except RepositoryNotFoundError:
        raise CkptconvError(
            f"{where}: no such repository on the hub (or it is private: run `hf auth login`)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise CkptconvError(f"{where}: download failed ({type(e).__name__}: {e})") from None
