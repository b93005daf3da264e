"""Hugging Face safetensors: header reading (bounded, validated) and a streaming writer.

The writer lays out a file exactly as `safetensors.torch.save` does (same header, same data order, same
padding), but takes tensors one at a time, so no process ever holds a whole output file.
Call order: `SafetensorsWriter(path, entries)` writes the header; `write(key, tensor)` once per entry in
entry order; `close()` checks that every byte was written.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dtypes import from_st_name, st_name
from ..errors import CkptconvError
from .dcp import byte_view

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def header_bytes(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header safetensors writes for `entries` laid out in the given order."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key] = {
            "dtype": st_name(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    def __init__(self, path: Path, entries: Sequence[Entry]) -> None:
        self.path = path
        self.entries = list(entries)
        self._next = 0
        try:
            self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
            self._file.write(header_bytes(self.entries))
        except OSError as e:
            raise CkptconvError(
                f"{path}: cannot write ({e.strerror}); check free space and permissions"
            ) from None

    def write(self, key: str, tensor: torch.Tensor) -> None:
        entry = self.entries[self._next]
        assert entry.key == key and tensor.dtype == entry.dtype and tuple(tensor.shape) == entry.shape, key
        if entry.nbytes:
            try:
                self._file.write(byte_view(tensor.contiguous()))
            except OSError as e:
                raise CkptconvError(
                    f"{self.path}: cannot write ({e.strerror}); check free space and permissions"
                ) from None
        self._next += 1

    def close(self) -> None:
        assert self._next == len(self.entries), (
            f"{self.path}: {len(self.entries) - self._next} tensors missing"
        )
        try:
            self._file.close()
        except OSError as e:
            raise CkptconvError(f"{self.path}: cannot write ({e.strerror})") from None

    def abort(self) -> None:
        self._file.close()


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json` as transformers' save_pretrained writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class StoredTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    data_offset: int  # absolute offset of the first byte in `file`
    nbytes: int


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
    try:
        header = json.loads(raw)
    except ValueError:
        raise CkptconvError(
            f"{path}: the safetensors header is not valid JSON; the file is corrupt"
        ) from None
    if not isinstance(header, dict):
        raise CkptconvError(f"{path}: the safetensors header is not a JSON object")
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
        dtype = from_st_name(info["dtype"])
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CkptconvError(f"{path}: malformed header entry for {key!r}") from None
    if dtype is None:
        raise CkptconvError(f"{path}: tensor {key!r} has unknown dtype {info.get('dtype')!r}")
    entry = Entry(key, dtype, shape)
    if any(s < 0 for s in shape) or end - begin != entry.nbytes or begin < 0:
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


class RowReader:
    """Reads rows [lo, hi) of stored tensors straight into a new tensor, one `preadv` a slice.

    The offsets come from the header `read_header` validated, so these are exactly the bytes safetensors'
    `safe_open(...).get_slice(key)[lo:hi]` returns (tested), without an mmap: a process's memory then holds
    the slice it is saving, not every page of every file it has read.
    """

    MIN_RUN_BYTES = 4096  # a block whose contiguous runs are shorter is read as whole rows and cut

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def rows(self, t: StoredTensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [lo, hi) of `t` (a 0-d `t` whole), read into `out` if given (contiguous, right shape)."""
        if out is None:
            out = torch.empty((hi - lo, *t.shape[1:]) if t.shape else (), dtype=t.dtype)
        row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
        self._pread(t, t.data_offset + (lo * row_bytes if t.shape else 0), byte_view(out))
        return out

    def block(self, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The block of `t` at `offsets` of `sizes` (a rank's shard on any dims), reading only its bytes: one
        read per contiguous run of the block in the file, straight into place. When those runs are short
        (< MIN_RUN_BYTES: a column shard of a narrow tensor), its whole rows are read and cut instead."""
        k = max((d for d in range(len(sizes)) if sizes[d] != t.shape[d]), default=0)
        if k == 0:
            return self.rows(t, offsets[0], offsets[0] + sizes[0]) if sizes else self.rows(t, 0, 1)
        stride = [math.prod(t.shape[d + 1 :]) for d in range(len(sizes))]
        run = sizes[k] * stride[k] * t.dtype.itemsize
        if run < self.MIN_RUN_BYTES or not math.prod(sizes):
            rows = self.rows(t, offsets[0], offsets[0] + sizes[0])
            for d in range(1, len(sizes)):
                rows = rows.narrow(d, offsets[d], sizes[d])
            return rows  # a view of the rows: the caller copies it into place
        out = torch.empty(tuple(sizes), dtype=t.dtype)
        view = byte_view(out)
        runs = itertools.product(*(range(o, o + s) for o, s in zip(offsets[:k], sizes[:k], strict=True)))
        for i, index in enumerate(runs):
            element = sum(x * stride[d] for d, x in enumerate(index)) + offsets[k] * stride[k]
            self._pread(t, t.data_offset + element * t.dtype.itemsize, view[i * run : (i + 1) * run])
        return out

    def _pread(self, t: StoredTensor, start: int, view: memoryview) -> None:
        fd = self._fds.get(t.file)
        if fd is None:
            fd = self._fds[t.file] = os.open(t.file, os.O_RDONLY)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise CkptconvError(f"{t.file}: truncated while reading {t.key!r}; re-download it")
            done += n
        self.bytes_read += done

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
