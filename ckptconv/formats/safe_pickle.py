"""Unpickling without running code from the checkpoint.

`.metadata` is loaded (by dcp_columns.load_dcp_metadata) allowing only the classes DCP's `.metadata` is made
of (see torch/distributed/checkpoint/metadata.py), into plain stand-ins without importing torch: a dtype
becomes its name (`"bfloat16"`), a `torch.Size` a tuple; the chunk and storage records go into columns
(dcp_columns). It also accepts torch's own save-plan records
(torch/distributed/checkpoint/planner.py): Megatron-Core keeps every rank's `SavePlan` in an extra
`all_local_plans` attribute of the `Metadata` it saves, and ckptconv ignores them. Any other global in the
pickle stops the load with a `CkptconvError` naming it. The allowlist unpickler here also serves
`torch_record.read_tensor_record`.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import PurePosixPath
from typing import Any, Protocol

from ..dtype_names import ITEMSIZE

_LAYOUTS = ("torch.strided", "torch.sparse_coo")


def _get_layout(name: str) -> str:
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return name


def _path(*parts: str) -> str:
    return str(PurePosixPath(*parts))


class Record:
    """A plain attribute bag standing in for one of DCP's metadata classes (built by NEWOBJ + BUILD).

    Loading into stand-ins rather than torch's own classes keeps `import torch.distributed.checkpoint` (most
    of a second) out of the CLI, and means nothing but attribute assignment happens while unpickling. There is
    no `__setstate__`: the C unpickler's BUILD fills `__dict__` itself (a dict, or the (dict, slots) pair; any
    other state is an UnpicklingError), about five times faster than a Python method per record, which
    matters at a million chunks.
    """

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
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
        self.__dict__.update(state)


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


_ENUM_MEMBERS: dict[Any, set[str]] = {
    _MemFormat: {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"},
    _WriteItemType: {"TENSOR", "SHARD", "BYTE_IO"},
}


def _enum_member(cls: Any, name: Any) -> Any:
    """`builtins.getattr` as enum pickles use it: only a member name of an allowed enum stand-in."""
    if cls not in _ENUM_MEMBERS or name not in _ENUM_MEMBERS[cls]:
        raise Refused(f"builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")
    return getattr(cls, name)


DCP_MD = "torch.distributed.checkpoint.metadata"
DCP_FS = "torch.distributed.checkpoint.filesystem"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
# what `.metadata` may reference (dcp_columns loads the chunk, index and storage records into columns)
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (DCP_MD, "Metadata"): Metadata,
    (DCP_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (DCP_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (DCP_MD, "TensorProperties"): TensorProperties,
    (DCP_MD, "StorageMeta"): StorageMeta,
    (DCP_MD, "_MEM_FORMAT_ENCODING"): _MemFormat,
    ("builtins", "getattr"): _enum_member,
    (_DCP_PLANNER, "SavePlan"): SavePlan,
    (_DCP_PLANNER, "WriteItem"): WriteItem,
    (_DCP_PLANNER, "WriteItemType"): _WriteItemType,
    (_DCP_PLANNER, "TensorWriteData"): TensorWriteData,
    (_DCP_PLANNER, "BytesIOWriteData"): BytesIOWriteData,
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): dict,
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

    def __init__(self, data: bytes | Readable, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data) if isinstance(data, bytes) else data)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            loaded = trusted() if self.trustable else None
            if loaded is None:
                raise Refused(f"{module}.{name}") from None
            loaded.append(f"{module}.{name}")
            return super().find_class(module, name)


class MetadataUnpickler(AllowlistUnpickler):
    trustable = True


class Refused(pickle.UnpicklingError):
    """A global outside the allowlist."""


def pickle_globals(data: bytes) -> list[str]:
    """The `module.name` globals a pickle would import, read from its opcodes without running it."""
    names: list[str] = []
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(str(arg))
            elif opcode.name == "GLOBAL":
                names.append(str(arg).replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
    except Exception:
        pass
    return names
