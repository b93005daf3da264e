"""A per-rank `torch.save` of a state dict of DTensors (verl's and accelerate's FSDP2 files) read without
running it: its `data.pkl` loaded through safe_pickle's allowlist into stand-ins, each tensor a `Local`.

What torch 2.13 pickles for a DTensor (`Tensor.__reduce_ex__`): `torch._tensor._rebuild_from_type_v2` of
`torch._utils._rebuild_wrapper_subclass` (the DTensor class, dtype, global size, stride, ...) with the
DTensor's slots as state: `_local_tensor` (a plain tensor record: `_rebuild_tensor_v2` of a storage) and
`_spec`, a `DTensorSpec` whose `mesh` is a `DeviceMesh` (its `__getstate__` is its `__dict__`: the saving
rank's `_rank` and `_coordinate_on_dim`, and the mesh shape as a `_MeshLayout` of `_FlatLayout`s; torch
before 2.9 kept it as a `mesh` tensor of ranks), `placements` (`Shard`, `_StridedShard`, `Replicate`,
`Partial`) and `tensor_meta` (`TensorMeta(shape, stride, dtype)`). Every one of those classes is a `Record`
stand-in here: nothing but attribute assignment happens while the pickle loads; any other global (an
`os.system` REDUCE) is refused by name before it could run.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

from ckptconv.formats.safe_pickle import SIZE, Charged, Record, charged_dict
from ckptconv.formats.torch_record import (
    _TENSOR_GLOBALS,
    TensorRecord,
    _TensorRecordUnpickler,
)
from ckptconv.job.limits import Budget


class DTensorSpec(Record):
    """torch.distributed.tensor._dtensor_spec.DTensorSpec: `mesh`, `placements`, `tensor_meta`, ..."""


class DeviceMesh(Record):
    """torch.distributed.device_mesh.DeviceMesh's pickled `__dict__`."""


class MeshLayout(Record):
    """torch.distributed._mesh_layout._MeshLayout (`axes`: one `FlatLayout` per mesh dim)."""


class FlatLayout(Record):
    """torch.distributed._mesh_layout._FlatLayout (`shape`, `stride`: a mesh dim's sizes, () for 1)."""


class Shard(Record):
    """A placement sharding tensor dim `dim` over a mesh dim."""

    dim: Any = None


class StridedShard(Record):
    """`_StridedShard(dim, split_factor)`: FSDP2 over a dim TP sharded first (right-to-left sharding)."""

    dim: Any = None
    split_factor: Any = None


class Replicate(Record):
    """A placement replicating the tensor over a mesh dim."""


class Partial(Record):
    """A placement holding partial sums over a mesh dim (refused: no single rank holds the values)."""


class TensorMeta:
    """`TensorMeta(shape, stride, dtype)`, a NamedTuple, built by NEWOBJ with its fields as arguments."""

    shape: Any
    stride: Any
    dtype: Any

    def __new__(cls, shape: Any = None, stride: Any = None, dtype: Any = None, *_: Any) -> TensorMeta:
        meta = super().__new__(cls)
        meta.shape, meta.stride, meta.dtype = shape, stride, dtype
        return meta


class ShardOrderEntry(tuple[Any, Any]):
    """`ShardOrderEntry(tensor_dim, mesh_dims)`: the mesh dims sharding a tensor dim, in the order applied."""

    def __new__(cls, tensor_dim: Any = None, mesh_dims: Any = None, *_: Any) -> ShardOrderEntry:
        return super().__new__(cls, (tensor_dim, mesh_dims))


class _DTensorType:
    """The DTensor class as `_rebuild_wrapper_subclass` and `_rebuild_from_type_v2` are handed it."""


@dataclass(frozen=True)
class Wrapper:
    """What `_rebuild_wrapper_subclass(cls, dtype, size, stride, ...)` gives: the DTensor's global size."""

    cls: Any
    dtype: Any
    size: Any


@dataclass(frozen=True)
class Local:
    """One tensor of a rank file: its bytes (`record`), and for a DTensor its global shape and spec."""

    record: TensorRecord
    global_shape: tuple[int, ...] | None = None
    """None: a plain tensor (the same on every rank)."""
    spec: Any = None
    """The `DTensorSpec` stand-in."""


class StateDict(dict[Any, Any]):
    """`collections.OrderedDict` of a `state_dict()`, whose BUILD state (`_metadata`: each module's version)
    is dropped: nothing downstream needs it."""

    def __setstate__(self, state: Any) -> None:
        pass


def _state_dict(budget: Budget, *args: Any) -> StateDict:
    return StateDict(charged_dict(budget, *args))


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, *_: Any) -> Wrapper:
    return Wrapper(cls, dtype, size)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A DTensor from its wrapper and slots; a plain tensor (a subclass-free `_rebuild_tensor_v2`) as is."""
    built = func(*args) if callable(func) else func
    if new_type is not _DTensorType:
        if isinstance(built, TensorRecord):
            return Local(built)
        raise pickle.UnpicklingError(f"a tensor of type {type(new_type).__name__}")
    if not isinstance(built, Wrapper) or built.cls is not _DTensorType:
        raise pickle.UnpicklingError("a DTensor not built by _rebuild_wrapper_subclass")
    fields: dict[str, Any] = {}
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict):
            fields.update(part)
    local, spec = fields.get("_local_tensor"), fields.get("_spec")
    if isinstance(local, Local):
        local = local.record
    if not isinstance(local, TensorRecord) or not isinstance(spec, DTensorSpec):
        raise pickle.UnpicklingError("a DTensor without its local tensor or spec")
    if local.dtype != built.dtype:
        raise pickle.UnpicklingError(f"a DTensor of {built.dtype} whose local tensor is {local.dtype}")
    return Local(local, tuple(int(n) for n in built.size), spec)


def _rebuild_parameter(data: Any, requires_grad: Any = None, hooks: Any = None, *_: Any) -> Any:
    return data


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


_DT = "torch.distributed.tensor"
_PLACEMENTS = f"{_DT}.placement_types"
RANK_FILE_GLOBALS: dict[tuple[str, str], Any] = {
    **_TENSOR_GLOBALS,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    (_DT, "DTensor"): _DTensorType,
    (f"{_DT}._api", "DTensor"): _DTensorType,
    (f"{_DT}._dtensor_spec", "DTensorSpec"): DTensorSpec,
    (f"{_DT}._dtensor_spec", "TensorMeta"): TensorMeta,
    (f"{_DT}._dtensor_spec", "ShardOrderEntry"): ShardOrderEntry,
    ("torch.distributed.device_mesh", "DeviceMesh"): DeviceMesh,
    ("torch.distributed._mesh_layout", "_MeshLayout"): MeshLayout,
    ("torch.distributed._mesh_layout", "_FlatLayout"): FlatLayout,
    (_PLACEMENTS, "Shard"): Shard,
    (_PLACEMENTS, "_StridedShard"): StridedShard,
    (_PLACEMENTS, "Replicate"): Replicate,
    (_PLACEMENTS, "Partial"): Partial,
    ("torch.serialization", "_get_layout"): lambda name: str(name),
    ("torch", "device"): _device,
    ("torch", "Size"): SIZE,
    ("collections", "OrderedDict"): Charged(_state_dict),
}


class _RankFileUnpickler(_TensorRecordUnpickler):
    pass


def load_rank_state(data_pkl: Any, budget: Budget) -> Any:
    """The pickled state dict of a rank file (`data_pkl`: bytes or a bounded reader), tensors as `Local`s;
    a global outside the allowlist raises `safe_pickle.Refused` before anything of it runs."""
    return _RankFileUnpickler(data_pkl, RANK_FILE_GLOBALS, budget).load()


MAX_LAYOUT_NODES = 64  # ints and tuples of one mesh dim's nested layout shape (torch's nest a level or two)


def _ints(value: Any) -> list[int] | None:
    """The ints of a (nested) layout shape: a mesh dim's size is their product (1 for `()`); None for
    anything but sizes nested in tuples. Walked with a list, not recursion, over at most
    `MAX_LAYOUT_NODES` nodes: a pickle builds nesting thousands deep, and memo references a tuple of
    2^64 leaves, without any recursion of its own."""
    out: list[int] = []
    todo = [value]
    seen = 0
    while todo:
        item = todo.pop()
        seen += 1
        if seen > MAX_LAYOUT_NODES:
            return None
        if type(item) is int and 0 <= item < 2**63:
            out.append(item)
        elif type(item) is tuple:
            todo.extend(item)
        else:
            return None
    return out


def mesh_shape(mesh: Any) -> tuple[int, ...] | None:
    """The mesh's shape: from its `_layout` (torch 2.9 and later) or its `mesh` tensor of ranks; None when
    neither is there, or its layout is not sizes."""
    layout = getattr(mesh, "_layout", None)
    axes = getattr(layout, "axes", None) if layout is not None else None
    if isinstance(axes, tuple) and all(isinstance(a, FlatLayout) for a in axes):
        sizes = [_ints(getattr(a, "shape", ())) for a in axes]
        return None if None in sizes else tuple(math.prod(n) for n in sizes if n is not None)
    ranks = getattr(mesh, "mesh", None)
    if isinstance(ranks, Local):
        return ranks.record.size
    if isinstance(ranks, TensorRecord):
        return ranks.size
    return None
