"""Unpickling without running code from the checkpoint.

`load_dcp_metadata` accepts only the classes DCP's `.metadata` is made of (see
torch/distributed/checkpoint/metadata.py); `read_tensor_record` reads the `data.pkl` of a torch.save zip into
a plain description of the tensor (dtype, storage key, offset, size, stride) without building anything.
Any other global in the pickle stops the load with a `CkptconvError` naming it.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch

from ..errors import CkptconvError

_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}


def _get_layout(name: str) -> torch.layout:
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: str) -> str:
    return str(PurePosixPath(*parts))


def _dtype_globals() -> dict[tuple[str, str], Any]:
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class Record:
    """A plain attribute bag standing in for one of DCP's metadata classes (built by NEWOBJ + BUILD).

    Loading into stand-ins rather than torch's own classes keeps `import torch.distributed.checkpoint` (most
    of a second) out of the CLI, and means nothing but attribute assignment happens while unpickling.
    """

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
        self.__dict__.update(state)

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


class ChunkStorageMetadata(Record):
    offsets: Any
    sizes: Any


class MetadataIndex(Record):
    fqn: str
    offset: Any = None
    index: Any = None


class StorageInfo(Record):
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


class StorageMeta(Record):
    pass


class TensorProperties(Record):
    dtype: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:  # TensorProperties.__getstate__'s tuple
            self.dtype = state[0]
            return
        super().__setstate__(state)


class _MemFormat:
    """DCP's `_MEM_FORMAT_ENCODING` enum, as the plain int of its value. Pickled as `_MEM_FORMAT_ENCODING(0)`,
    or by some Python 3.11 releases (3.11.2 among them) as `getattr(_MEM_FORMAT_ENCODING, "TORCH_...")`."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2

    def __new__(cls, value: int) -> int:  # type: ignore[misc]
        return int(value)


_ENUM_MEMBERS = {_MemFormat: {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"}}


def _enum_member(cls: Any, name: Any) -> Any:
    """`builtins.getattr` as enum pickles use it: only a member name of an allowed enum stand-in."""
    if cls not in _ENUM_MEMBERS or name not in _ENUM_MEMBERS[cls]:
        raise _Refused(f"builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")
    return getattr(cls, name)


_DCP_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_MD, "Metadata"): Metadata,
    (_DCP_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP_MD, "TensorProperties"): TensorProperties,
    (_DCP_MD, "MetadataIndex"): MetadataIndex,
    (_DCP_MD, "StorageMeta"): StorageMeta,
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): _MemFormat,
    ("builtins", "getattr"): _enum_member,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): dict,
    **_dtype_globals(),
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


class _AllowlistUnpickler(pickle.Unpickler):
    trustable = False  # under `trusting()`, load globals outside the allowlist instead of refusing them

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            loaded = trusted() if self.trustable else None
            if loaded is None:
                raise _Refused(f"{module}.{name}") from None
            loaded.append(f"{module}.{name}")
            return super().find_class(module, name)


class _MetadataUnpickler(_AllowlistUnpickler):
    trustable = True


class _Refused(pickle.UnpicklingError):
    pass


def load_dcp_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle DCP `.metadata` bytes, allowing only the DCP metadata classes."""
    try:
        metadata = _MetadataUnpickler(data, _METADATA_GLOBALS).load()
    except _Refused as e:
        raise CkptconvError(
            f"{where}: refusing to load: the metadata references {e}, which is not part of DCP metadata "
            "(a pickle payload or a non-standard planner); ckptconv never runs code from a checkpoint "
            "(--trust-pickle loads it anyway, for checkpoints you trust)"
        ) from None
    except Exception as e:
        raise CkptconvError(
            f"{where}: not a readable DCP metadata file ({type(e).__name__}: {e}); "
            "the checkpoint is truncated or corrupt, re-save or re-copy it"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CkptconvError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


@dataclass(frozen=True)
class TensorRecord:
    """What a torch.save'd tensor's data.pkl says, without building the tensor."""

    dtype: torch.dtype
    storage_key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.size), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _storage_globals() -> dict[tuple[str, str], Any]:
    # the legacy typed-storage names torch.save writes into data.pkl, e.g. ("torch", "BFloat16Storage")
    names = torch.storage._dtype_to_storage_type_map()
    return {("torch", name): _StorageType(dtype) for dtype, name in names.items()}


def _rebuild_tensor_v2(storage: Any, storage_offset: int, size: Any, stride: Any, *_: Any) -> TensorRecord:
    dtype, key, numel = storage
    return TensorRecord(dtype, key, numel, int(storage_offset), tuple(size), tuple(stride))


_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("collections", "OrderedDict"): dict,
    ("torch", "Size"): torch.Size,
    **_storage_globals(),
}


class _TensorRecordUnpickler(_AllowlistUnpickler):
    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError("unexpected storage type")
        return (storage_type.dtype, str(key), int(numel))


def read_tensor_record(data_pkl: bytes) -> TensorRecord | None:
    """The tensor a torch.save data.pkl describes, or None when it is anything but one plain tensor."""
    try:
        record = _TensorRecordUnpickler(data_pkl, _TENSOR_GLOBALS).load()
    except Exception:
        return None
    return record if isinstance(record, TensorRecord) else None


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
