"""save_hf / load_hf: HF safetensors straight from / into a live, sharded state dict inside a training job.

A live state dict is planned exactly like a DCP checkpoint: every rank describes its local block of every
tensor and the shard steps that undo its placements (`LoadSpec.from_tensor`), the descriptions are exchanged,
and the same planner as dcp-to-hf lays out the files, so `save_hf` writes the bytes `dcp-to-hf` writes for the
same weights, whatever the world size. The data then moves by the unshard scheduler (`schedule`,
`allgather`): rounds of foreach all-gathers, one per (process group, dtype), each round bounded by
`bucket_size` of gathered (global) bytes, stacked MoE tensors gathered bucket by bucket; the rank writing a
file keeps what it needs. `load_hf` reads, on each rank, only the rows of its own block from the files.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch

from ckptconv.core.dtype_names import short_name
from ckptconv.core.dtypes import DtypePolicy
from ckptconv.core.layout import tiling_problem
from ckptconv.core.specs import ChunkSpec, DcpCheckpoint, StashedItem, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import exists, naming, refuse_url
from ckptconv.formats.hf import INDEX_FILE, checkpoint_root, write_index
from ckptconv.formats.stash import json_exact, write_stash
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone
from ckptconv.live.allgather import (
    TorchCollective,
    describe,
    emit,
    group_handles,
    holdings,
    live_jobs,
    run_rounds,
)
from ckptconv.live.host import release_host_memory
from ckptconv.lora.select import LoraRequest
from ckptconv.mapping import CONFIG_FILE, VARIANTS, load_config
from ckptconv.mapping.family import mapping_for
from ckptconv.mapping.types import KeyMapping
from ckptconv.options import SAVE_HF, DcpToHfOptions, DtypeOptions, MappingOptions, OutputOptions
from ckptconv.plan.family import follow_family
from ckptconv.plan.follow import config_dtype, follow_experts, reference_dtypes
from ckptconv.plan.outs import mapped_tensors
from ckptconv.plan.schedule import Holding, ShardStep, plan_rounds
from ckptconv.plan.to_hf import plan_dcp_to_hf
from ckptconv.plan.types import Granularity, HfSavePlan
from ckptconv.publish import outcheck, remote_target
from ckptconv.publish.copy_from import copy_non_weights
from ckptconv.remote import urls
from ckptconv.source.hub_reference import hub_repo
from ckptconv.source.reference import Bases, check_reference, locate_bases, read_base
from ckptconv.stream import tied
from ckptconv.stream.hf_write import follow_config, write_adapter_config, write_files


@dataclass(frozen=True)
class LoadSpec:
    """Where one rank's local data of a tensor sits in the global tensor, and how to undo its sharding."""

    key: str
    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    offsets: tuple[int, ...]  # of the local block
    sizes: tuple[int, ...]
    steps: tuple[ShardStep, ...] = ()  # the all-gathers that undo the placements, in order
    hf_keys: tuple[str, ...] = ()  # the HF keys this tensor holds, in order (`load_specs`, through a mapping)
    fused_dim: int | None = None  # the dim those HF keys are stacked / concatenated on (None: one key)

    @classmethod
    def from_tensor(cls, key: str, tensor: torch.Tensor) -> LoadSpec:
        """From a plain tensor (all of it) or a DTensor with any placements (Shard on any dim, uneven,
        Replicate, `_StridedShard`, 1-, 2- and 3-D meshes): the block DCP records for it (its
        `__create_chunk_list__`), in global coordinates, and its shard steps (`schedule.shard_steps`)."""
        d, _ = describe(key, tensor)
        return cls(key, d.shape, d.dtype, d.block[0], d.block[1], d.steps)


def load_specs(
    state_dict: Mapping[str, Any], *, mapping: str | None = None, config: Mapping[str, Any] | None = None
) -> dict[str, LoadSpec]:
    """Every tensor's LoadSpec, with the HF keys it holds through `mapping` (the plan dcp-to-hf and save_hf
    use) and the dim they are fused on: e.g. a stacked [experts, ...] tensor holds one HF key per expert on
    dim 0, a fused gate/up tensor two keys on dim 0, a plain tensor its own (prefix-stripped) key."""
    leaves = [(p, v) for p, v in flatten(state_dict) if isinstance(v, torch.Tensor)]
    paths: dict[str, tuple[str | int, ...]] = {".".join(p): p for p, _ in leaves}
    specs = {".".join(p): LoadSpec.from_tensor(".".join(p), v) for p, v in leaves}
    shapes = {k: TensorSpec(k, short_name(s.dtype), s.shape) for k, s in specs.items()}
    ckpt = DcpCheckpoint(Path("<state dict>"), shapes, {}, dict(paths))
    mapped = mapping_for(mapping, config or {})
    _, outs, _ = mapped_tensors(ckpt, DtypePolicy(None), mapping=mapped, config=dict(config or {}))
    held: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for t in outs:
        for sp in t.parts:
            held.setdefault(sp.spec.fqn, []).append((sp.part.src_offsets, t.hf_key))
    out = {}
    for fqn, spec in specs.items():
        keys = sorted(held.get(fqn, []))
        dims = {d for (a, _), (b, _) in itertools.pairwise(keys) for d in range(len(a)) if a[d] != b[d]}
        fused = min(dims) if dims else None
        out[fqn] = replace(spec, hf_keys=tuple(dict.fromkeys(k for _, k in keys)), fused_dim=fused)
    return out


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def flatten(state_dict: Mapping[str, Any]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, value) of every leaf of a nested dict, in order; tensors and everything else are leaves."""
    for name, value in state_dict.items():
        if isinstance(value, Mapping) and not isinstance(value, torch.Tensor):
            for path, leaf in flatten(value):
                yield (str(name), *path), leaf
        else:
            yield (str(name),), value


def _world() -> World:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def _live_checkpoint(holding: dict[str, Holding], paths: dict[str, tuple[str, ...]]) -> DcpCheckpoint:
    """Every rank's blocks of every tensor, as a DcpCheckpoint whose chunk `file` names the holding rank."""
    specs = {}
    for fqn, h in holding.items():
        problem = tiling_problem(h.shape, h.blocks)
        if problem:
            raise CkptconvError(f"save_hf: the ranks' blocks of {fqn!r} {problem}")
        chunks = tuple(
            ChunkSpec(o, s, f"__{r}_0.distcp", 0, 0, "torch_save") for r, (o, s) in enumerate(h.blocks)
        )
        specs[fqn] = TensorSpec(fqn, short_name(h.dtype), h.shape, chunks)
    return DcpCheckpoint(Path("<live state dict>"), specs, {}, dict(paths))


@dataclass(frozen=True)
class SaveReport:
    """What `save_hf` did: its files, how the unshard scheduler moved the data, and how the output compared
    with its reference model (the same on any rank)."""

    files: list[str]
    nbytes: int  # of tensor data written
    rounds: int
    collectives: int  # foreach all-gathers, each one (process group, dtype) batch
    max_round_bytes: int  # the largest round's gathered bytes (<= bucket_size unless one tensor is larger)
    reference: dict[str, Any] | None = None
    """With a reference model (`reference`, or `copy_from` holding weights): dcp-to-hf's --json `reference`,
    `{"path", "differences": [{"kind", "key", "planned", "reference"}], "adopted": {"experts", "left_out",
    "written", "dtypes", "file_split"}}`; None without one."""
    notes: tuple[str, ...] = ()
    """What dcp-to-hf would print as info lines for the same plan (a mapping taken because the reference
    calls for it, experts left as they are, ...)."""


def _base_config(bases: Bases) -> dict[str, Any]:
    """config.json of `copy_from`, else of `reference` (a mapping's sizes, `tie_word_embeddings`), as
    dcp-to-hf reads it when `--config` is not given; {} when neither names a model with one."""
    for place in (bases.copy_from, bases.reference):
        if place is not None and exists(place / CONFIG_FILE):
            return load_config(place / CONFIG_FILE, checkpoint_root(place))
    return {}


def save_hf(
    state_dict: Mapping[str, Any],
    path: str | Path,
    *,
    mapping: str | None = None,
    dtype: str | None = None,
    fp32: Sequence[str] = ("A_log$",),
    max_shard_size: str | int = "5GB",
    bucket_size: str | int = "128MB",
    copy_from: str | Path | None = None,
    extra: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    overwrite: bool = True,
    quantize: str | None = None,
    quantize_skip: Sequence[str] = (),
    write_granularity: str = "tensor",
    storage_options: Mapping[str, Any] | None = None,
    lora: str | None = None,
    lora_name: str | None = None,
    lora_alpha: float | None = None,
    lora_config: str | Path | None = None,
    fsync: bool = True,
    drop_untied_head: bool = False,
    reference: str | Path | None = None,
    allow_layout_change: bool = False,
    file_split: str = "size",
    hf_experts: str | None = None,
) -> SaveReport:
    """Collective (call on every rank): write `state_dict` as HF safetensors into the directory `path`.

    Values: DTensors with any placements, plain tensors (the same on every rank), or other objects, which go
    with `extra` to `ckptconv_state.json` like dcp-to-hf's stash. The files are those `dcp-to-hf` writes for
    the same weights and flags (`quantize="fp8"`, "fp8-block" or "nvfp4": a quantized release, as
    `--quantize`; a config.json from `copy_from` follows what was written). Rank 0 publishes `path` atomically
    after every rank succeeded. `write_granularity`: "tensor" (every rank writes its share of every file) or
    "file" (one rank per file), as dcp-to-hf's `--write-granularity`. A PEFT-wrapped model's state dict (LoRA
    factors) needs `lora`: "adapter", "merge" or "drop", as dcp-to-hf's `--lora`, with `lora_name`,
    `lora_alpha` and `lora_config` (the adapter_config.json PEFT's `save_pretrained` writes, or
    `peft_model.peft_config[name]` saved so) as its `--lora-*` flags. With a mapping and `tie_word_embeddings`
    in `config`, an output head that differs from the embedding is refused unless `drop_untied_head`
    (dcp-to-hf's `--drop-untied-head`). `path` may be a URL (`s3://bucket/step-1000`): each file is streamed
    by one rank as a multipart upload and the index (or the single file) completes it last, as dcp-to-hf
    writes a URL OUT; `storage_options` go to the backend's file system. A local `path` is fsynced (its files
    and directories) before it is published; `fsync=False` skips that, for scratch saves (as dcp-to-hf's
    `--no-fsync`).

    A reference model, as dcp-to-hf's `--reference` / `--copy-from`: `reference` (an HF directory; only its
    index and safetensors headers are read), else `copy_from` when it holds weights. The output follows it:
    with a mapping and no `hf_experts` ("per_expert" or "fused", as `--hf-experts`), MoE experts in its HF
    form; a copy it lacks left out, a tied head it holds written; with `dtype=None`, each floating tensor in
    its dtype for the key (bf16 where it has none; `fp32` patterns beat both, a `dtype` given beats it); with
    `file_split="reference"` (default "size": files of at most `max_shard_size`), each tensor in its file.
    The planned output is then compared with it before anything is written: a key or shape difference raises
    `CkptconvError` on every rank, nothing written, unless `allow_layout_change` (then each is a warning); a
    dtype difference is only told. `SaveReport.reference` says how it compared and what was adopted.
    """
    if file_split not in ("size", "reference"):
        raise CkptconvError(f"save_hf: file_split={file_split!r} is not one of 'size', 'reference'")
    if hf_experts is not None and hf_experts not in VARIANTS:
        raise CkptconvError(f"save_hf: hf_experts={hf_experts!r} is not one of 'per_expert', 'fused'")
    options = DcpToHfOptions(  # every check of the values alone, and the defaults dcp-to-hf's flags share
        dtype=DtypeOptions(dtype=dtype, fp32=tuple(fp32)),
        mapping=MappingOptions(mapping=mapping),
        output=OutputOptions(overwrite=overwrite, fsync=fsync),
        max_shard_size=max_shard_size,
        bucket_size=bucket_size,
        write_granularity=cast(Granularity, write_granularity),
        quantize=quantize,
        quantize_skip=tuple(quantize_skip),
        copy_from=_path(copy_from),
        reference=_path(reference, "reference"),
        allow_layout_change=allow_layout_change,
        file_split=file_split,
        hf_experts=hf_experts,
        drop_untied_head=drop_untied_head,
        lora=LoraRequest(lora, lora_name, lora_alpha, _path(lora_config, "lora_config")),  # type: ignore[arg-type]
        wording=SAVE_HF,
    )
    if storage_options is not None:
        urls.use_options(storage_options)
    world, out = _world(), urls.location(path, "save_hf")
    named = options.reference
    if named is not None and hub_repo(named) is None and not named.is_dir():
        raise CkptconvError(f"save_hf: reference={options.reference}: not a directory; give an HF model's")
    tensors: dict[str, torch.Tensor] = {}
    paths: dict[str, tuple[str, ...]] = {}
    others: list[tuple[tuple[str, ...], Any]] = []
    for p, value in flatten(state_dict):
        if isinstance(value, torch.Tensor):
            tensors[".".join(p)] = value
            paths[".".join(p)] = p
        else:
            others.append((p, value))
    others += [((str(k),), v) for k, v in (extra or {}).items()]
    ui = Ui(rank=world.rank, quiet=True)

    described = everyone(world, lambda: [describe(k, t) for k, t in tensors.items()])
    everyone_described = world.all_gather_object([d for d, _ in described])
    following = options.following()
    bases = locate_bases(world, following)  # a hub repo id's small files and headers, fetched by rank 0
    base = read_base(world, ui, following, bases)  # rank 0 reads the reference's headers, for all

    def prepare() -> Any:
        holding = holdings(everyone_described)
        quant = options.quant_policy()
        model_config = dict(config) if config is not None else _base_config(bases)
        # as dcp-to-hf: the reference's HF expert form and dtypes unless hf_experts / dtype name them
        keys, experts = follow_experts(
            mapping_for(mapping, model_config, hf_experts), base, model_config, hf_experts
        )
        live = _live_checkpoint(holding, paths)

        granularity = remote_target.granularity(out, options.write_granularity, quant is not None)

        def planned(keys: KeyMapping | None, experts: str | None) -> HfSavePlan:
            return plan_dcp_to_hf(
                live,
                options.dtype.policy(reference_dtypes(base, quant is not None)),
                max_shard_size=options.shard_bytes,
                world_size=world.size,
                mapping=keys,
                config=model_config,
                quantize=quant,
                write_granularity=granularity,
                lora=options.lora,
                base=base,
                split_as_base=following.by_files,
                experts=experts,
            )

        plan = planned(keys, experts)
        # without a mapping, a transformers-5 runtime layout the reference calls for (not a LoRA run's keys)
        if not mapping and (options.lora is None or options.lora.mode is None):
            plan = follow_family(plan, base, model_config, hf_experts, planned)
        lora_file = options.lora.config if options.lora is not None else None
        inputs = [("copy_from", bases.copy_from), ("reference", bases.reference)]
        inputs.append(("lora_config", lora_file))
        inputs.append(outcheck.mapping_input(mapping, "mapping"))
        target = outcheck.hf_target(
            world.is_main, out, options.output.overwrite, inputs, False, "overwrite=True"
        )
        jobs, order, needs = live_jobs(plan, holding, options.bucket_bytes)
        return plan, jobs, order, needs, plan_rounds(jobs, options.bucket_bytes), target

    plan, jobs, order, needs, rounds, target = everyone(world, prepare)
    compared = check_reference(world, ui, plan, following, base)  # refused here: nothing written yet
    if plan.tied:
        outs = {t.hf_key: t for f in plan.files for t in f.tensors}
        for head in tied.live_differing(world, plan.tied, outs, tensors):
            if not options.drop_untied_head:
                why = tied.refusal(head, outs, "drop_untied_head=True", "config=")
                raise CkptconvError(f"save_hf: {why}", agreed=world.distributed)
            ui.warn(tied.dropped(head, outs))
    handles = group_handles(described)

    def local(fqn: str) -> torch.Tensor:
        return local_data(tensors[fqn])

    def finish(staging: Path) -> None:
        if plan.sharded:
            with naming(staging / INDEX_FILE):
                write_index(staging, plan.weight_map, plan.total_size)
        write_adapter_config(staging, plan)
        if others:
            write_stash(staging, [_stashed(p, v) for p, v in others])
        if bases.copy_from is not None and CONFIG_FILE in copy_non_weights(bases.copy_from, staging):
            dtype = options.dtype
            target = config_dtype(plan, dtype.target(), dtype.defaulted, options.quantize is not None)
            follow_config(staging / CONFIG_FILE, plan, target)

    results = run_rounds(jobs, rounds, world.rank, local, TorchCollective(handles))
    items = emit(order, needs, world.rank, results, jobs)

    def write(staging: Path) -> None:
        write_files(plan, items, staging, world, ui, fsync=options.output.fsync, target=target)

    try:
        last = INDEX_FILE if plan.sharded or not plan.files else plan.files[0].name
        layout = (plan.files, plan.writes)
        target.publish(world, write, finish, last=last, layout=layout, fsync=options.output.fsync)
    finally:
        release_host_memory()  # what blocks leaving a GPU went through (none on the CPU)
    return SaveReport(
        [f.name for f in plan.files],
        plan.total_size,
        len(rounds),
        sum(len(r.batches) for r in rounds),
        max((sum(r.nbytes.values()) for r in rounds), default=0),
        compared,
        plan.notes,
    )


def _path(value: str | Path | None, name: str = "copy_from") -> Path | None:
    """`copy_from` (or `name`) as a local path (a URL is refused by name: files are not read from object
    storage)."""
    if value is None:
        return None
    refuse_url(value, name)
    return Path(value)


def _stashed(path: tuple[str, ...], value: Any) -> StashedItem:
    buf = io.BytesIO()
    torch.save(value, buf)
    return StashedItem(".".join(path), path, buf.getvalue(), value, json_exact(value))
