"""Hugging Face checkpoints: safetensors headers (bounded, validated), the index, the hub; no torch.

Reading and writing tensor bytes is `safetensors_io`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptconv.core.dtype_names import ITEMSIZE, ST_TO_NAME
from ckptconv.core.jsonkeys import DuplicateKey
from ckptconv.core.specs import HfCheckpoint, Stamp, StoredTensor
from ckptconv.errors import CkptconvError
from ckptconv.formats.documents import load_json
from ckptconv.formats.files import (
    inside,
    listdir,
    mode_of,
    open_regular,
    pread_exact,
    read_error,
    read_regular,
    stamp,
)
from ckptconv.remote.urls import UrlPath

if TYPE_CHECKING:
    pass

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses a larger header
MAX_INDEX_BYTES = 1 << 30


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json` as transformers' save_pretrained writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def parse_header(raw: bytes, path: object) -> dict[str, Any]:
    """The JSON object of a safetensors header's bytes, parsed as strictly as the safetensors library
    parses it (UTF-8, at most 127 levels of nesting, no duplicate keys, no NaN / Infinity, no number out of
    range); `path` names the file in the error."""
    try:
        header = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_float=_float,
            parse_int=_int,
        )
        if _depth(header) > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        why = "too deeply nested" if isinstance(e, RecursionError) else str(e).split("\n")[0][:200]
        raise CkptconvError(
            f"{path}: the safetensors header is not valid JSON ({why}); the file is corrupt"
        ) from None
    if not isinstance(header, dict):
        raise CkptconvError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
    return header


MAX_DEPTH = 127  # serde_json's recursion limit, as the safetensors library parses a header


def _depth(value: Any) -> int:
    """How deeply a parsed JSON value nests (an object or array is one level), in linear time and without
    recursing (json.loads itself stops at Python's recursion limit with a RecursionError)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (which two readers could resolve differently) and strings
    that are not Unicode (lone surrogates from `\\ud800` escapes, which safetensors refuses)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        key.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
        if isinstance(value, str):
            value.encode("utf-8")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    """`NaN`, `Infinity`, `-Infinity`: Python's json reads them, JSON (and safetensors) does not."""
    raise ValueError(f"{name} is not JSON")


def _float(text: str) -> float:
    """A JSON number with a fraction or exponent, refused when it overflows a double (`1e400`)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} out of range")
    return value


def _int(text: str) -> int:
    """A JSON integer, refused when longer than any double (Python would read any number of digits)."""
    if len(text.lstrip("-")) > 309:  # serde_json reads it as a double, which it overflows
        raise ValueError(f"number {text[:40]}... out of range")
    return int(text)


def read_header(path: Path, root: Path | None = None) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse and validate one safetensors header: (tensors by key, __metadata__). Reads no tensor bytes.

    `path` must be a regular file, inside `root` when given (see `files.open_regular`). The file is held to
    what the safetensors library accepts: the tensors tile the data exactly up to the end of the file."""
    if isinstance(path, UrlPath):
        if root is not None:
            inside(path, root)
        raw, size, version = _remote_header(path)
    else:
        raw, size, version = _local_header(path, root)
    tensors, metadata = header_tensors(parse_header(raw, path), path, 8 + len(raw), size)
    return {k: dataclasses.replace(t, stamp=version) for k, t in tensors.items()}, metadata


def _local_header(path: Path, root: Path | None) -> tuple[bytes, int, Stamp]:
    fd = open_regular(path, root)
    try:
        st = _fstat(fd, path)
        head = bytearray(8)
        if st.st_size < 8:
            raise CkptconvError(f"{path}: too short to be a safetensors file (truncated?)")
        pread_exact(fd, path, 0, memoryview(head))
        raw = bytearray(_header_length(path, bytes(head), st.st_size))
        pread_exact(fd, path, 8, memoryview(raw))
    finally:
        os.close(fd)
    return bytes(raw), st.st_size, stamp(st)


def _remote_header(url: UrlPath) -> tuple[bytes, int, Stamp]:
    """An object's header: two ranged GETs (its length, then the JSON), never a tensor byte."""
    from ckptconv.remote import tree

    size = tree.size(url)
    if size is None:
        raise CkptconvError(f"{url}: no such object")
    if size < 8:
        raise CkptconvError(f"{url}: too short to be a safetensors file (truncated?)")
    length = _header_length(url, tree.read(url, 0, 8), size)
    return tree.read(url, 8, length), size, (0, 0, size, 0)


def _header_length(path: Path, head: bytes, size: int) -> int:
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CkptconvError(f"{path}: header length {length} is impossible; the file is corrupt or truncated")
    return int(length)


def _fstat(fd: int, path: Path) -> os.stat_result:
    """`os.fstat`, an OSError as a one-line error naming `path`."""
    try:
        return os.fstat(fd)
    except OSError as e:
        raise read_error(path, e) from None


def header_tensors(
    header: dict[str, Any], path: Path, start: int, end: int
) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Validate a parsed header whose data begins at file offset `start` and must end exactly at `end`."""
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CkptconvError(f"{path}: __metadata__ is not a map of strings to strings; the file is corrupt")
    tensors = {key: _stored(path, key, info, start, end) for key, info in header.items()}
    spans = sorted((t.data_offset, t.data_offset + t.nbytes, key) for key, t in tensors.items())
    at, previous = start, None
    for begin, stop, key in spans:
        if begin < at:
            raise CkptconvError(f"{path}: tensors {previous!r} and {key!r} overlap; the file is corrupt")
        if begin > at:
            raise CkptconvError(
                f"{path}: bytes {at - start}-{begin - start} of the data belong to no tensor (before "
                f"{key!r}); the file is corrupt"
            )
        at, previous = stop, key
    if at != end:
        raise CkptconvError(
            f"{path}: {end - at} bytes after the last tensor belong to no tensor; the file is corrupt"
        )
    return tensors, metadata


_U64 = 2**64
_I64 = 2**63


def _stored(path: Path, key: str, info: Any, start: int, end: int) -> StoredTensor:
    """One header entry as a StoredTensor, with the checks safetensors' `Metadata::validate` makes."""
    try:
        name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError):
        raise CkptconvError(f"{path}: malformed header entry for {key!r}") from None
    if not isinstance(name, str) or not isinstance(shape, list) or not _counts(offsets) or len(offsets) != 2:
        raise CkptconvError(f"{path}: malformed header entry for {key!r}")
    dtype = ST_TO_NAME.get(name)
    if dtype is None:
        raise CkptconvError(f"{path}: tensor {key!r} has unknown dtype {name!r}")
    if not _counts(shape) or any(s >= _I64 for s in shape):
        raise CkptconvError(
            f"{path}: tensor {key!r}: shape {shape} is not a list of dimensions (integers from 0 to 2**63-1)"
        )
    begin, stop = offsets
    numel = 1
    for s in shape:  # in this order, as safetensors multiplies (an overflow with a 0 after it counts)
        numel *= s
        if numel >= _U64:
            break
    nbytes = numel * ITEMSIZE[dtype]
    if numel >= _U64 or nbytes * 8 >= _U64:
        raise CkptconvError(f"{path}: tensor {key!r}: shape {shape} overflows a 64-bit size")
    if stop < begin or stop - begin != nbytes:
        raise CkptconvError(f"{path}: tensor {key!r}: shape {shape} does not match its {stop - begin} bytes")
    if start + stop > end:
        raise CkptconvError(f"{path}: tensor {key!r} lies past the end of the file (truncated?)")
    return StoredTensor(key, dtype, tuple(shape), path, start + begin, nbytes)


def _counts(value: Any) -> bool:
    """Whether `value` is a list of JSON integers in u64 (not bools, not floats), as serde reads `usize`."""
    return isinstance(value, list) and all(type(x) is int and 0 <= x < _U64 for x in value)


def is_hf_dir(path: Path) -> bool:
    """Whether `path` is a directory holding an index or .safetensors files (EACCES: a one-line error)."""
    mode = mode_of(path)
    if mode is None or not stat.S_ISDIR(mode):
        return False
    return any(n == INDEX_FILE or n.endswith(".safetensors") for n in listdir(path))


def checkpoint_root(directory: Path) -> Path:
    """The directory every file of the HF checkpoint in `directory` must resolve into: `directory` itself,
    or for a huggingface_hub cache snapshot (`models--org--name/snapshots/<rev>/`, whose files are symlinks
    to `../../blobs/<sha>`) the repo's cache folder `models--org--name/`."""
    if isinstance(directory, UrlPath):
        return directory
    real = Path(os.path.realpath(directory))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return directory


def open_hf(path: Path, dequantize: bool = True) -> HfCheckpoint:
    """Read the headers of a safetensors file or HF directory (with or without an index); validate them.
    Quantized weights are one logical tensor each unless not `dequantize` (then every stored key is one).

    In a directory every file, named by the index or found there, must resolve inside `checkpoint_root`."""
    mode = mode_of(path)
    if mode is None:
        raise CkptconvError(f"{path}: no such file or directory")
    if not stat.S_ISDIR(mode):
        tensors = _unsharded(path, *read_header(path))
        return HfCheckpoint(path, _dequantized(tensors, None, None) if dequantize else tensors, (path,))
    root = checkpoint_root(path)
    index_path = path / INDEX_FILE
    weight_map = read_weight_map(index_path, root) if mode_of(index_path) is not None else None
    if weight_map is not None:
        names = list(dict.fromkeys(weight_map.values()))
    else:
        names = [n for n in listdir(path) if n.endswith(".safetensors")]
    if not names:
        raise CkptconvError(f"{path}: no .safetensors files; not a Hugging Face safetensors checkpoint")

    def read() -> Iterator[tuple[Path, tuple[dict[str, StoredTensor], dict[str, str]]]]:
        for name in names:
            file = path / name
            if weight_map is not None and mode_of(file) is None:
                raise CkptconvError(f"{index_path}: names {name}, which is missing; re-download the model")
            yield file, read_header(file, root)

    return _assembled(path, root, read(), weight_map, dequantize)


def from_headers(
    directory: Path, headers: dict[str, dict[str, Any]], weight_map: dict[str, str] | None
) -> HfCheckpoint:
    """An HF checkpoint from its files' parsed headers alone (file name -> the header's JSON object, read
    elsewhere: the hub's ranged reads), validated as `open_hf` validates what it reads; `directory` holds
    its config.json (and index), not necessarily its weights."""
    root = checkpoint_root(directory)
    names = list(dict.fromkeys(weight_map.values())) if weight_map is not None else list(headers)
    read = []
    for name in names:
        file = directory / name
        if name not in headers:
            raise CkptconvError(f"{directory / INDEX_FILE}: names {name}, which has no header")
        header = dict(headers[name])
        read.append((file, header_tensors(header, file, 0, _data_end(header))))
    return _assembled(directory, root, iter(read), weight_map)


def _data_end(header: dict[str, Any]) -> int:
    """Where a header's data ends, from its entries' offsets (a malformed entry is refused later, by name)."""
    offsets: list[Any] = [info.get("data_offsets") for info in header.values() if isinstance(info, dict)]
    return max((o[1] for o in offsets if _counts(o) and len(o) == 2), default=0)


def _assembled(
    path: Path,
    root: Path,
    read: Iterator[tuple[Path, tuple[dict[str, StoredTensor], dict[str, str]]]],
    weight_map: dict[str, str] | None,
    dequantize: bool = True,
) -> HfCheckpoint:
    """The checkpoint of a directory's files' headers (file, (tensors, __metadata__)): no key in two files,
    the index agreeing with the headers, quantized weights as their logical tensors (if `dequantize`)."""
    index_path = path / INDEX_FILE
    tensors: dict[str, StoredTensor] = {}
    files = []
    for file, (stored_tensors, metadata) in read:
        name = file.name
        files.append(file)
        for key, stored in _unsharded(file, stored_tensors, metadata).items():
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
    return HfCheckpoint(path, _dequantized(tensors, path, root) if dequantize else tensors, tuple(files))


def _dequantized(
    tensors: dict[str, StoredTensor], directory: Path | None, root: Path | None
) -> dict[str, StoredTensor]:
    """Quantized weights as one logical tensor each, in the dtype config.json names (`hf_quant`: the scheme is
    config.json's quantization_config; a config.json that cannot be read matters only when some tensor looks
    quantized)."""
    from ckptconv.formats import hf_quant

    try:
        config = hf_quant.read_config(directory, root)
    except CkptconvError:
        if hf_quant.might_be_quantized(tensors):
            raise
        return tensors
    if "quantization_config" not in config and not hf_quant.might_be_quantized(tensors):
        return tensors
    return hf_quant.logical_tensors(tensors, config)


SHARDING_KEY = "DCP_SHARDING_INFO"  # torch's distributed HF writer: a rank's blocks, not whole tensors


def _unsharded(
    file: Path, tensors: dict[str, StoredTensor], metadata: dict[str, str]
) -> dict[str, StoredTensor]:
    """The tensors of an HF file; a shard of torch's distributed HF writer (one rank's blocks) is refused."""
    if SHARDING_KEY in metadata:
        raise CkptconvError(
            f"{file}: is one rank's shard written by torch's HuggingFaceStorageWriter(save_distributed=True) "
            f"({SHARDING_KEY}), not whole tensors; convert its directory with dcp-to-hf"
        )
    return tensors


def read_weight_map(index_path: Path, root: Path) -> dict[str, str]:
    """The index's weight_map (key -> file name relative to the directory), read as a regular file."""
    raw = read_regular(index_path, root, MAX_INDEX_BYTES)
    try:
        weight_map = load_json(raw, index_path)["weight_map"]
    except DuplicateKey as e:
        raise CkptconvError(f"{index_path}: not a valid safetensors index ({e})") from None
    except (ValueError, KeyError, TypeError, RecursionError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()
    ):
        raise CkptconvError(f"{index_path}: not a valid safetensors index (no weight_map)")
    for name in weight_map.values():
        inside(index_path.parent / name, root)
    return weight_map
