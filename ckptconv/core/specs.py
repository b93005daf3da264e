"""Frozen descriptions of what is stored where; no tensor bytes.

Key spaces: `fqn` is a runtime / DCP key (as the training job saved it), `hf_key` is an output key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ckptconv.core.dtype_names import ITEMSIZE, torch_dtype

if TYPE_CHECKING:
    import torch

ChunkFormat = Literal["torch_save", "safetensors", "torch_entry"]  # torch_entry: C-order bytes in place


class ChunkSpec(NamedTuple):
    """One stored block of a tensor: `sizes` elements starting at `offsets` in global coordinates.

    A named tuple rather than a frozen dataclass: a 1 TB checkpoint has a million of them, and a tuple is
    made five times faster (and `_replace` stands for `dataclasses.replace`)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # path relative to the checkpoint directory
    byte_offset: int  # where the item starts in `file`
    byte_length: int  # how many bytes the item occupies there
    fmt: ChunkFormat

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))


# ChunkSpec(*values) from one tuple of values, without ChunkSpec._make's Python frame (a million at 1 TB)
new_chunk = partial(tuple.__new__, ChunkSpec)


@dataclass(frozen=True)
class TensorSpec:
    """A whole (global) tensor of a checkpoint and the chunks that store it.

    The dtype is kept by name (`float32`), so describing a checkpoint never needs torch; `dtype` is the torch
    dtype, for code that makes tensors.
    """

    fqn: str
    dtype_name: str
    shape: tuple[int, ...]
    chunks: Sequence[ChunkSpec] = ()
    """A tuple, or on a rank that received the checkpoint (`source.share`) records made when first read."""

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype_name]


@dataclass(frozen=True)
class NonTensorItem:
    """A non-tensor value (`step`, `args.lr`, ...) stored as torch.save bytes; `path` is its nesting."""

    fqn: str
    path: tuple[str | int, ...]
    file: str
    byte_offset: int
    byte_length: int


Stamp = tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns) of a file when it was first read


@dataclass(frozen=True)
class Common:
    """Megatron's common state: `values[key]` is the readable part of each top-level entry (None when
    nothing of it is readable); `unreadable[key]` lists `key.path (what)` for each part of it left out."""

    values: dict[str, Any]
    unreadable: dict[str, tuple[str, ...]]
    raw: bytes
    source: str = "common.pt"
    """What it was read from, as messages name it (relative to the checkpoint): a file, or a DCP item."""
    raw_key: str = "common.pt"
    """The stash key its `raw` bytes are kept under when some part of it is left out."""
    items: tuple[str, ...] = ()
    """The DCP bytes items it was read from: stashed through it, never again on their own."""


@dataclass(frozen=True)
class MegatronInfo:
    """What a Megatron checkpoint says of itself (its `args`, `iteration`, `checkpoint_version`)."""

    format: str
    """"torch_dist" (Megatron-Core dist_checkpointing) or "fsdp_dtensor" (Megatron-FSDP)."""
    iteration: int | None
    """The training step it was saved at; None when it does not say."""
    checkpoint_version: float | None
    """Megatron-LM's checkpoint format version; None when it does not say."""
    tensor_model_parallel_size: int | None
    """The TP size of the job that saved it (`args.tensor_model_parallel_size`); None when unknown."""
    pipeline_model_parallel_size: int | None
    """The PP size of the job that saved it; None when unknown."""
    virtual_pipeline_chunks: int | None
    """The number of virtual pipeline model chunks (`model0.`, `model1.` ... in fsdp_dtensor); None: none."""
    args: dict[str, Any] | None
    """The saved `args` as JSON-safe values (classes and enums left out); None without args."""


@dataclass(frozen=True)
class DcpCheckpoint:
    """Everything `.metadata` says, validated; tensors and items keep the order the job saved them in."""

    path: Path
    tensors: dict[str, TensorSpec]
    items: dict[str, NonTensorItem]
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)  # fqn -> nesting in the saved dict
    stamps: dict[str, Stamp] = field(default_factory=dict)  # file -> identity when .metadata was read
    kind: str = "dcp"  # "megatron": Megatron-Core torch_dist; "fsdp_dtensor": Megatron-FSDP (model.module.)
    common: Common | None = None  # Megatron's common state (common.pt or DCP items), read without running it
    file_split: dict[str, int] | None = None  # key -> output file number, from torch's distributed HF writer
    transforms: tuple[str, ...] = ()
    """The stream transforms every record is stored through (torch's `_extensions` descriptors, outermost
    first: `("stream.zstd/1",)` for ZStandard, read by formats/dcp_transforms); () for none."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True)
class Quantized:
    """How a logical tensor is stored. `scheme` names the format (`quant.schemes.READ`); `parts` are the
    stored tensors, the quantized values first, then their scales (and zero points, global scales, ... as
    the scheme defines); `block` is the scheme's block ("fp8": rows and columns per scale; "mxfp4": values
    per scale); `args` are the scheme's other settings as (name, value) pairs (hashable), read with `arg`."""

    scheme: str
    parts: tuple[StoredTensor, ...]
    block: int
    args: tuple[tuple[str, Any], ...] = ()

    @property
    def scale(self) -> StoredTensor:
        return self.parts[1]

    @property
    def nbytes(self) -> int:
        """The bytes stored: the quantized values and their scales."""
        return sum(p.nbytes for p in self.parts)

    def arg(self, name: str, default: Any = None) -> Any:
        """The setting `name` of `args` (`default` when the scheme did not set it)."""
        return next((v for k, v in self.args if k == name), default)

    @property
    def stored(self) -> str:
        """What the values are stored as, for reports: arg "stored" (`int4`, `nvfp4`, ...), else the first
        part's dtype (`float8_e4m3fn`); "mxfp4" for gpt-oss's blocks."""
        return str(self.arg("stored", "mxfp4" if self.scheme == "mxfp4" else self.parts[0].dtype_name))

    @property
    def block_size(self) -> list[int] | int:
        """The block for reports: arg "block_size" ([rows, cols] or values per scale), else "fp8"'s square
        block or `block`."""
        size = self.arg("block_size")
        if size is not None:
            return list(size) if isinstance(size, tuple) else int(size)
        return [self.block, self.block] if self.scheme == "fp8" else self.block


@dataclass(frozen=True)
class StoredTensor:
    key: str
    dtype_name: str  # torch's name (`bfloat16`), as `specs.TensorSpec` keeps it
    shape: tuple[int, ...]
    file: Path
    data_offset: int  # absolute offset of the first byte in `file`
    nbytes: int
    stamp: Stamp | None = None  # the file's identity when its header was read: a reader refuses another
    quant: Quantized | None = None  # a dequantized weight: its stored parts (then file.. is its first part's)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)


@dataclass(frozen=True)
class HfCheckpoint:
    path: Path  # the directory, or the single .safetensors file
    tensors: dict[str, StoredTensor]  # in file order, then header order; a quantized weight as one (hf_quant)
    files: tuple[Path, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True)
class StashedItem:
    key: str
    path: tuple[str | int, ...]
    raw: bytes  # torch.save bytes as stored in the DCP checkpoint (kept in the file when value is not JSON)
    value: Any = None
    has_value: bool = False  # `value` holds the item exactly as JSON
    note: str | None = None  # why the value was not loaded
    tensor: str | None = None  # the dtype name when the item was a 0-d tensor (`value` is its number)
    readable: Any = None  # of an item kept as bytes: what JSON holds of it, read without running it
