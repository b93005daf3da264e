"""Frozen descriptions of what is stored where; no tensor bytes.

Key spaces: `fqn` is a runtime / DCP key (as the training job saved it), `hf_key` is an output key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal, NamedTuple

from ckptconv.core.dtype_names import ITEMSIZE, torch_dtype

if TYPE_CHECKING:
    import torch

ChunkFormat = Literal["torch_save", "safetensors"]


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
    chunks: tuple[ChunkSpec, ...] = ()

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
