"""The data.pkl of a DeepSpeed checkpoint file (`*_model_states.pt`, `*_optim_states.pt`) read without running
it: an allowlist of the globals torch.save and DeepSpeed put there, DeepSpeed's own classes as stand-ins
(`ZeroStageEnum` as its int, `LossScaler`, `DynamicLossScaler` and `fragment_address` as attribute bags),
every tensor as a `TensorRecord` (nothing of its storage read), and where each storage's bytes start in the
file: the zip entry `data/KEY`, stored uncompressed, as torch.save writes it. The Adam moments in
`base_optimizer_state` are records like any other tensor: their bytes are never read.
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.core.specs import Stamp
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import open_regular, stamp
from ckptconv.formats.safe_pickle import Charged, Record, Refused, charged_dict, clip, record_state
from ckptconv.formats.torch_record import _TENSOR_GLOBALS, TensorRecord, _TensorRecordUnpickler
from ckptconv.formats.torch_zip import TorchZip
from ckptconv.job.limits import Budget

MAX_PICKLE = 256 * 2**20  # a model_states data.pkl lists every parameter's name and shape: small


class ZeroStageEnum:
    """deepspeed.runtime.zero.config.ZeroStageEnum, as the plain int of its value."""

    def __new__(cls, value: int) -> int:  # type: ignore[misc]
        if type(value) is not int:
            raise pickle.UnpicklingError("ZeroStageEnum of a non-integer")
        return value


class LossScaleProfile:
    """deepspeed.runtime.fp16.loss_scaler.LossScaleProfile (a str enum), as the plain str of its value."""

    def __new__(cls, value: str) -> str:  # type: ignore[misc]
        if type(value) is not str:
            raise pickle.UnpicklingError("LossScaleProfile of a non-string")
        return value


ENUM_MEMBERS: dict[Any, dict[str, Any]] = {  # DeepSpeed 0.19's members of the two enums its pickles hold
    ZeroStageEnum: {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3},
    LossScaleProfile: {"FUSED": "fused", "UNFUSED": "unfused"},
}


def _enum_member(cls: Any, name: Any) -> Any:
    """`getattr(EnumClass, "member")`: how some Python 3.11 releases pickle an enum member (3.11.2, CI's,
    does; 3.11.7 calls the class with the value). Only the members of the enums above: any other getattr is
    refused."""
    members = ENUM_MEMBERS.get(cls) if isinstance(cls, type) else None
    if members is None or type(name) is not str or name not in members:
        raise pickle.UnpicklingError("getattr of anything but a DeepSpeed enum's member")
    return members[name]


class LossScaler(Record):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler (or DynamicLossScaler): its attributes only."""


class FragmentAddress(Record):
    """deepspeed.utils.tensor_fragment.fragment_address: `numel`, `start`."""


class _TensorType:
    """`torch.Tensor` and `torch.nn.Parameter` as `_rebuild_from_type_v2` names them."""


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if not isinstance(new_type, _TensorType) or type(args) is not tuple:
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of a tensor subclass")
    return func(*args)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any, *_: Any) -> Any:
    return data


class _StateDict(dict[Any, Any]):
    """`collections.OrderedDict` of a module's state dict: torch's carries a `_metadata` attribute (the
    modules' versions), set by BUILD; it is dropped."""

    def __setstate__(self, state: Any) -> None:
        record_state(state)  # bounded, then left out


def _ordered_dict(budget: Budget, *args: Any) -> _StateDict:
    return _StateDict(charged_dict(budget, *args))


_TENSOR = _TensorType()
_DS = "deepspeed.runtime"
DEEPSPEED_GLOBALS: dict[tuple[str, str], Any] = {
    **_TENSOR_GLOBALS,
    ("collections", "OrderedDict"): Charged(_ordered_dict),
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _TENSOR,
    (f"{_DS}.zero.config", "ZeroStageEnum"): ZeroStageEnum,
    ("builtins", "getattr"): _enum_member,
    ("__builtin__", "getattr"): _enum_member,  # protocol 2's name of it
    (f"{_DS}.fp16.loss_scaler", "LossScaler"): LossScaler,
    (f"{_DS}.fp16.loss_scaler", "DynamicLossScaler"): LossScaler,
    (f"{_DS}.fp16.loss_scaler", "LossScaleProfile"): LossScaleProfile,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
}


@dataclass(frozen=True)
class PickledFile:
    """One torch.save file of the checkpoint: what its data.pkl holds and where each storage's bytes are."""

    rel: str
    """The file, relative to the checkpoint directory."""
    path: Path
    """The file itself (the checkpoint directory as given, joined with `rel`): what messages name."""
    value: Any
    """The unpickled object, tensors as `TensorRecord`s."""
    storages: dict[str, tuple[int, int]]
    """Storage key -> (file offset of its first byte, its length in bytes)."""
    stamp: Stamp
    """The file's identity when it was read."""

    def where(self, record: TensorRecord) -> int:
        """The file offset of `record`'s first element (a contiguous tensor), checked against its storage."""
        start, length = self.storages.get(record.storage_key, (0, -1))
        first = start + record.storage_offset * record.dtype.itemsize
        numel = 1
        for n in record.size:
            numel *= n
        if length < 0 or not record.is_contiguous or first + numel * record.dtype.itemsize > start + length:
            raise CkptconvError(
                f"{self.path}: a tensor of shape {list(record.size)} lies outside its storage "
                "(or is not contiguous); the file is corrupt, re-save or re-copy it"
            )
        return first


class _Unpickler(_TensorRecordUnpickler):
    pass


def read_pickled(root: Path, rel: str) -> PickledFile:
    """`root/rel`'s data.pkl through the allowlist, and its storages' places; a global outside the allowlist
    (an `os.system` REDUCE ...) is refused by name, never run."""
    path = root / rel
    budget = Budget(path)
    fd = open_regular(path, root)
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        try:
            archive = TorchZip(file, path, budget)
            if archive.entries.get("byteorder") is not None and archive.read("byteorder", 16) != b"little":
                raise CkptconvError(f"{path}: saved big-endian; ckptconv reads little-endian checkpoints")
            data = archive.read("data.pkl", MAX_PICKLE)
            value = _Unpickler(data, DEEPSPEED_GLOBALS, budget).load()
            storages = _storages(file, archive, st.st_size)
        except Refused as e:
            raise CkptconvError(
                f"{path}: its pickle calls {clip(str(e), 200)}, which ckptconv does not run (not a plain "
                "DeepSpeed checkpoint file); re-save it, or convert it with DeepSpeed's own zero_to_fp32.py"
            ) from None
        except CkptconvError:
            raise
        except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, EOFError, ValueError, TypeError) as e:
            raise CkptconvError(
                f"{path}: not a readable torch.save file ({type(e).__name__}: {clip(str(e), 160)}); "
                "the checkpoint is corrupt or incomplete, re-copy it"
            ) from None
    return PickledFile(rel, path, value, storages, stamp(st))


def _storages(file: Any, archive: TorchZip, size: int) -> dict[str, tuple[int, int]]:
    """Where the bytes of each `data/KEY` entry start: after its local header, which must say stored; its
    bytes must lie within the file's `size` (a storage claiming more is refused here, not when read)."""
    found = {}
    for name, info in archive.entries.items():
        if not name.startswith("data/"):
            continue
        if info.compress_type != zipfile.ZIP_STORED:
            raise zipfile.BadZipFile(f"{name} is compressed (torch.save stores tensors uncompressed)")
        file.seek(info.header_offset)
        local = file.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"{name} has a broken zip entry")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > size:
            raise zipfile.BadZipFile(f"{name} claims {info.file_size} bytes from byte {start}, past the end")
        found[name[5:]] = (start, info.file_size)
    return found
