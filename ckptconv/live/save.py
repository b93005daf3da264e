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
from ckptconv.formats.files import naming, refuse_url
from ckptconv.formats.hf import INDEX_FILE, write_index
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
from ckptconv.mapping import CONFIG_FILE
from ckptconv.mapping.family import mapping_for
from ckptconv.options import SAVE_HF, DcpToHfOptions, DtypeOptions, MappingOptions, OutputOptions
from ckptconv.plan.outs import mapped_tensors
from ckptconv.plan.schedule import Holding, ShardStep, plan_rounds
from ckptconv.plan.to_hf import plan_dcp_to_hf
from ckptconv.plan.types import Granularity
from ckptconv.publish import outcheck, remote_out
from ckptconv.publish.copy_from import copy_non_weights
from ckptconv.remote import urls
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
    """What `save_hf` did: its files, and how the unshard scheduler moved the data (the same on any rank)."""

    files: list[str]
    nbytes: int  # of tensor data written
    rounds: int
    collectives: int  # foreach all-gathers, each one (process group, dtype) batch
    max_round_bytes: int  # the largest round's gathered bytes (<= bucket_size unless one tensor is larger)


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
) -> SaveReport:
    """Collective (call on every rank): write `state_dict` as HF safetensors into the directory `path`.

    Values: DTensors with any placements, plain tensors (the same on every rank), or other objects, which go
    with `extra` to `ckptconv_state.json` like dcp-to-hf's stash. The files are those `dcp-to-hf` writes for
    the same weights and flags (`quantize="fp8"`: an FP8 release, as `--quantize fp8`; a config.json from
    `copy_from` follows what was written). Rank 0 publishes `path` atomically after every rank succeeded.
    `write_granularity`: "tensor" (every rank writes its share of every file) or "file" (one rank per file),
    as dcp-to-hf's `--write-granularity`. A PEFT-wrapped model's state dict (LoRA factors) needs `lora`:
    "adapter", "merge" or "drop", as dcp-to-hf's `--lora`, with `lora_name`, `lora_alpha` and `lora_config`
    (the adapter_config.json PEFT's `save_pretrained` writes, or `peft_model.peft_config[name]` saved so)
    as its `--lora-*` flags. With a mapping and `tie_word_embeddings` in `config`, an output head that differs
    from the embedding is refused unless `drop_untied_head` (dcp-to-hf's `--drop-untied-head`).
    `path` may be a URL (`s3://bucket/step-1000`): each file is streamed by one rank as a multipart upload and
    the index (or the single file) completes it last, as dcp-to-hf writes a URL OUT; `storage_options` go
    to the backend's file system. A local `path` is fsynced (its files and directories) before it is
    published; `fsync=False` skips that, for scratch saves (as dcp-to-hf's `--no-fsync`).
    """
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
        drop_untied_head=drop_untied_head,
        lora=LoraRequest(lora, lora_name, lora_alpha, _path(lora_config, "lora_config")),  # type: ignore[arg-type]
        wording=SAVE_HF,
    )
    if storage_options is not None:
        urls.use_options(storage_options)
    world, out = _world(), urls.location(path, "save_hf")
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

    def prepare() -> Any:
        holding = holdings(everyone_described)
        quant = options.quant_policy()
        plan = plan_dcp_to_hf(
            _live_checkpoint(holding, paths),
            options.dtype.policy(),
            max_shard_size=options.shard_bytes,
            world_size=world.size,
            mapping=mapping_for(mapping, config or {}),
            config=dict(config or {}),
            quantize=quant,
            write_granularity=remote_out.granularity(out, options.write_granularity, quant is not None),
            lora=options.lora,
        )
        lora_file = options.lora.config if options.lora is not None else None
        inputs = [("copy_from", options.copy_from), ("lora_config", lora_file)]
        inputs.append(outcheck.mapping_input(mapping, "mapping"))
        target = outcheck.hf_target(
            world.is_main, out, options.output.overwrite, inputs, False, "overwrite=True"
        )
        jobs, order, needs = live_jobs(plan, holding, options.bucket_bytes)
        return plan, jobs, order, needs, plan_rounds(jobs, options.bucket_bytes), target

    plan, jobs, order, needs, rounds, target = everyone(world, prepare)
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
        if options.copy_from is not None and CONFIG_FILE in copy_non_weights(options.copy_from, staging):
            follow_config(staging / CONFIG_FILE, plan, options.dtype.target())

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
