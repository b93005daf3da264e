"""The plan's vocabulary, apart from the code that builds it (as DCP keeps `SavePlan` in `planner.py`):
what each output tensor is made of, which file it goes to, and which rank writes which bytes. Pure data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ckptconv.core.layout import shard_rows
from ckptconv.core.specs import (
    NonTensorItem,
    StashedItem,
    StoredTensor,
    TensorSpec,
)
from ckptconv.mapping.rules import Part
from ckptconv.plan.base import Adopted

if TYPE_CHECKING:  # annotations only: a plan is made before torch is imported (source/early.py)
    import torch

    from ckptconv.lora.merge import LoraParts
    from ckptconv.lora.select import LoraPlan


@dataclass(frozen=True)
class SourcePart:
    """A block of a stored tensor that lands in a block of an output tensor (see mapping.rules.Part)."""

    spec: TensorSpec
    part: Part
    lora: LoraParts | None = None  # --lora merge through a mapping: the source block gets its LoRA update

    @property
    def whole(self) -> bool:
        """The whole stored tensor, unpermuted, lands at the origin of the output (alone, if shapes match)."""
        p = self.part
        return p.plain and p.src_sizes == self.spec.shape == p.dst_sizes and not any(p.dst_offsets)

    @property
    def nbytes(self) -> int:
        return math.prod(self.part.src_sizes) * self.spec.dtype.itemsize


@dataclass(frozen=True)
class OutTensor:
    hf_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[SourcePart, ...]
    op: str = "rename"
    layout: tuple[int, ...] | None = None  # the shape the parts address (a reshape), when not `shape`
    padded: bool = False  # some elements come from no part: zeros
    quant: str | None = None  # a --quantize scheme: assembled in the source dtype, written with its scales
    quant_dtype: torch.dtype | None = None  # fp8-block, nvfp4: the dtype it is cast to, then quantized
    scale_of: str | None = None  # a scale (op SCALE_OP): the key of the quantized weight written with it
    stored_shape: tuple[int, ...] | None = None  # the shape the file holds, when not `shape` (packed nvfp4)
    lora: LoraParts | None = None  # --lora merge: W + scaling * B @ A, assembled in fp32, cast once
    offset: float | None = None  # added to every value placed (a rule's `offset`), in fp32 / fp64

    @property
    def work_dtype(self) -> torch.dtype:
        """The dtype the tensor is assembled in: its own; for a quantized one its source's (fp32 when LoRA is
        merged into it, which is then quantized from the merged values); fp32 to merge LoRA into it whole."""
        import torch

        merged = self.lora is not None or any(sp.lora is not None for sp in self.parts)
        if self.quant:
            return torch.float32 if merged else self.src.dtype
        return torch.float32 if self.lora is not None else self.dtype

    @property
    def src(self) -> TensorSpec:
        """The (first) stored tensor this one comes from."""
        return self.parts[0].spec

    @property
    def src_nbytes(self) -> int:
        """Bytes read from the checkpoint to make this tensor (its LoRA factors too)."""
        extra = sum(s.nbytes for s in self.lora.specs) if self.lora is not None else 0
        return sum(p.nbytes for p in self.parts) + extra

    @property
    def file_shape(self) -> tuple[int, ...]:
        """The shape of the tensor in its file: `shape`, or a packed weight's `stored_shape`."""
        return self.stored_shape if self.stored_shape is not None else self.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.file_shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TiedHead:
    """An output head `tie_word_embeddings` leaves out of the release (`mapping.rules`): as its rule would
    write it untied (None when the rule cannot map it), and the HF key it is tied to. Dropping it loses
    nothing only when it holds what that key holds (`tied.differing`)."""

    head: OutTensor | None
    source: str  # its key in the checkpoint (as selected)
    embedding: str  # the HF key it is tied to


@dataclass(frozen=True)
class OutFile:
    name: str
    tensors: tuple[OutTensor, ...]  # in the order safetensors lays out data (see data_order)
    owner: int  # the rank that writes this file whole under --write-granularity file

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class HfSavePlan:
    files: tuple[OutFile, ...]
    stash: tuple[NonTensorItem, ...]
    notes: tuple[str, ...]
    warnings: tuple[str, ...]
    world_size: int
    scalars: tuple[TensorSpec, ...] = ()  # 0-d progress tensors (`train_state.step`), stashed as values
    common: tuple[StashedItem, ...] = ()  # Megatron's common.pt values
    quantization: dict[str, Any] | None = None  # --quantize: the release's config.json quantization_config
    writes: tuple[Write, ...] = ()  # every byte range of the files' data and the rank that writes it
    lora: LoraPlan | None = None  # what --lora made of the checkpoint's LoRA factors
    tied: tuple[TiedHead, ...] = ()  # heads tie_word_embeddings leaves out, checked before writing (`tied`)
    adopted: Adopted | None = None  # what was taken from a reference model (`follow`); None: no reference
    indexed: bool = False  # an index even for one file (named as the reference's index names it)

    @property
    def total_size(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def stashed(self) -> list[str]:
        """The keys `ckptconv_state.json` will hold."""
        return [i.fqn for i in self.stash] + [s.fqn for s in self.scalars] + [i.key for i in self.common]

    @property
    def sharded(self) -> bool:
        """Whether an index names the files (more than one, or one the reference's index names)."""
        return len(self.files) > 1 or (self.indexed and bool(self.files))

    @property
    def weight_map(self) -> dict[str, str]:
        return {t.hf_key: f.name for f in self.files for t in f.tensors}

    def writes_of(self, rank: int) -> list[Write]:
        """`rank`'s writes, in file order."""
        return [w for w in self.writes if w.rank == rank]


@dataclass(frozen=True)
class DcpOutTensor:
    key: str  # the DCP key, prefix included
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[tuple[StoredTensor, Part], ...]
    op: str = "rename"
    layout: tuple[int, ...] | None = None  # the shape the parts address (a reshape), when not `shape`
    padded: bool = False  # some elements come from no part: zeros
    offset: float | None = None  # added to every value placed (a rule's `offset`, negated), in fp32 / fp64

    @property
    def src(self) -> StoredTensor:
        """The (first) HF tensor this one comes from."""
        return self.parts[0][0]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class DcpSavePlan:
    """hf-to-dcp: every tensor is saved as `Shard(0)` rows over all ranks (0-d tensors replicated)."""

    tensors: tuple[DcpOutTensor, ...]
    nesting: tuple[str, ...]  # the prefix as nested groups: "model." -> ("model",)
    stash: tuple[StashedItem, ...]
    warnings: tuple[str, ...]
    world_size: int
    same: tuple[tuple[str, str], ...] = ()  # (copy, primary) HF tensors that must hold equal values

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def rows_of(self, t: DcpOutTensor, rank: int) -> tuple[int, int]:
        return shard_rows(t.shape[0], self.world_size, rank) if t.shape else (0, 1)

    def nbytes_of(self, rank: int) -> int:
        """The bytes `rank` saves (0-d tensors count on every rank)."""
        total = 0
        for t in self.tensors:
            lo, hi = self.rows_of(t, rank)
            total += t.nbytes if not t.shape else (hi - lo) * (t.nbytes // t.shape[0] if t.shape[0] else 0)
        return total


Granularity = Literal["tensor", "file", "parts"]


def rows_of(t: OutTensor) -> int:
    """The rows of `t` a write splits: its laid-out dim 0 (a 0-d tensor is one row)."""
    shape = t.layout or t.shape
    return shape[0] if shape else 1


@dataclass(frozen=True)
class Write:
    """Rows [lo, hi) of `tensor` (its laid-out dim 0), written by `rank` into `file` (`lo`, `hi` = 0,
    rows_of(tensor): the whole tensor, and with a quantized weight its scale too). The first write of each
    file also writes the file's header (`header`)."""

    file: OutFile
    tensor: OutTensor
    lo: int
    hi: int
    rank: int
    header: bool = False

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == rows_of(self.tensor)

    @property
    def window(self) -> tuple[int, int] | None:
        """The rows this write covers, or None for the whole tensor."""
        return None if self.whole else (self.lo, self.hi)

    @property
    def row_bytes(self) -> int:
        return self.tensor.nbytes // rows_of(self.tensor) if rows_of(self.tensor) else 0

    @property
    def start(self) -> int:
        """Byte offset of this write within its tensor's data."""
        return self.lo * self.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor written (the scale of a quantized weight not included)."""
        return self.tensor.nbytes if self.whole else (self.hi - self.lo) * self.row_bytes

    @property
    def src_nbytes(self) -> int:
        """Bytes of the checkpoint this write reads (in proportion, for a slab)."""
        rows = rows_of(self.tensor)
        return (
            self.tensor.src_nbytes if self.whole else -(-self.tensor.src_nbytes * (self.hi - self.lo) // rows)
        )


class RankBytes(NamedTuple):
    """What one rank read from the source and wrote to the output (the `ranks` of the --json report)."""

    rank: int
    bytes_read: int
    bytes_written: int
    bytes_fetched: int = 0  # from object storage: bytes_read, plus the gaps coalesced requests read across
    requests: int = 0  # ranged reads sent to object storage

    def to_json(self) -> dict[str, int]:
        doc = self._asdict()
        if not self.requests:  # a file system: nothing fetched
            del doc["bytes_fetched"], doc["requests"]
        return doc


SCALE_OP = "fp8_scale"  # the op of a quantized weight's scale tensors, every scheme's (plan/quantize.py)


def is_scale(t: OutTensor) -> bool:
    """Whether `t` is a quantized weight's scale (`weight_scale_inv`, ...), written with its weight (no tensor
    of its own in a reference's terms). Torch-free, for inspect."""
    return t.op == SCALE_OP
