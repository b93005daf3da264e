"""Unpickling without running code from the checkpoint.

`.metadata` is loaded (by dcp_columns.load_dcp_metadata) allowing only the classes DCP's `.metadata` is made
of (see torch/distributed/checkpoint/metadata.py), into plain stand-ins without importing torch: a dtype
becomes its name (`"bfloat16"`), a `torch.Size` a tuple; the chunk and storage records go into columns
(dcp_columns). It also accepts torch's own save-plan records
(torch/distributed/checkpoint/planner.py): Megatron-Core keeps every rank's `SavePlan` in an extra
`all_local_plans` attribute of the `Metadata` it saves, and ckptconv ignores them. Any other global in the
pickle stops the load with a `CkptconvError` naming it. The allowlist unpickler here also serves
`torch_record.read_tensor_record`.

Nothing here copies what pickle's memo lets a stream reuse without charging the load's `limits.Budget`: a
`torch.Size` is the tuple it was pickled with (never a copy), a path or a dict built from memoized arguments
is charged for its length, and a record's state may have at most `MAX_RECORD_FIELDS` fields.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import PurePosixPath
from typing import Any, Protocol

from ckptconv.core.dtype_names import ITEMSIZE
from ckptconv.job.limits import MAX_RECORD_FIELDS, Budget, size_of

_LAYOUTS = ("torch.strided", "torch.sparse_coo")


def _get_layout(name: str) -> str:
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown layout {short(name)}")
    return name


def clip(text: str, most: int = 100) -> str:
    """`text` cut to `most` characters, for an error message (a name in a pickle can be megabytes)."""
    return text if len(text) <= most else text[: most - 3] + "..."


def short(value: object, most: int = 100) -> str:
    """`repr(value)` of a string or number, else its type's name; cut to `most` characters (an int too long
    to print, which `repr` refuses past 4300 digits, by its size)."""
    if isinstance(value, int) and value.bit_length() > 4 * most:
        return f"an integer of {value.bit_length()} bits"
    return clip(repr(value) if isinstance(value, str | bytes | int | float) else type(value).__name__, most)


class Charged:
    """An allowlisted constructor whose work grows with its arguments: the unpickler hands it the load's
    `Budget` first (`fn(budget, *args)`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn


MAX_PATH = 65536  # characters of a path (Linux takes 4096, Windows 32767)


def path_of(parts: tuple[Any, ...], budget: Budget) -> str:
    """`PurePosixPath(*parts)` as its string, each part a string; a memoized string joined to itself doubles
    at each step, so the parts are charged first and the result may not pass `MAX_PATH`."""
    texts = [p if isinstance(p, str) else type(p).__name__ for p in parts]
    length = sum(map(len, texts)) + len(texts)
    budget.bytes(length, "paths joined")
    if length > MAX_PATH:
        raise pickle.UnpicklingError(f"a path of more than {MAX_PATH} characters")
    return str(PurePosixPath(*texts))


def _path(budget: Budget, *parts: Any) -> str:
    return path_of(parts, budget)


def charged_dict(budget: Budget, *args: Any) -> dict[Any, Any]:
    """`collections.OrderedDict(...)` as a plain dict; the items copied from its argument are charged."""
    if len(args) > 1:
        raise pickle.UnpicklingError("OrderedDict takes at most one argument")
    budget.objects(size_of(args[0]) if args else 1, "dict items copied")
    return dict(*args)


# `torch.Size(t)` as `t` itself: `().__add__(t)` is `t` for a tuple (no copy), a TypeError for anything else,
# so a memoized list fed to it a million times copies nothing; one C call, as fast as `tuple` at a million
# chunks (`tuple` would copy a list each time)
SIZE = ().__add__


def record_state(state: Any) -> dict[str, Any]:
    """A record's BUILD state as one dict of at most `MAX_RECORD_FIELDS` fields: the dict, or the (dict,
    slots) pair of a class with `__slots__` (merged only once both are known to be small)."""
    if type(state) is dict:
        parts: tuple[Any, ...] = (state,)
    elif type(state) is tuple and len(state) == 2 and all(s is None or type(s) is dict for s in state):
        parts = tuple(s for s in state if s)
    else:
        raise pickle.UnpicklingError(f"unexpected record state {type(state).__name__}")
    if sum(map(len, parts)) > MAX_RECORD_FIELDS:
        raise pickle.UnpicklingError(f"a record with more than {MAX_RECORD_FIELDS} fields")
    return parts[0] if len(parts) == 1 else {k: v for part in parts for k, v in part.items()}


class Record:
    """A plain attribute bag standing in for one of DCP's metadata classes (built by NEWOBJ + BUILD).

    Loading into stand-ins rather than torch's own classes keeps `import torch.distributed.checkpoint` (most
    of a second) out of the CLI, and means nothing but attribute assignment happens while unpickling. These
    are the records there are one of per tensor or fewer (the chunk, index and storage records, one per
    chunk, load into dcp_columns' sinks), so a Python `__setstate__` costs nothing measurable; it copies at
    most `MAX_RECORD_FIELDS` fields, however often the stream reuses one state.
    """

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(record_state(state))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class Metadata(Record):
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None


class TensorStorageMetadata(Record):
    properties: Any
    size: Any
    chunks: list[Any]


class BytesStorageMetadata(Record):
    pass


class StorageMeta(Record):
    pass


class TensorProperties(Record):
    dtype: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:  # TensorProperties.__getstate__'s tuple
            self.dtype = state[0]
            return
        self.__dict__.update(record_state(state))


class _MemFormat:
    """DCP's `_MEM_FORMAT_ENCODING` enum, as the plain int of its value. Pickled as `_MEM_FORMAT_ENCODING(0)`,
    or by some Python 3.11 releases (3.11.2 among them) as `getattr(_MEM_FORMAT_ENCODING, "TORCH_...")`."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2

    def __new__(cls, value: int) -> int:  # type: ignore[misc]
        return int(value)


class _WriteItemType:
    """The planner's `WriteItemType` enum (`TENSOR`, `SHARD`, `BYTE_IO`), as the plain int of its value."""

    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3

    def __new__(cls, value: int) -> int:  # type: ignore[misc]
        return int(value)


class SavePlan(Record):
    """A rank's save plan (Megatron-Core's `all_local_plans`): `items`, `storage_data`, `planner_data`."""


class WriteItem(Record):
    pass


class TensorWriteData(Record):
    pass


class BytesIOWriteData(Record):
    pass


PLAN_RECORDS = ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")  # dcp_columns drops them

_ENUM_MEMBERS: dict[Any, set[str]] = {
    _MemFormat: {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"},
    _WriteItemType: {"TENSOR", "SHARD", "BYTE_IO"},
}


def _enum_member(cls: Any, name: Any) -> Any:
    """`builtins.getattr` as enum pickles use it: only a member name of an allowed enum stand-in."""
    if cls not in _ENUM_MEMBERS or name not in _ENUM_MEMBERS[cls]:
        raise Refused(f"builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, {short(name)})")
    return getattr(cls, name)


DCP_MD = "torch.distributed.checkpoint.metadata"
DCP_FS = "torch.distributed.checkpoint.filesystem"
DCP_PLANNER = "torch.distributed.checkpoint.planner"
# what `.metadata` may reference (dcp_columns loads the chunk, index and storage records into columns)
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (DCP_MD, "Metadata"): Metadata,
    (DCP_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (DCP_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (DCP_MD, "TensorProperties"): TensorProperties,
    (DCP_MD, "StorageMeta"): StorageMeta,
    (DCP_MD, "_MEM_FORMAT_ENCODING"): _MemFormat,
    ("builtins", "getattr"): _enum_member,
    (DCP_PLANNER, "SavePlan"): SavePlan,
    (DCP_PLANNER, "WriteItem"): WriteItem,
    (DCP_PLANNER, "WriteItemType"): _WriteItemType,
    (DCP_PLANNER, "TensorWriteData"): TensorWriteData,
    (DCP_PLANNER, "BytesIOWriteData"): BytesIOWriteData,
    ("torch", "Size"): SIZE,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): Charged(_path),
    ("pathlib", "PurePosixPath"): Charged(_path),
    ("pathlib", "WindowsPath"): Charged(_path),
    ("pathlib", "Path"): Charged(_path),
    ("collections", "OrderedDict"): Charged(charged_dict),
    **{("torch", name): name for name in ITEMSIZE},  # a dtype is pickled as the global torch.<name>
}


_TRUSTED: ContextVar[list[str] | None] = ContextVar("ckptconv_trust_pickle", default=None)


@contextmanager
def trusting() -> Iterator[list[str]]:
    """`--trust-pickle`: inside this block `.metadata` globals outside the allowlist, and non-tensor items
    `weights_only` refuses, are loaded with pickle's own (code-running) machinery; the list it yields
    collects what was loaded that way, for the command to report."""
    token = _TRUSTED.set([])
    try:
        loaded = _TRUSTED.get()
        assert loaded is not None
        yield loaded
    finally:
        _TRUSTED.reset(token)


def trusted() -> list[str] | None:
    """The list of what was loaded under `trusting()`, or None when pickles are not trusted."""
    return _TRUSTED.get()


class Readable(Protocol):
    """What the unpickler reads a pickle from (a file, `files.BoundedReader`)."""

    def read(self, n: int = -1, /) -> bytes: ...

    def readline(self, limit: int = -1, /) -> bytes: ...


class AllowlistUnpickler(pickle.Unpickler):
    trustable = False  # under `trusting()`, load globals outside the allowlist instead of refusing them

    def __init__(
        self, data: bytes | Readable, allowed: dict[tuple[str, str], Any], budget: Budget | None = None
    ) -> None:
        super().__init__(io.BytesIO(data) if isinstance(data, bytes) else data)
        self._allowed = allowed
        self.budget = budget or Budget("a pickle")

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = self._allowed[(module, name)]
        except KeyError:
            loaded = trusted() if self.trustable else None
            if loaded is None:
                raise Refused(clip(f"{module}.{name}", 200)) from None
            loaded.append(f"{module}.{name}")
            return super().find_class(module, name)
        return functools.partial(found.fn, self.budget) if type(found) is Charged else found


class MetadataUnpickler(AllowlistUnpickler):
    trustable = True


class Refused(pickle.UnpicklingError):
    """A global outside the allowlist."""
