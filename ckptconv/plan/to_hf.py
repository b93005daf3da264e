"""Pure planning: specs x key selection x dtype policy x max shard size x world size -> a save plan.

dcp-to-hf: `plan_dcp_to_hf` -> `HfSavePlan` (files, their keys in layout order, which rank writes which of
their bytes: `writes`).
hf-to-dcp: `plan_hf_to_dcp` -> `DcpSavePlan` (keys, dtypes, the rows each rank saves).

Every rank computes the same plan from the same `.metadata`, with no I/O and no collectives. That is what
makes `--dry-run` free and the output bytes independent of the number of ranks: ranks only decide who writes
which bytes, never what a file contains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from huggingface_hub import split_state_dict_into_shards_factory

from ckptconv.core.dtypes import DtypePolicy, st_layout_rank
from ckptconv.core.keyorder import natural_key
from ckptconv.core.specs import (
    DcpCheckpoint,
    HfCheckpoint,
    StashedItem,
)
from ckptconv.errors import CkptconvError
from ckptconv.lora.select import ADAPTER_FILE, LoraRequest
from ckptconv.mapping.rules import KeyMapping, Target, map_keys
from ckptconv.mapping.rules import whole as _whole
from ckptconv.plan.base import Adopted, Base
from ckptconv.plan.follow import follow_copies, in_reference_order, kept_dtypes, split_as_reference
from ckptconv.plan.outs import mapped_tensors
from ckptconv.plan.shift import check_shift
from ckptconv.plan.types import (
    DcpOutTensor,
    DcpSavePlan,
    Granularity,
    HfSavePlan,
    OutFile,
    OutTensor,
)
from ckptconv.plan.writes import plan_writes
from ckptconv.quant.policy import QuantPolicy

SAFETENSORS_PATTERN = "model{suffix}.safetensors"


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
    base: Base | None = None,
    split_as_base: bool = False,
    experts: str | None = None,
) -> HfSavePlan:
    """`base`: a reference model the output follows (`follow`): its copies written or left out as it holds
    them, its dtypes where `policy` follows it, and with `split_as_base` its files; `experts`: the HF expert
    form `mapping` was given because the reference writes it (`follow.follow_experts`), recorded as adopted.

    `file_split` ({source key: file number from 1}, `--keep-file-split`) puts each tensor in the file the
    source's writer put it in, instead of splitting by `max_shard_size`. `quantize` makes the weights it
    selects block FP8, each with its `weight_scale_inv` in the same file. `write_granularity`: which rank
    writes which bytes (`writes.plan_writes`). `lora`: what to make of LoRA factors (`--lora`); an adapter is
    one `adapter_model.safetensors`, as PEFT reads it."""
    reference = None if base is None else base.tensors.keys()
    selection, mapped, unmapped = mapped_tensors(
        ckpt, policy, prefix, mapping, config, allow_unmapped, keep_trainer_state, lora, reference
    )
    adapter = selection.lora is not None and selection.lora.mode == "adapter"
    adopted = None
    if base is not None and not adapter:
        adopted = Adopted(experts=experts, file_split=split_as_base)
        mapped, heads = follow_copies(mapped, selection.tied, base, adopted)
        selection = dataclasses.replace(selection, tied=heads)
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
    elif split_as_base:
        if base is None or adopted is None:
            raise CkptconvError("--file-split reference: needs --reference BASE, or --file-split size")
        by_file = split_as_reference(outs, base)
    elif file_split is None:
        group: dict[str, int] = {}  # a quantized weight's key: its bytes and its scales'
        for t in outs.values():
            if t.quant or t.scale_of:
                key = t.scale_of or t.hf_key
                group[key] = group.get(key, 0) + t.nbytes
        by_file = split_state_dict_into_shards_factory(  # a weight and its scales: one storage, one file
            outs,
            get_storage_size=lambda t: group.get(t.scale_of or t.hf_key, t.nbytes),
            get_storage_id=lambda t: t.scale_of or (t.hf_key if t.quant else None),
            filename_pattern=SAFETENSORS_PATTERN,
            max_shard_size=max_shard_size,
        ).filename_to_tensors
    else:
        by_file = split_as_source(outs, file_split)
    names = list(by_file)
    if split_as_base and base is not None:
        groups = [in_reference_order([outs[k] for k in by_file[name]], base) for name in names]
    else:
        groups = [data_order([outs[k] for k in by_file[name]]) for name in names]
    if adopted is not None:
        kept_dtypes([t for g in groups for t in g], policy.followed, adopted)
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
        adopted,
        indexed=split_as_base and base is not None and base.indexed,
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
        quantized = next((s.quant.scheme for s, _ in parts if s.quant is not None), None)
        check_shift(target, [parts[0][0].dtype, dtype], quantized and f"a {quantized} HF weight")
        shape, op, offset = target.shape, target.op, target.offset
        tensors.append(DcpOutTensor(key, shape, dtype, parts, op, target.layout, target.padded, offset))
    for item in stash:
        for t in tensors:
            if item.key == t.key or t.key.startswith(item.key + ".") or item.key.startswith(t.key + "."):
                raise CkptconvError(
                    f"{hf.path}: stashed item {item.key!r} collides with tensor {t.key!r}; pass --prefix"
                )
    padded = [f"{t.key}: {list(t.shape)} padded with zeros beyond the HF tensor" for t in tensors if t.padded]
    warnings = (*policy.warnings(), *padded)
    return DcpSavePlan(tuple(tensors), nesting, tuple(stash), warnings, world_size, same)
