"""Orchestration only: the steps of each conversion, in order, with the points where ranks agree.

Every function here is collective under torchrun: call it on every rank with the same arguments.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, ParamSpec, TypeVar, cast

from . import outdir
from .dtypes import DtypePolicy, parse_dtype_flag
from .errors import CkptconvError
from .formats.dcp import DcpCheckpoint, DcpReader, is_dcp_dir, open_dcp
from .formats.hf import INDEX_FILE, Entry, SafetensorsWriter, write_index
from .plan import HfSavePlan, parse_size, plan_dcp_to_hf
from .stash import StashedItem, json_exact, write_stash
from .ui import Ui
from .unshard import direct_tensors, gather_tensors
from .world import World

ReadPath = Literal["direct", "gather"]
P = ParamSpec("P")
T = TypeVar("T")
DEFAULT_BUCKET = 512 * 2**20


@dataclass
class Result:
    out: Path
    plan: HfSavePlan
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)
    written: bool = False


def resolve_dcp_source(src: Path) -> Path:
    """The DCP directory the user means, or a CkptconvError saying what `src` is instead."""
    if not src.exists():
        raise CkptconvError(f"{src}: no such file or directory")
    if is_dcp_dir(src):
        return src
    if src.is_file() or any(src.glob("*.safetensors")) or (src / INDEX_FILE).exists():
        if src.suffix == ".safetensors" or src.is_dir():
            raise CkptconvError(f"{src}: is a Hugging Face safetensors checkpoint, not DCP; use hf-to-dcp")
        raise CkptconvError(f"{src}: is a file; dcp-to-hf reads a DCP checkpoint directory (with .metadata)")
    raise CkptconvError(
        f"{src}: not a DCP checkpoint (no .metadata inside); point at the checkpoint directory"
    )


def _everyone(world: World, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn` on every rank and agree on the outcome: all ranks get the result or all raise."""
    try:
        result, error = fn(*args, **kwargs), None
    except Exception as e:
        result, error = None, e
    world.agree(error)
    return cast(T, result)


def _on_main(world: World, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """Run `fn` on rank 0 only; every rank learns whether it failed."""
    return _everyone(world, lambda: fn(*args, **kwargs) if world.is_main else None)


def dcp_to_hf(
    src: Path,
    out: Path,
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
) -> Result:
    """Convert the DCP checkpoint `src` into the HF directory `out`. Collective."""
    start = time.perf_counter()

    def prepare() -> tuple[DcpCheckpoint, HfSavePlan, int]:
        policy = DtypePolicy(parse_dtype_flag(dtype), fp32)
        shard_bytes = parse_size(max_shard_size)
        bucket = parse_size(bucket_size, "--bucket-size")
        if copy_from is not None and not copy_from.is_dir():
            raise CkptconvError(f"--copy-from {copy_from}: not a directory")
        ckpt = open_dcp(resolve_dcp_source(src))
        plan = plan_dcp_to_hf(ckpt, policy, max_shard_size=shard_bytes, world_size=world.size, prefix=prefix)
        if not dry_run:
            outdir.check_out(out, overwrite)
        return ckpt, plan, bucket

    ckpt, plan, bucket = _everyone(world, prepare)
    for note in plan.notes:
        ui.info(note)
    for warning in plan.warnings:
        ui.warn(warning)
    result = Result(out, plan)
    if dry_run:
        return result

    _on_main(world, outdir.prepare, out)
    staging = outdir.staging_dir(out)
    try:
        _everyone(world, _write_shards, plan, ckpt, staging, world, ui, bucket, read_path)
        result.copied = _on_main(world, _finish, plan, ckpt, staging, out, copy_from, ui) or []
    except BaseException:
        if world.is_main:
            outdir.discard(out)
        raise
    result.seconds = time.perf_counter() - start
    result.written = True
    return result


def _write_shards(
    plan: HfSavePlan,
    ckpt: DcpCheckpoint,
    staging: Path,
    world: World,
    ui: Ui,
    bucket: int,
    read_path: ReadPath,
) -> None:
    mine = plan.files_of(world.rank)
    source = gather_tensors if read_path == "gather" else direct_tensors
    with (
        DcpReader(ckpt) as reader,
        ui.bytes_progress(
            f"writing {len(mine)} of {len(plan.files)} files", sum(f.nbytes for f in mine)
        ) as progress,
    ):
        writer: SafetensorsWriter | None = None
        try:
            for f, t, tensor in source(plan, world, reader, bucket):
                if writer is None or writer.path.name != f.name:
                    if writer is not None:
                        writer.close()
                    writer = SafetensorsWriter(
                        staging / f.name, [Entry(x.hf_key, x.dtype, x.shape) for x in f.tensors]
                    )
                writer.write(t.hf_key, tensor)
                progress.advance(t.nbytes)
            if writer is not None:
                writer.close()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise


def _finish(
    plan: HfSavePlan, ckpt: DcpCheckpoint, staging: Path, out: Path, copy_from: Path | None, ui: Ui
) -> list[str]:
    """Rank 0, after every shard is written: index, stash, copied files, then the rename into place."""
    if plan.sharded:
        write_index(staging, plan.weight_map, plan.total_size)
    if plan.stash:
        write_stash(staging, _load_stash(plan, ckpt, ui))
    copied = outdir.copy_non_weights(copy_from, staging) if copy_from is not None else []
    outdir.publish(staging, out)
    return copied


def _load_stash(plan: HfSavePlan, ckpt: DcpCheckpoint, ui: Ui) -> list[StashedItem]:
    items = []
    with DcpReader(ckpt) as reader:
        for item in plan.stash:
            raw, value, why = reader.load_item(item)
            if why is not None:
                ui.warn(
                    f"non-tensor item {item.fqn!r} {why}: stashed as bytes, not loaded "
                    "(ckptconv never unpickles it)"
                )
            items.append(StashedItem(item.fqn, item.path, raw, value, why is None and json_exact(value), why))
    return items
