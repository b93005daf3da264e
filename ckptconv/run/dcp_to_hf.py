"""Orchestration only: the steps of each conversion, in order, with the points where ranks agree.

Every function here is collective under torchrun: call it on every rank with the same arguments.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.core.dtypes import DtypePolicy, parse_dtype_flag
from ckptconv.core.sizes import parse_size
from ckptconv.core.specs import DcpCheckpoint, HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats import megatron as megatron_files
from ckptconv.formats.dcp import METADATA_FILE
from ckptconv.formats.dcp_reader import RowPiece
from ckptconv.formats.files import exists, is_directory, naming, read_regular
from ckptconv.formats.hf import INDEX_FILE, checkpoint_root, open_hf, write_index
from ckptconv.formats.hf_sharded import metadata_dir
from ckptconv.formats.stash import collect_stash, read_stash, write_stash
from ckptconv.job import gcpause
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main, on_main
from ckptconv.lora.select import AS_STORED, LoraRequest
from ckptconv.mapping import CONFIG_FILE, MAX_CONFIG_BYTES, load_config, load_mapping
from ckptconv.plan import megatron as megatron_out
from ckptconv.plan.config import dequantized_config
from ckptconv.plan.to_hf import plan_dcp_to_hf, plan_hf_to_dcp
from ckptconv.plan.types import DcpSavePlan, Granularity, HfSavePlan, RankBytes
from ckptconv.plan.writes import GRANULARITIES
from ckptconv.publish import hub_push, outcheck, outdir, remote_out
from ckptconv.publish.copy_from import check_copy, copy_non_weights
from ckptconv.publish.hub_push import PushRequest
from ckptconv.publish.remote_out import RemoteTarget
from ckptconv.quant.policy import QuantPolicy
from ckptconv.remote.urls import location
from ckptconv.run import verify as verify_mod
from ckptconv.source import locate as sources
from ckptconv.source.early import Early
from ckptconv.source.lora import with_adapter
from ckptconv.source.share import open_dcp_shared
from ckptconv.stream import tied
from ckptconv.stream.compose import dequantized_note
from ckptconv.stream.copies import check_copies
from ckptconv.stream.dcp_save import save_dcp
from ckptconv.stream.hf_write import ReadPath, follow_config, write_adapter_config, write_shards
from ckptconv.stream.unshard import check_read_pieces

DEFAULT_BUCKET = 128 * 10**6


@dataclass
class Result:
    out: Path
    plan: HfSavePlan
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)
    config_edits: list[str] = field(default_factory=list)  # what the copied config.json was changed to say
    written: bool = False
    ranks: list[RankBytes] = field(default_factory=list)  # what each rank read and wrote
    hub: dict[str, Any] | None = None  # --push-to-hub: where the result went (hub_push.push)


def _return_freed_memory() -> None:
    """Serve buffers of 1 MiB and more with mmap, so freeing a chunk gives its memory back to the system.

    glibc otherwise raises its mmap threshold up to 32 MiB after the first large free, and chunks of a few MiB
    then pile up in its heap: measured, peak RSS of a 1 GB hf-to-dcp went from 0.8 to 0.4 GiB with this.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 2**20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def dcp_to_hf(
    src: str | Path,
    out: str | Path,
    *,
    world: World,
    ui: Ui,
    dtype: str = "bf16",
    fp32: Sequence[str] = (),
    max_shard_size: str | int = "5GB",
    prefix: str | None = None,
    copy_from: Path | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    bucket_size: str | int = DEFAULT_BUCKET,
    read_path: ReadPath = "direct",
    mapping: str | None = None,
    config: Path | None = None,
    allow_unmapped: bool = False,
    hf_experts: str | None = None,
    keep_trainer_state: bool = False,
    keep_file_split: bool = False,
    quantize: str | None = None,
    quantize_skip: Sequence[str] = (),
    verify: bool = False,
    write_granularity: Granularity = "tensor",
    push: PushRequest | None = None,
    lora: LoraRequest | None = None,
    early: Early | None = None,
    fsync: bool = True,
    drop_untied_head: bool = False,
) -> Result:
    """Convert the DCP checkpoint `src` into the HF directory `out`, and with `push` upload it to the hub
    once published. `lora`: what to make of LoRA factors (`lora.select`). `early`: `src` as opened before
    torch was imported (`early_open`). `fsync=False` (`--no-fsync`): nothing is fsynced.
    `drop_untied_head`: leave out an output head that differs from the embedding config.json ties it to
    (refused otherwise; `tied`). Collective."""
    start = time.perf_counter()
    _return_freed_memory()
    src, out = location(src, "SRC"), location(out, "OUT")  # a URL without a bucket: refused before any work

    def check_inputs(
        located: Path,
    ) -> tuple[DtypePolicy, QuantPolicy | None, int, int, outcheck.Target | None]:
        policy = DtypePolicy(parse_dtype_flag(dtype), fp32)
        if lora is not None:
            lora.check()
            if lora.mode == "merge" and read_path == "gather":
                raise CkptconvError("--lora merge reads with --read direct (the default) only, for now")
        if quantize_skip and not quantize:
            raise CkptconvError("--quantize-skip applies with --quantize fp8")
        quant = QuantPolicy(quantize, quantize_skip) if quantize else None
        if write_granularity not in GRANULARITIES:
            raise CkptconvError(f"--write-granularity {write_granularity!r} is not one of tensor, file")
        if push is not None:
            push.check()
        shard_bytes = parse_size(max_shard_size)
        bucket = parse_size(bucket_size, "--bucket-size")
        if copy_from is not None and not copy_from.is_dir():
            raise CkptconvError(f"--copy-from {copy_from}: not a directory")
        inputs = [("SRC", located), ("--copy-from", copy_from), ("--config", config)]
        inputs += [outcheck.mapping_input(mapping), ("--lora-config", lora.config if lora else None)]
        target = (
            None if dry_run else outcheck.hf_target(world.is_main, out, overwrite, inputs, push is not None)
        )
        return policy, quant, shard_bytes, bucket, target

    def prepare(
        ckpt: DcpCheckpoint, policy: DtypePolicy, quant: QuantPolicy | None, shard_bytes: int
    ) -> tuple[HfSavePlan, dict[str, Any], tuple[Path, Path] | None]:
        located = ckpt.path
        # the model's files: --copy-from's, else NeMo Automodel's .hf_metadata beside the shards (each with
        # the root its files must resolve inside)
        meta = None if copy_from or ckpt.file_split is None else metadata_dir(located)
        described = (
            (copy_from, checkpoint_root(copy_from)) if copy_from else ((meta, located) if meta else None)
        )
        if described is not None and world.is_main:
            check_copy(*described)  # what the copy would refuse, refused before the weights are written
        if keep_file_split and ckpt.file_split is None:
            raise CkptconvError(
                f"--keep-file-split: {located} records no file split (only the shards of torch's distributed "
                "HF writer do); leave the flag out to split by --max-shard-size"
            )
        key_mapping = load_mapping(mapping, hf_experts) if mapping else None
        model_config = load_config(*_config_file(config, described, (located, located)))
        plan = plan_dcp_to_hf(
            ckpt,
            policy,
            max_shard_size=shard_bytes,
            world_size=world.size,
            prefix=prefix,
            mapping=key_mapping,
            config=model_config,
            allow_unmapped=allow_unmapped,
            keep_trainer_state=keep_trainer_state,
            file_split=ckpt.file_split if keep_file_split else None,
            quantize=quant,
            write_granularity=remote_out.granularity(out, write_granularity, quant is not None),
            lora=lora,
        )
        return plan, model_config, described

    with gcpause.paused():
        located = sources.for_all(world, lambda: early.path if early is not None else sources.dcp_source(src))
        policy, quant, shard_bytes, bucket, target = everyone(world, check_inputs, located)
        ckpt = everyone(world, open_dcp_shared, world, located, early)  # rank 0 reads .metadata, for all
        plan, model_config, described = everyone(world, prepare, ckpt, policy, quant, shard_bytes)
        if plan.tied and not dry_run:
            plan = tied.checked(world, ckpt, plan, drop_untied_head)
    if described is not None and copy_from is None:
        ui.info(f"copying the model's files from {described[0]} (--copy-from DIR takes them from elsewhere)")
    if ckpt.path != src:
        ui.info(f"{src}: holds one checkpoint, {ckpt.path}; converting it")
    for note in plan.notes:
        ui.info(note)
    for warning in plan.warnings:
        ui.warn(warning)
    result = Result(out, plan)
    if target is None:
        if push is not None:
            ui.info(f"--dry-run: nothing is written, nor pushed to {push.repo_id}")
        result.seconds = time.perf_counter() - start
        return result
    if isinstance(target, RemoteTarget):
        if world.size > 1 and remote_out.granularity(out, write_granularity, quant is not None) == "file":
            ui.info(f"{target.url}: each file is uploaded whole by one rank (--write-granularity file)")
    elif target.note:
        ui.info(target.note)

    def source() -> verify_mod.Side:
        quantized = frozenset(t.hf_key for f in plan.files for t in f.tensors if t.quant)
        return verify_mod.dcp_side(
            "source",
            ckpt.path,
            prefix,
            mapping,
            model_config,
            allow_unmapped,
            hf_experts,
            quantized=quantized,
            lora=lora,
            drop_untied_head=drop_untied_head,
        )

    pieces: list[RowPiece] = []
    mine = [RankBytes(world.rank, 0, 0)]

    def write(staging: Path) -> None:
        read, mine[0] = write_shards(plan, ckpt, staging, world, ui, bucket, read_path, fsync)
        pieces.extend(read)

    def check(staging: Path) -> None:
        check_read_pieces(world, ckpt, pieces)
        if verify:
            _check(world, ui, source, lambda a: verify_mod.hf_side("output", staging, like=a))

    def finish(staging: Path) -> list[str]:
        copied = _finish(plan, ckpt, staging, described, ui)
        if CONFIG_FILE in copied:
            result.config_edits = follow_config(staging / CONFIG_FILE, plan, parse_dtype_flag(dtype))
        return copied

    with gcpause.paused():  # the plan's records are not walked again and again while the bytes move
        if isinstance(target, RemoteTarget):
            last = INDEX_FILE if plan.sharded else plan.files[0].name  # model.safetensors, or an adapter's
            layout = (plan.files, plan.writes)
            result.copied = remote_out.publish(world, target, last, write, finish, check, layout) or []
        else:
            result.copied = outdir.atomically(world, target, write, finish, check, ui.warn, fsync) or []
    result.ranks = world.all_gather_object(mine[0])
    result.written = True
    if push is not None:
        assert isinstance(target, outcheck.Output)  # a URL OUT with --push-to-hub was refused
        result.hub = on_main(world, hub_push.push, push, target.path)
    result.seconds = time.perf_counter() - start
    return result


def _check(
    world: World,
    ui: Ui,
    source: Callable[[], verify_mod.Side],
    output: Callable[[verify_mod.Side], verify_mod.Side],
) -> None:
    """Collective (`--verify`): the staged output against its source, before it is published."""
    a = everyone(world, source)
    b = everyone(world, output, a)
    verify_mod.check_output(a, b, world, ui)


def _finish(
    plan: HfSavePlan, ckpt: DcpCheckpoint, staging: Path, copy_from: tuple[Path, Path] | None, ui: Ui
) -> list[str]:
    """Rank 0, after every shard is written: index, stash, copied files."""
    if plan.sharded:
        with naming(staging / INDEX_FILE):
            write_index(staging, plan.weight_map, plan.total_size)
    if plan.stashed:
        write_stash(staging, collect_stash(ckpt, plan.stash, plan.scalars, plan.common, ui.warn))
    write_adapter_config(staging, plan)
    return copy_non_weights(copy_from[0], staging, copy_from[1]) if copy_from is not None else []


def hf_to_dcp(
    src: str,
    out: str | Path,
    *,
    world: World,
    ui: Ui,
    dtype: str = "keep",
    fp32: Sequence[str] = (),
    prefix: str | None = None,
    revision: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    mapping: str | None = None,
    config: Path | None = None,
    allow_unmapped: bool = False,
    verify: bool = False,
    lora_adapter: str | None = None,
    lora_name: str = "default",
    fsync: bool = True,
) -> DcpResult:
    """Convert the HF model `src` (directory, file or hub repo id) to the DCP directory `out`; with
    `lora_adapter` (a PEFT adapter directory or repo id) the base model and the adapter under a PEFT-wrapped
    model's names, the adapter called `lora_name` (`lora.wrap`). `fsync=False` (`--no-fsync`): nothing is
    fsynced. Collective."""
    start = time.perf_counter()
    _return_freed_memory()
    out = location(out, "OUT")  # a URL without a bucket: refused before anything is downloaded
    path = sources.for_all(world, lambda: sources.hf_source(src, revision))  # rank 0 downloads or lists
    adapter = sources.adapter_source(world, lora_adapter)  # an input too: OUT must keep clear of it

    config_file = _config_file(config, (path, checkpoint_root(path)) if is_directory(path) else None)

    def check_inputs() -> tuple[DtypePolicy, outcheck.Target | None]:
        if lora_adapter is not None and mapping:
            raise CkptconvError("--lora-adapter with --mapping is not supported yet; leave --mapping out")
        inputs = [("SRC", path), ("--config", config), ("--lora-adapter", adapter)]
        inputs.append(outcheck.mapping_input(mapping))
        target = None if dry_run else outcheck.hf_target(world.is_main, out, overwrite, inputs, False)
        return DtypePolicy(parse_dtype_flag(dtype), fp32), target

    def prepare(hf: HfCheckpoint, policy: DtypePolicy) -> tuple[DcpSavePlan, dict[str, Any]]:
        stash = read_stash(path) if is_directory(path) else []
        key_mapping = load_mapping(mapping) if mapping else None
        model_config = load_config(*config_file)
        plan = plan_hf_to_dcp(
            hf,
            policy,
            world_size=world.size,
            prefix=prefix,
            stash=stash,
            mapping=key_mapping,
            config=model_config,
            allow_unmapped=allow_unmapped,
        )
        if key_mapping is not None and key_mapping.checkpoint == "megatron":
            plan = megatron_out.with_extra_state(plan)
        return plan, model_config

    with gcpause.paused():
        policy, target = everyone(world, check_inputs)
        hf = everyone(world, from_main, world, lambda: with_adapter(open_hf(path), adapter, lora_name))
        plan, model_config = everyone(world, prepare, hf, policy)
    if plan.same and not dry_run:
        check_copies(world, hf, plan.same)
    for warning in plan.warnings:
        ui.warn(warning)
    note = dequantized_note(plan.tensors)
    if note:
        ui.info(note)
    result = DcpResult(out, path, plan)
    if target is None:
        result.seconds = time.perf_counter() - start
        return result
    if isinstance(target, outcheck.Output) and target.note:
        ui.info(target.note)

    def source() -> verify_mod.Side:  # the HF tensors the plan reads (keys a mapping drops are not output)
        used = {id(stored) for t in plan.tensors for stored, _ in t.parts}
        read = {key for key, stored in hf.tensors.items() if id(stored) in used}  # as the plan names them
        return verify_mod.hf_side("source", path, keys=read | {copy for copy, _ in plan.same}, hf=hf)

    def output(staging: Path, hf: verify_mod.Side) -> verify_mod.Side:  # in the HF side's expert form
        lora = AS_STORED if lora_adapter is not None else None  # the wrapped names, as written
        return verify_mod.dcp_side(
            "output", staging, prefix, mapping, model_config, allow_unmapped, like=hf, lora=lora
        )

    mine = [RankBytes(world.rank, 0, 0)]

    def write(staging: Path) -> None:
        mine[0] = save_dcp(plan, staging, world, ui, fsync)

    def finish(staging: Path) -> None:
        _finish_dcp(staging, plan, config_file if mapping else (None, None))

    with gcpause.paused():
        check = (lambda staging: _check(world, ui, source, lambda a: output(staging, a))) if verify else None
        if isinstance(target, RemoteTarget):
            remote_out.publish(world, target, METADATA_FILE, write, finish, check)
        else:
            outdir.atomically(world, target, write, finish, check, ui.warn, fsync)
    result.ranks = world.all_gather_object(mine[0])
    result.seconds = time.perf_counter() - start
    result.written = True
    return result


ConfigFile = tuple[Path | None, Path | None]  # config.json, the root it must resolve inside (None: a flag's)


def _config_file(config: Path | None, *places: tuple[Path, Path] | None) -> ConfigFile:
    """`--config`, else the config.json of the first of `places` (a directory, and the root its files must
    resolve inside) that has one: --copy-from's (or .hf_metadata), then the checkpoint's own."""
    if config is not None:
        return config, None
    for place in places:
        if place is not None and exists(place[0] / CONFIG_FILE):
            return place[0] / CONFIG_FILE, place[1]
    return None, None


def _finish_dcp(staging: Path, plan: DcpSavePlan, config_file: ConfigFile) -> None:
    """Rank 0, hf-to-dcp: the config a mapping read, and Megatron's side files for a megatron mapping."""
    _keep_config(staging, config_file)
    if any(megatron_out.is_extra_state(item.key) for item in plan.stash):  # with_extra_state added them
        megatron_files.write_side_files(staging, megatron_out.iteration_of(plan.stash))


def _keep_config(staging: Path, config_file: ConfigFile) -> None:
    """Rank 0, hf-to-dcp with a mapping: the config.json the mapping read, kept beside `.metadata` (where
    dcp.load ignores it), so dcp-to-hf, verify and inspect of this checkpoint map it back without --config."""
    path, root = config_file
    if path is None or not exists(path):
        return
    raw = dequantized_config(read_regular(path, root, limit=MAX_CONFIG_BYTES))
    with naming(staging / CONFIG_FILE):
        (staging / CONFIG_FILE).write_bytes(raw)


@dataclass
class DcpResult:
    out: Path
    source: Path
    plan: DcpSavePlan
    seconds: float = 0.0
    written: bool = False
    ranks: list[RankBytes] = field(default_factory=list)  # what each rank read and wrote
