"""Pickles read with every global a stand-in, within the read limits: nothing from the pickle is imported or
called, and what a stand-in would build from memoized arguments is charged to the load's `Budget`.

A Namespace becomes a plain attribute bag, a dtype its name, a path a string, and anything else an `Opaque`
record of the class name that swallows its arguments (charged for their size: the constructor it stands for
would copy them). Megatron's `common.pt` is read this way (formats/megatron), and so is a non-tensor item
before `torch.load(weights_only=True)` may touch it (`scan`): the globals torch's weights_only load allows
whose cost grows with their arguments (`bytearray(n)` allocates n bytes from a few bytes of pickle, `set`
copies a memoized list each time) have stand-ins charging what the real call would build, and an item using
any other global is never handed to torch.load.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ckptconv.core.dtype_names import ITEMSIZE
from ckptconv.formats.safe_pickle import clip, path_of, short
from ckptconv.formats.torch_zip import TorchZip
from ckptconv.job.limits import MAX_INT_BITS, Budget, size_of

_BUDGET: ContextVar[Budget] = ContextVar("ckptconv_opaque_budget")
_CLASS_BYTES = 1024  # what one stand-in class costs (a type object and its dict)


def _charge(n: int, what: str) -> None:
    _BUDGET.get().objects(n, what)


class Namespace:
    """`argparse.Namespace` / `types.SimpleNamespace`, as a plain attribute bag."""

    def __init__(self, **kwargs: Any) -> None:
        _charge(len(kwargs), "Namespace fields")
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            _charge(len(state), "Namespace fields")
            self.__dict__.update(state)


class Opaque:
    """An object of a class ckptconv does not load: only its name is kept; arguments and state are dropped."""

    name = "an object"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _charge(sum(map(size_of, args)) + len(kwargs), f"arguments of {clip(self.name)}")

    def __setstate__(self, state: Any) -> None:
        _charge(size_of(state), f"state of {clip(self.name)}")

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:  # a callable built by the pickle (getattr)
        return _opaque(f"{self.name}(...)")(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # pickle looks up __setstate__ etc.; anything else is opaque
        if name.startswith("__"):
            raise AttributeError(name)
        return _opaque(f"{self.name}.{clip(name)}")()


def _opaque(name: str) -> type[Opaque]:
    """The stand-in class named `name` (cut to 200 characters: names built from names stop growing), made
    once per load (a pickle can name one global a million times); a new one is charged for its name and
    itself."""
    name = clip(name, 200)
    budget = _BUDGET.get()
    made = _CLASSES.get()
    cls = made.get(name)
    if cls is None:
        budget.bytes(len(name) + _CLASS_BYTES, "names of stand-in classes")
        cls = made[name] = type("Opaque", (Opaque,), {"name": name})
    return cls


_CLASSES: ContextVar[dict[str, type[Opaque]]] = ContextVar("ckptconv_opaque_classes")


def _getattr(owner: Any, name: Any) -> Opaque:
    """`builtins.getattr(Enum, "member")`, as some Python 3.11 releases (3.11.2 among them) pickle an enum
    member: an opaque record named after both, the attribute never looked up."""
    stand_in = isinstance(owner, Opaque) or (isinstance(owner, type) and issubclass(owner, Opaque))
    owner_name = owner.name if stand_in else type(owner).__name__
    return _opaque(f"{owner_name}.{clip(name) if isinstance(name, str) else type(name).__name__}")()


def _path(*parts: Any) -> str:
    return path_of(parts, _BUDGET.get())


def _charged(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`fn`, charging the sizes of its arguments first (what the real constructor copies)."""

    def call(*args: Any) -> Any:
        _charge(sum(map(size_of, args)), what)
        return fn(*args)

    return call


class _Dict(dict[Any, Any]):
    """`collections.OrderedDict`, a dict here: an OrderedDict's attributes (a state_dict's `_metadata`) come
    as BUILD state, charged and dropped."""

    def __setstate__(self, state: Any) -> None:
        _charge(size_of(state), "state of an OrderedDict")


def _bytearray(*args: Any) -> Opaque:
    """`bytearray(n)` allocates n bytes: a few bytes of pickle asking for gigabytes. Charged, never made."""
    first = args[0] if args else b""
    _BUDGET.get().bytes(first if isinstance(first, int) else size_of(first), "a bytearray")
    return _opaque("builtins.bytearray")()


def _encode(text: Any, encoding: Any = "utf-8", *_: Any) -> Opaque:
    """`_codecs.encode(str, "latin1")`: how protocol 2 pickles bytes (another codec may inflate: refused)."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with the codec {short(encoding)}")
    _BUDGET.get().bytes(size_of(text), "bytes encoded")
    return _opaque("_codecs.encode")()


def _tensor(*args: Any) -> Opaque:
    _charge(sum(map(size_of, args)), "tensor arguments")
    return _opaque("a tensor")()


_TENSOR_REBUILDS = ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter")

# stand-ins for what torch's weights_only load allows and costs no more than charged here: an item using only
# these (and dtypes and storages) may be loaded by torch; any other global keeps it as its bytes
STAND_INS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): _charged(_Dict, "dict items copied"),
    ("collections", "Counter"): _charged(lambda *a: _opaque("collections.Counter")(), "Counter items"),
    ("torch", "Size"): _charged(tuple, "torch.Size dimensions"),
    ("torch", "device"): _charged(lambda *a: _opaque("torch.device")(), "torch.device"),
    ("builtins", "set"): _charged(lambda *a: _opaque("builtins.set")(), "set items copied"),
    ("builtins", "frozenset"): _charged(lambda *a: _opaque("builtins.frozenset")(), "set items copied"),
    ("builtins", "complex"): _charged(lambda *a: _opaque("builtins.complex")(), "complex"),
    ("builtins", "bytearray"): _bytearray,
    ("_codecs", "encode"): _encode,
    **{("torch._utils", name): _tensor for name in _TENSOR_REBUILDS},
    **{("torch", name): name for name in ITEMSIZE},  # a dtype is pickled as the global torch.<name>
}
TORCH_LOADS = frozenset(f"{m}.{n}" for m, n in STAND_INS)

# the rest are for reading what JSON holds (Megatron's common.pt): torch.load is never given them
_READ_ONLY: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): Namespace,
    ("types", "SimpleNamespace"): Namespace,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "Path"): _path,
    ("builtins", "getattr"): _getattr,
}


class _OpaqueUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, extra: dict[tuple[str, str], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self.names: dict[str, None] = {}  # every global the pickle named, in order
        self.extra = extra or {}

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocol 2's name, as torch maps it
        full = clip(f"{module}.{name}", 200)
        self.names[full] = None
        found = self.extra.get((module, name), STAND_INS.get((module, name), _READ_ONLY.get((module, name))))
        return found if found is not None else _opaque(full)

    def persistent_load(self, pid: Any) -> Any:  # a tensor's storage: never read
        _charge(size_of(pid), "persistent ids")
        return _opaque("torch storage")()


@dataclass(frozen=True)
class Scanned:
    """A pickle read with stand-ins: its value and the globals it named (`module.name`, in order)."""

    value: Any
    names: tuple[str, ...]

    def unmodeled(self) -> list[str]:
        """The globals it names that have no stand-in charging what torch's weights_only load of them
        builds (the storage types, named only inside persistent ids, cost what their zip entries declare)."""
        storage = [n for n in self.names if n.startswith("torch.") and n.endswith("Storage")]
        return [n for n in self.names if n not in TORCH_LOADS and n not in storage]


def scan(raw: bytes, budget: Budget, extra: dict[tuple[str, str], Any] | None = None) -> Scanned:
    """The object of a torch.save file (zip) or a plain pickle, every global a stand-in (`extra`'s first),
    within `budget` (LimitExceeded past it; the pickle's own errors as they come)."""
    if raw[:4] == b"PK\x03\x04":
        archive = TorchZip(raw, budget.where, budget)
        names = [n for n in archive.entries if n == "data.pkl"]
        if len(names) != 1:
            raise ValueError("no single data.pkl in the archive")
        raw = archive.read("data.pkl")
    budget_token, classes_token = _BUDGET.set(budget), _CLASSES.set({})
    try:
        unpickler = _OpaqueUnpickler(raw, extra)
        value = unpickler.load()
        return Scanned(value, tuple(unpickler.names))
    finally:
        _BUDGET.reset(budget_token)
        _CLASSES.reset(classes_token)


class _BytesIO:
    """`io.BytesIO` as pickled (its state is `(bytes, position, dict)`): only its bytes are kept."""

    value = b""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and state and isinstance(state[0], bytes):
            self.value = state[0]


def _latin1(text: Any, encoding: Any = "utf-8", *_: Any) -> bytes:
    """`_codecs.encode(str, "latin1")`, made: how protocol 2 pickles the bytes of a BytesIO."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with the codec {short(encoding)}")
    _BUDGET.get().bytes(len(text), "bytes encoded")
    return text.encode("latin1")


def bytes_io(raw: bytes, budget: Budget) -> bytes | None:
    """The bytes of the `io.BytesIO` a torch.save file holds (as torch's DCP saves a BytesIO value: Megatron's
    ShardedObjects), read with stand-ins within `budget`; None when it holds anything else."""
    value = scan(raw, budget, {("_io", "BytesIO"): _BytesIO, ("_codecs", "encode"): _latin1}).value
    return value.value if isinstance(value, _BytesIO) else None


def load_opaque(raw: bytes, where: object = "a pickle", budget: Budget | None = None) -> Any:
    """The object `scan` reads (see the module doc)."""
    return scan(raw, budget or Budget(where)).value


def readable(value: Any, where: str, unreadable: list[str], budget: Budget | None = None) -> Any:
    """The part of `value` JSON holds exactly (tuples as lists); parts left out are dropped from dicts and
    lists and named in `unreadable`. Returns None when nothing of `value` is readable. The walk is charged
    to `budget` (a node once per reference to it, a name left out for its length) and goes no deeper than
    its depth limit; the names are cut short (a key in a pickle can be megabytes)."""
    walk = _Walk(unreadable, budget or Budget(where))
    out = walk.readable(value, (clip(where),), 1)
    return None if out is _LEFT_OUT else out


_LEFT_OUT = object()


class _Walk:
    """One walk of `readable`. Where a node is goes down as a chain of (parent, key or index) pairs, made
    into a name only for a part left out."""

    def __init__(self, unreadable: list[str], budget: Budget) -> None:
        self.unreadable, self.budget = unreadable, budget

    def readable(self, value: Any, where: tuple[Any, ...], level: int) -> Any:
        self.budget.objects(1, "nodes of the value walked")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            return self.left_out(where, short(value))
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else self.left_out(where, str(value))
        if isinstance(value, Namespace):
            value = value.__dict__
        if isinstance(value, dict | list | tuple):
            self.budget.nested(level, "nesting of the value")
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    self.left_out((where, _Key(short(k))), "a key JSON cannot hold")
                    continue
                got = self.readable(v, (where, k), level + 1)
                if got is not _LEFT_OUT:
                    out[k] = got
            return out
        if isinstance(value, (list, tuple)):
            items = [self.readable(v, (where, i), level + 1) for i, v in enumerate(value)]
            if any(v is _LEFT_OUT for v in items):
                return _LEFT_OUT  # a list with holes would shift positions: leave it out whole
            return items
        return self.left_out(where, value.name if isinstance(value, Opaque) else type(value).__name__)

    def left_out(self, where: tuple[Any, ...], what: str) -> object:
        steps: list[str] = []
        while len(where) == 2:
            where, step = where
            steps.append(f"[{step}]" if isinstance(step, int | _Key) else f".{clip(step)}")
        name = f"{clip(where[0] + ''.join(reversed(steps)), 300)} ({clip(what)})"
        self.budget.bytes(len(name), "names of parts left out")
        self.unreadable.append(name)
        return _LEFT_OUT


class _Key(str):
    """A key JSON cannot hold, as the walk names it: `[key]`."""
