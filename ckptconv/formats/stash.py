"""Non-tensor items (`step`, `args`, nested dicts) <-> `ckptconv_state.json` in an HF directory.

Each item keeps its DCP key, its nesting path, and its value: as JSON when JSON holds it exactly (ints,
finite floats, strings, bools, None, lists, dicts with string keys), otherwise as its original torch.save
bytes (base64), so a DCP -> HF -> DCP round trip loses nothing. Items that only a full
unpickler could load (custom classes) are kept as bytes and never loaded. A 0-d tensor (`train_state.step`
as an int32 tensor) is kept as its number with `"tensor": "<dtype>"`, and restored as such a tensor.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptconv.core.specs import DcpCheckpoint, NonTensorItem, StashedItem, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import write_failed
from ckptconv.job.limits import MAX_INT_BITS, Budget

STASH_FILE = "ckptconv_state.json"
STASH_FORMAT = "ckptconv-stash"
STASH_VERSION = 1


def json_exact(value: Any, where: object = "a value") -> bool:
    """True when JSON round-trips `value` to an equal object of the same types. The walk is bounded: a node
    counts once per reference to it (a value unpickled from a few bytes can be a tree of 2^40 nodes), and
    past the read limits it is a `LimitExceeded` naming `where`."""
    return _exact(value, Budget(where), 1)


def _exact(value: Any, budget: Budget, level: int) -> bool:
    budget.objects(1, "nodes of the value walked")
    if value is None or isinstance(value, (bool, str)):
        return True
    if isinstance(value, int):
        return value.bit_length() <= MAX_INT_BITS  # beyond, Python will not print it
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | dict):
        budget.nested(level, "nesting of the value")
    if isinstance(value, list):
        return all(_exact(v, budget, level + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _exact(v, budget, level + 1) for k, v in value.items())
    return False


def to_json(items: list[StashedItem]) -> dict[str, Any]:
    out = []
    for item in items:
        entry: dict[str, Any] = {"key": item.key, "path": list(item.path)}
        if item.has_value:
            entry["value"] = item.value
            entry["tensor"] = item.tensor
        else:
            entry["type"] = type(item.value).__name__ if item.note is None else None
            entry["not_loaded"] = item.note
            entry["readable"] = item.readable
            entry["torch_save_b64"] = base64.b64encode(item.raw).decode()
        out.append({k: v for k, v in entry.items() if v is not None or k == "value"})
    return {"format": STASH_FORMAT, "version": STASH_VERSION, "items": out}


def write_stash(directory: Path, items: list[StashedItem]) -> None:
    """`ckptconv_state.json` in `directory`; a write error (disk full, permissions) names the file."""
    path = directory / STASH_FILE
    try:
        path.write_text(json.dumps(to_json(items), indent=2) + "\n")
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None


def read_stash(directory: Path) -> list[StashedItem]:
    """The items stashed in `directory`, [] when there is no stash file. Every item is checked as dcp-to-hf
    writes it (`_item`); a file that breaks any rule is refused, naming the item."""
    from ckptconv.formats.documents import load_json
    from ckptconv.formats.files import STASH_BYTES, exists, read_regular
    from ckptconv.formats.hf import checkpoint_root

    path = directory / STASH_FILE
    if not exists(path) and not path.is_symlink():
        return []
    raw = read_regular(path, checkpoint_root(directory), STASH_BYTES)  # a FIFO, a link out: refused
    try:
        doc = load_json(raw, path, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise CkptconvError(f"{path}: not a readable ckptconv stash ({e}); delete or fix it") from None
    if not isinstance(doc, dict) or doc.get("format") != STASH_FORMAT or doc.get("version") != STASH_VERSION:
        raise CkptconvError(f"{path}: not a ckptconv stash (unknown format or version); delete or fix it")
    entries = doc.get("items")
    if not isinstance(entries, list):
        raise CkptconvError(f"{path}: its 'items' is not a list; delete or fix it")
    items = [_item(path, i, e) for i, e in enumerate(entries)]
    _check_keys(path, items)
    return items


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (dcp-to-hf keeps such values as torch.save bytes)")


def _item(path: Path, i: int, e: Any) -> StashedItem:
    """Entry `i` of the stash at `path`, checked: a non-empty `key` naming its `path` (DCP's dotted name of
    it), and either a `value` (with `tensor`: a number of that dtype, in its range) or `torch_save_b64`
    bytes that are a torch.save archive."""

    def bad(why: str) -> CkptconvError:
        name = f" ({e['key']!r})" if isinstance(e, dict) and isinstance(e.get("key"), str) else ""
        return CkptconvError(f"{path}: item {i}{name}: {why}; delete or fix it")

    if not isinstance(e, dict):
        raise bad("not an object")
    key, where = e.get("key"), e.get("path")
    if not isinstance(key, str) or not key:
        raise bad("'key' must be a non-empty string")
    if not isinstance(where, list) or not where or not all(_part(p) for p in where):
        raise bad("'path' must be a non-empty list of non-empty names and indexes")
    if ".".join(map(str, where)) != key:
        raise bad(f"'key' is not the dotted 'path' {where!r}")
    note, has_value = e.get("not_loaded"), "value" in e
    if note is not None and not isinstance(note, str):
        raise bad("'not_loaded' must be a string")
    tensor = e.get("tensor")
    if tensor is not None:
        if not has_value:
            raise bad("'tensor' goes with a 'value'")
        why = _tensor_value(tensor, e["value"])
        if why:
            raise bad(why)
    raw = b""
    if not has_value:
        raw = _bytes(e.get("torch_save_b64"))
        if not raw:
            raise bad("no 'value', and 'torch_save_b64' is not the base64 of a torch.save archive")
    return StashedItem(
        key=key,
        path=tuple(where),
        raw=raw,
        value=e.get("value"),
        has_value=has_value,
        note=note,
        tensor=tensor,
        readable=e.get("readable"),
    )


def _part(p: Any) -> bool:
    return (isinstance(p, str) and p != "") or (type(p) is int and p >= 0)


def _bytes(text: Any) -> bytes:
    """The torch.save bytes in `text` (strict base64 of a zip archive with a data.pkl), b"" otherwise."""
    import binascii
    import io
    import zipfile

    if not isinstance(text, str):
        return b""
    try:
        raw = base64.b64decode(text, validate=True)
        names = zipfile.ZipFile(io.BytesIO(raw)).namelist()
    except (binascii.Error, ValueError, zipfile.BadZipFile, OSError):
        return b""
    return raw if any(n.endswith("data.pkl") for n in names) else b""


def _tensor_value(name: Any, value: Any) -> str | None:
    """Why `value` cannot be a 0-d tensor of dtype `name`, or None."""
    import torch

    from ckptconv.core.dtype_names import ITEMSIZE, torch_dtype

    if not isinstance(name, str) or name not in ITEMSIZE:
        return f"unknown tensor dtype {name!r}"
    dtype = torch_dtype(name)
    if dtype == torch.bool:
        ok = isinstance(value, bool)
    elif dtype.is_floating_point:
        number = _float(value) if type(value) in (int, float) else math.nan
        ok = math.isfinite(number) and bool(torch.tensor(number, dtype=dtype).isfinite())  # rounded: in range
    elif not dtype.is_complex and name in _INTS:
        bits = 8 * ITEMSIZE[name]
        low, high = (0, 2**bits - 1) if name.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        ok = type(value) is int and low <= value <= high
    else:
        return f"a 0-d {name} tensor is not kept as a JSON value"
    return None if ok else f"{value!r} is not a {name} value"


def _float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        return math.inf


_INTS = frozenset({"int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8"})


def _check_keys(path: Path, items: list[StashedItem]) -> None:
    """No key twice, and none the path of another's parent (`args` beside `args.lr`): DCP could not nest
    both."""
    paths = sorted(tuple(map(str, item.path)) for item in items)
    for a, b in itertools.pairwise(paths):
        if a == b:
            raise CkptconvError(f"{path}: the item {'.'.join(a)!r} appears twice; delete or fix it")
        if b[: len(a)] == a:
            raise CkptconvError(
                f"{path}: the item {'.'.join(a)!r} holds {'.'.join(b)!r}, another item; delete or fix it"
            )


def collect_stash(
    ckpt: DcpCheckpoint,
    stash: Sequence[NonTensorItem],
    scalars: Sequence[TensorSpec],
    common: Sequence[StashedItem],
    warn: Callable[[str], None],
) -> list[StashedItem]:
    """What dcp-to-hf stashes (the plan's choice): the non-tensor items `stash` (loaded with weights_only,
    or kept as bytes), the 0-d progress tensors `scalars` as numbers, and Megatron's common.pt values
    `common`."""
    import io

    import torch

    from ckptconv.formats.dcp_reader import DcpReader

    items = []
    with DcpReader(ckpt) as reader:
        for item in stash:
            raw, value, why = reader.load_item(item)
            if why is not None:
                warn(
                    f"non-tensor item {item.fqn!r} {why}: stashed as bytes, not loaded "
                    "(ckptconv never unpickles it)"
                )
            part = None if why is None else readable_part(raw, ckpt.path / item.file)
            exact = why is None and json_exact(value, f"{ckpt.path / item.file}: {item.fqn!r}")
            items.append(StashedItem(item.fqn, item.path, raw, value, exact, why, readable=part))
        for spec in scalars:
            tensor = reader.read_chunk(spec, spec.chunks[0])
            path = ckpt.paths.get(spec.fqn, (spec.fqn,))
            number = tensor.item()
            if json_exact(number):
                items.append(StashedItem(spec.fqn, path, b"", number, True, tensor=spec.dtype_name))
            else:  # nan / inf: its torch.save bytes
                buf = io.BytesIO()
                torch.save(tensor.clone(), buf)
                items.append(StashedItem(spec.fqn, path, buf.getvalue(), tensor))
    return items + list(common)


def readable_part(raw: bytes, where: object = "a non-tensor item") -> Any:
    """What JSON holds of a torch.save item weights_only refuses (an argparse.Namespace's fields, Megatron
    0.19's common state), read from its pickle's opcodes with stand-ins (formats.opaque) within the read
    limits (past them, a `LimitExceeded` naming `where`); None when nothing is."""
    from ckptconv.formats.opaque import load_opaque, readable

    budget = Budget(where)
    try:
        return readable(load_opaque(raw, where, budget), "", [], budget)
    except CkptconvError:
        raise
    except Exception:  # a pickle the stand-ins cannot follow: the bytes are kept all the same
        return None
