"""Megatron-Core `torch_dist` checkpoints: what tells one apart, and its common state read without running it.

`dist_checkpointing.save` writes a torch DCP directory plus `metadata.json` (`"sharded_backend":
"torch_dist"`) and `common.pt`, a `torch.save` of every value that is not sharded: `iteration`, `args` (an
`argparse.Namespace`), `checkpoint_version`, the LR scheduler and the optimizer's param_groups (see
docs/notes/megatron-torch-dist.md). `torch.load(weights_only=True)` refuses the Namespace, and a real
Megatron-LM `args` also holds megatron's own enums and classes.

`read_common` reads `common.pt` from its pickle opcodes with an unpickler whose every global is a stand-in:
a Namespace becomes a dict, a dtype its name, a path a string, and anything else an `Opaque` record of the
class name that swallows its arguments. Nothing from the checkpoint is imported or called. What JSON holds
exactly is kept as values; every place an opaque object or a tensor sat is listed, so the caller can say
which parts were left out.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..dtype_names import ITEMSIZE
from ..errors import CkptconvError
from .files import mode_of, read_regular

MARKER_FILE = "metadata.json"
COMMON_FILE = "common.pt"
MAX_COMMON_BYTES = 64 * 2**20


def is_megatron(root: Path) -> bool:
    """Whether `root` holds Megatron-Core's `metadata.json` naming the torch_dist backend."""
    path = root / MARKER_FILE
    if mode_of(path) is None:
        return False
    try:
        doc = json.loads(read_regular(path, root, limit=2**20))
    except (CkptconvError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("sharded_backend") == "torch_dist"


@dataclass(frozen=True)
class Common:
    """Megatron's common state: `values[key]` is the readable part of each top-level entry (None when
    nothing of it is readable); `unreadable[key]` lists `key.path (what)` for each part of it left out."""

    values: dict[str, Any]
    unreadable: dict[str, tuple[str, ...]]
    raw: bytes


def read_common(root: Path) -> Common | None:
    """`root/common.pt` read without running it; None when the checkpoint has no common.pt."""
    path = root / COMMON_FILE
    if mode_of(path) is None:
        return None
    raw = read_regular(path, root, limit=MAX_COMMON_BYTES)
    try:
        value = load_opaque(raw)
    except (pickle.UnpicklingError, zipfile.BadZipFile, ValueError, EOFError, KeyError, TypeError) as e:
        raise CkptconvError(
            f"{path}: not a readable torch.save file ({type(e).__name__}: {e}); re-copy the checkpoint"
        ) from None
    if not isinstance(value, dict):
        raise CkptconvError(f"{path}: holds a {type(value).__name__}, not Megatron's common state dict")
    values: dict[str, Any] = {}
    unreadable: dict[str, tuple[str, ...]] = {}
    for key, item in value.items():
        left_out: list[str] = []
        values[str(key)] = readable(item, str(key), left_out)
        unreadable[str(key)] = tuple(left_out)
    return Common(values, unreadable, raw)


_LEFT_OUT = object()


def readable(value: Any, where: str, unreadable: list[str]) -> Any:
    """The part of `value` JSON holds exactly (tuples as lists); `_LEFT_OUT` parts are dropped from dicts
    and lists and named in `unreadable`. Returns None when nothing of `value` is readable."""
    out = _readable(value, where, unreadable)
    return None if out is _LEFT_OUT else out


def _readable(value: Any, where: str, unreadable: list[str]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        unreadable.append(f"{where} ({value})")
        return _LEFT_OUT
    if isinstance(value, Namespace):
        value = value.__dict__
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                unreadable.append(f"{where}[{k!r}] (a key JSON cannot hold)")
                continue
            got = _readable(v, f"{where}.{k}", unreadable)
            if got is not _LEFT_OUT:
                out[k] = got
        return out
    if isinstance(value, (list, tuple)):
        items = [_readable(v, f"{where}[{i}]", unreadable) for i, v in enumerate(value)]
        if any(v is _LEFT_OUT for v in items):
            return _LEFT_OUT  # a list with holes would shift positions: leave it out whole
        return items
    what = value.name if isinstance(value, Opaque) else type(value).__name__
    unreadable.append(f"{where} ({what})")
    return _LEFT_OUT


class Namespace:
    """`argparse.Namespace` / `types.SimpleNamespace`, as a plain attribute bag."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


class Opaque:
    """An object of a class ckptconv does not load: only its name is kept; arguments and state are dropped."""

    name = "an object"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:  # a callable built by the pickle (getattr)
        return _opaque(f"{self.name}(...)")()

    def __getattr__(self, name: str) -> Any:  # pickle looks up __setstate__ etc.; anything else is opaque
        if name.startswith("__"):
            raise AttributeError(name)
        return _opaque(f"{self.name}.{name}")()


def _opaque(name: str) -> type[Opaque]:
    return type("Opaque", (Opaque,), {"name": name})


def _getattr(owner: Any, name: Any) -> Opaque:
    """`builtins.getattr(Enum, "member")`, as some Python 3.11 releases (3.11.2 among them) pickle an enum
    member: an opaque record named after both, the attribute never looked up."""
    return _opaque(f"{getattr(owner, 'name', type(owner).__name__)}.{name}")()


def _path(*parts: Any) -> str:
    return str(PurePosixPath(*(str(p) for p in parts)))


_STAND_INS: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): Namespace,
    ("types", "SimpleNamespace"): Namespace,
    ("collections", "OrderedDict"): dict,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "Path"): _path,
    ("torch", "Size"): tuple,
    ("builtins", "getattr"): _getattr,
    ("__builtin__", "getattr"): _getattr,  # the same in protocol 2, which torch.save uses
    ("torch._utils", "_rebuild_tensor_v2"): _opaque("a tensor"),
    ("torch._utils", "_rebuild_parameter"): _opaque("a tensor"),
    **{("torch", name): name for name in ITEMSIZE},  # a dtype is pickled as the global torch.<name>
}


class _OpaqueUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _STAND_INS.get((module, name))
        return found if found is not None else _opaque(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:  # a tensor's storage: never read
        return _opaque("torch storage")()


def load_opaque(raw: bytes) -> Any:
    """The object of a `torch.save` file (zip) or a plain pickle, every global a stand-in (see module doc)."""
    if raw[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise ValueError("no single data.pkl in the archive")
            raw = z.read(names[0])
    return _OpaqueUnpickler(io.BytesIO(raw)).load()
