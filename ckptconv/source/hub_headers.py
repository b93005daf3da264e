"""A hub repo's safetensors headers by HTTP range reads at one commit, read by ckptconv's bounded reader.

Not huggingface_hub's `get_safetensors_metadata`: it parses the index with a bare `json.load` (no size or
depth limit, duplicate keys kept, a `weight_map` of any types) and each header with `json.loads` into
`TensorInfo`s whose `parameter_count` multiplies every dim out as a Python int, so a repo's crafted header
(25 MB of dims: hours of big-int products; a JSON list; a nesting of 100,000 levels) hangs the run or ends it
in a traceback. Here the index is the cached one `formats.hf` reads as it reads a local index (size, depth,
duplicate keys, types, names inside the snapshot), at most `MAX_HEADER_BYTES` of each header are ever read,
and each is held to what the safetensors library accepts (`formats.hf.parse_header`, `from_headers`)."""

from __future__ import annotations

import importlib
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

from ckptconv.core.specs import HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import mode_of
from ckptconv.formats.hf import (
    INDEX_FILE,
    MAX_HEADER_BYTES,
    checkpoint_root,
    from_headers,
    parse_header,
    read_weight_map,
)
from ckptconv.source.hub import first_line

SINGLE_FILE = "model.safetensors"  # a repo without an index: huggingface_hub's one-file convention
TIMEOUT_S = 10.0  # huggingface_hub's own default for these reads
FIRST_READ = 100_000  # huggingface_hub's first read: most headers are shorter, one GET a file
WORKERS = 8  # files read at once, as huggingface_hub's thread map reads them


def read_headers(repo_id: str, directory: Path) -> HfCheckpoint | None:
    """The tensors of the repo whose snapshot at commit `directory.name` is `directory` (its index, if any,
    cached there), from their headers; None: the repo has neither an index nor `model.safetensors`."""
    index = directory / INDEX_FILE
    weight_map = read_weight_map(index, checkpoint_root(directory)) if mode_of(index) is not None else None
    names = list(dict.fromkeys(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    for name in names:
        # a name with a folder is refused (as `from_headers` would), before it is put in a URL: one with
        # `..` would read another path of the Hub with the user's token
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CkptconvError(f"{index}: names {name!r}, not a file of the repo's top folder")
    with ThreadPoolExecutor(max_workers=min(WORKERS, len(names))) as pool:  # as huggingface_hub reads them
        found = list(
            pool.map(lambda name: _header_bytes(repo_id, directory.name, name, directory / name), names)
        )
    headers: dict[str, dict[str, Any]] = {}
    for name, raw in zip(names, found, strict=True):
        if raw is None:
            if weight_map is not None:
                raise CkptconvError(f"{index}: names {name}, which the repo does not hold")
            return None
        headers[name] = parse_header(raw, directory / name)
    return from_headers(directory, headers, weight_map)


def _header_bytes(repo_id: str, revision: str, name: str, shown: Path) -> bytes | None:
    """The JSON bytes of file `name`'s header (None: no such file): the first `FIRST_READ` bytes, then the
    rest of a longer header, at most `MAX_HEADER_BYTES` (`shown`: the file in messages)."""
    first = _read(repo_id, revision, name, 0, FIRST_READ)
    if first is None:
        return None
    if len(first) < 8:
        raise CkptconvError(f"{shown}: too short to be a safetensors file (truncated?)")
    (length,) = struct.unpack("<Q", first[:8])
    if length > MAX_HEADER_BYTES:
        raise CkptconvError(
            f"{shown}: header length {length} is impossible; the file is corrupt or truncated"
        )
    raw = first[8 : 8 + length] if 8 + length <= len(first) else _read(repo_id, revision, name, 8, length)
    if raw is None or len(raw) < length:
        got = 0 if raw is None else len(raw)
        raise CkptconvError(f"{shown}: the hub sent {got} of its header's {length} bytes (truncated?)")
    return raw[:length]


def _read(repo_id: str, revision: str, name: str, start: int, size: int) -> bytes | None:
    """Bytes `start` to `start + size` of a repo file, fewer past its end (None: no such file), by one
    ranged GET as huggingface_hub's own header reads make it (with a client of any of its versions)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo_id, name, revision=revision)
    ranged = {**build_hf_headers(), "range": f"bytes={start}-{start + size - 1}"}
    try:
        response = get_session().get(url, headers=ranged, timeout=TIMEOUT_S)
        try:
            hf_raise_for_status(response)
        except EntryNotFoundError:
            return None
        data = response.content
    except _client_errors() as e:
        raise CkptconvError(f"reading {name}'s header failed ({type(e).__name__}: {first_line(e)})") from None
    if response.status_code != 206:  # a server that ignores the range sends the file from byte 0
        data = data[start:]
    return data[:size]


def _client_errors() -> tuple[type[Exception], ...]:
    """What a failed request raises: huggingface_hub's errors, and its HTTP client's (requests' are
    OSErrors; httpx's share no base with them)."""
    from huggingface_hub.errors import HfHubHTTPError

    found: list[type[Exception]] = [HfHubHTTPError, OSError, ValueError]
    for module in ("httpx2", "httpx"):
        with suppress(ImportError):
            found.append(importlib.import_module(module).HTTPError)
    return tuple(found)
