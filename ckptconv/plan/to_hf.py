"""Pure planning: specs x key selection x dtype policy x max shard size x world size -> a save plan.

dcp-to-hf: `plan_dcp_to_hf` -> `HfSavePlan` (files, their keys in layout order, which rank writes which of
their bytes: `writes`).
hf-to-dcp: `plan_hf_to_dcp` -> `DcpSavePlan` (keys, dtypes, the rows each rank saves).

Every rank computes the same plan from the same `.metadata`, with no I/O and no collectives. That is what
makes `--dry-run` free and the output bytes independent of the number of ranks: ranks only decide who writes
which bytes, never what a file contains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from huggingface_hub import split_state_dict_into_shards_factory

from ckptconv.core.dtypes import DtypePolicy, st_layout_rank
from ckptconv.core.keyorder import natural_key
from ckptconv.core.specs import NonTensorItem, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import DcpCheckpoint
from ckptconv.formats.hf import HfCheckpoint, StoredTensor
from ckptconv.formats.stash import StashedItem
from ckptconv.lora.select import ADAPTER_FILE, LoraPlan, LoraRequest
from ckptconv.mapping.rules import KeyMapping, Part, Target, map_keys
from ckptconv.mapping.rules import whole as _whole
from ckptconv.plan.outs import OutTensor as OutTensor
from ckptconv.plan.outs import SourcePart as SourcePart
from ckptconv.plan.outs import TiedHead as TiedHead
from ckptconv.plan.outs import mapped_tensors as mapped_tensors
from ckptconv.plan.writes import Granularity, Write, plan_writes
from ckptconv.quant.policy import QuantPolicy

SAFETENSORS_PATTERN = "model{suffix}.safetensors"


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

    @property
    def total_size(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def stashed(self) -> list[str]:
        """The keys `ckptconv_state.json` will hold."""
        return [i.fqn for i in self.stash] + [s.fqn for s in self.scalars] + [i.key for i in self.common]

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    @property
    def weight_map(self) -> dict[str, str]:
        return {t.hf_key: f.name for f in self.files for t in f.tensors}

    def writes_of(self, rank: int) -> list[Write]:
        """`rank`'s writes, in file order."""
        return [w for w in self.writes if w.rank == rank]


def data_order(tensors: Sequence[OutTensor]) -> tuple[OutTensor, ...]:
    """safetensors' own layout: by its dtype order, then by key (so our streamed file equals its writer's)."""
    return tuple(sorted(tensors, key=lambda t: (st_layout_rank(t.dtype), t.hf_key)))


def assign_owners(nbytes: Sequence[int], world_size: int) -> list[int]:
    """Largest first to the least loaded rank (ties to the lower rank): balanced by bytes, deterministic."""
    loads = [0] * world_size
    owners = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += nbytes[index]
    return owners


def plan_dcp_to_hf(
    ckpt: DcpCheckpoint,
    policy: DtypePolicy,
    *,
    max_shard_size: int,
    world_size: int,
    prefix: str | None = None,
    mapping: KeyMapping | None = None,
    config: dict[str, Any] | None = None,
    allow_unmapped: bool = False,
    keep_trainer_state: bool = False,
    file_split: dict[str, int] | None = None,
    quantize: QuantPolicy | None = None,
    write_granularity: Granularity = "tensor",
    lora: LoraRequest | None = None,
) -> HfSavePlan:
    """`file_split` ({source key: file number from 1}, `--keep-file-split`) puts each tensor in the file the
    source's writer put it in, instead of splitting by `max_shard_size`. `quantize` makes the weights it
    selects block FP8, each with its `weight_scale_inv` in the same file. `write_granularity`: which rank
    writes which bytes (`writes.plan_writes`). `lora`: what to make of LoRA factors (`--lora`); an adapter is
    one `adapter_model.safetensors`, as PEFT reads it."""
    selection, mapped, unmapped = mapped_tensors(
        ckpt, policy, prefix, mapping, config, allow_unmapped, keep_trainer_state, lora
    )
    adapter = selection.lora is not None and selection.lora.mode == "adapter"
    quantization: dict[str, Any] | None = None
    quant_warnings: list[str] = []
    if quantize is not None:
        from ckptconv.plan.quantize import quantize_outs

        mapped, quantization, quant_warnings = quantize_outs(mapped, quantize, policy)
    outs = {t.hf_key: t for t in sorted(mapped, key=lambda t: natural_key(t.hf_key))}
    notes = selection.notes
    if unmapped:
        notes += (
            f"--allow-unmapped: {len(unmapped)} key(s) passed through unchanged: {', '.join(unmapped)}",
        )
    if adapter:
        if file_split is not None or quantize is not None:
            raise CkptconvError(
                "--lora adapter writes one adapter_model.safetensors, as PEFT reads it; "
                "leave out --keep-file-split and --quantize"
            )
        by_file = {ADAPTER_FILE: list(outs)}
    elif file_split is None:
        scales = {t.hf_key.removesuffix("_scale_inv"): t.nbytes for t in outs.values() if t.op == "fp8_scale"}
        by_file = split_state_dict_into_shards_factory(  # a weight and its scale: one storage, one file
            outs,
            get_storage_size=lambda t: t.nbytes + scales.get(t.hf_key, 0),
            get_storage_id=lambda t: (
                t.hf_key.removesuffix("_scale_inv") if t.quant or t.op == "fp8_scale" else None
            ),
            filename_pattern=SAFETENSORS_PATTERN,
            max_shard_size=max_shard_size,
        ).filename_to_tensors
    else:
        by_file = split_as_source(outs, file_split)
    names = list(by_file)
    groups = [data_order([outs[k] for k in by_file[name]]) for name in names]
    owners = assign_owners([sum(t.nbytes for t in g) for g in groups], world_size)
    files = tuple(OutFile(name, g, owner) for name, g, owner in zip(names, groups, owners, strict=True))
    warnings = (*policy.warnings(), *selection.warnings, *quant_warnings)
    return HfSavePlan(
        files,
        selection.stash,
        notes,
        warnings,
        world_size,
        selection.scalars,
        selection.common,
        quantization,
        plan_writes(files, world_size, write_granularity),
        selection.lora,
        selection.tied,
    )


def split_as_source(outs: dict[str, OutTensor], file_split: dict[str, int]) -> dict[str, list[str]]:
    """{file name: HF keys}: each tensor in the file its (first) source tensor was given, numbered as the
    source numbers them (`model-0000I-of-0000N.safetensors`; one file is `model.safetensors`)."""
    index: dict[str, int] = {}
    for key, t in outs.items():
        number = file_split.get(t.src.fqn)
        if number is None:
            raise CkptconvError(
                f"--keep-file-split: the source puts {t.src.fqn!r} in no file; "
                "leave the flag out to split by --max-shard-size"
            )
        index[key] = number
    used = sorted(set(index.values()))
    last = max(used)
    name = {
        i: "model.safetensors" if len(used) == 1 else f"model-{i:05d}-of-{last:05d}.safetensors" for i in used
    }
    out: dict[str, list[str]] = {name[i]: [] for i in used}
    for key, number in index.items():
        out[name[number]].append(key)
    return out


@dataclass(frozen=True)
class DcpOutTensor:
    key: str  # the DCP key, prefix included
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[tuple[StoredTensor, Part], ...]
    op: str = "rename"
    layout: tuple[int, ...] | None = None  # the shape the parts address (a reshape), when not `shape`
    padded: bool = False  # some elements come from no part: zeros

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


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows [lo, hi) `rank` holds under `Shard(0)`: torch.chunk's split, as DTensor and FSDP2 use it."""
    step = -(-rows // world_size) if rows else 0
    return min(rank * step, rows), min((rank + 1) * step, rows)


def plan_hf_to_dcp(
    hf: HfCheckpoint,
    policy: DtypePolicy,
    *,
    world_size: int,
    prefix: str | None = None,
    stash: Sequence[StashedItem] = (),
    mapping: KeyMapping | None = None,
    config: dict[str, Any] | None = None,
    allow_unmapped: bool = False,
) -> DcpSavePlan:
    if prefix is not None and (not prefix.strip(".") or ".." in prefix):
        raise CkptconvError(f"--prefix {prefix!r}: use dotted names such as 'model.'")
    if "" in hf.tensors:  # safetensors allows it (inspect shows it); no model loads it, nor dcp.load's dict
        raise CkptconvError(
            f"{hf.tensors[''].file}: holds a tensor with an empty name; re-save it with a name"
        )
    nesting = tuple(prefix.strip(".").split(".")) if prefix else ()
    lead = "".join(part + "." for part in nesting)
    shapes = {key: stored.shape for key, stored in hf.tensors.items()}
    if mapping is None:
        same: tuple[tuple[str, str], ...] = ()
        targets = [Target(k, s, (_whole(k, s),), "rename") for k, s in shapes.items()]
    else:
        mapped = map_keys(mapping, "to_runtime", shapes, config or {}, allow_unmapped=allow_unmapped)
        targets, same = mapped.targets, tuple(mapped.same)
    tensors = []
    for target in sorted(targets, key=lambda t: natural_key(t.key)):
        parts = tuple((hf.tensors[p.src], p) for p in target.parts)
        if len({stored.dtype for stored, _ in parts}) > 1:
            raise CkptconvError(f"{target.key!r} would combine tensors of different dtypes")
        key = lead + target.key
        dtype = policy.resolve(key, parts[0][0].dtype)
        tensors.append(DcpOutTensor(key, target.shape, dtype, parts, target.op, target.layout, target.padded))
    for item in stash:
        for t in tensors:
            if item.key == t.key or t.key.startswith(item.key + ".") or item.key.startswith(t.key + "."):
                raise CkptconvError(
                    f"{hf.path}: stashed item {item.key!r} collides with tensor {t.key!r}; pass --prefix"
                )
    padded = [f"{t.key}: {list(t.shape)} padded with zeros beyond the HF tensor" for t in tensors if t.padded]
    warnings = (*policy.warnings(), *padded)
    return DcpSavePlan(tuple(tensors), nesting, tuple(stash), warnings, world_size, same)
