"""dcp-to-hf's write: this rank's byte ranges of the safetensors files (`writes`) from the tensors unshard (or
gather) assembles, each in place, weights quantized on the way when the plan says so, and the copied
config.json made to follow what was written."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch

from ckptconv.core.dtypes import check_range
from ckptconv.core.specs import DcpCheckpoint
from ckptconv.formats.dcp_pieces import RowPiece
from ckptconv.formats.dcp_reader import DcpReader
from ckptconv.formats.durable import Syncer
from ckptconv.formats.files import CONFIG_BYTES, naming, read_regular
from ckptconv.formats.safetensors_io import Entry, SafetensorsWriter
from ckptconv.job.ui import Ui
from ckptconv.job.world import World
from ckptconv.lora.settings import CONFIG_FILE as LORA_CONFIG_FILE
from ckptconv.plan.config import edit_config, release_dtype
from ckptconv.plan.types import HfSavePlan, OutTensor, RankBytes
from ckptconv.plan.writes import bytes_per_rank
from ckptconv.publish.target import Sinks
from ckptconv.quant import fp8
from ckptconv.quant.policy import QuantPolicy, encode, scale_key
from ckptconv.stream.buffers import BufferPool
from ckptconv.stream.gather import gather_tensors
from ckptconv.stream.unshard import Item, direct_rows, direct_tensors

ReadPath = Literal["direct", "gather"]
# `--resume`'s record of a finished file: (its path, the (offset, length, CRC-32) of what was written to it)
Record = Callable[[object, list[tuple[int, int, int]] | None], None]


def write_shards(
    plan: HfSavePlan,
    ckpt: DcpCheckpoint,
    staging: Path,
    world: World,
    ui: Ui,
    bucket: int,
    read_path: ReadPath,
    fsync: bool,
    target: Sinks,
    record: Record | None = None,
) -> tuple[list[RowPiece], RankBytes]:
    """This rank's writes into `staging`, each file fsynced once this rank has written it (unless not
    `fsync`); returns the chunks' pieces it read (some rows of a chunk) and the bytes it read and wrote.
    `target`: where the files go (`publish.target`); `record(path, crcs)`: called once a file is on the
    device (`--resume`'s record of it)."""
    with DcpReader(ckpt, cache_bytes=bucket) as reader:
        if read_path == "gather":
            items = gather_tensors(plan, world, direct_rows(reader), bucket)
            pool = None
        else:
            pool = BufferPool.for_bucket(bucket)
            items = direct_tensors(plan, world, reader, bucket, pool)
        written = write_files(plan, items, staging, world, ui, pool, fsync, target=target, record=record)
        return reader.pieces(), RankBytes(world.rank, reader.bytes_read, written, *reader.fetched())


def write_files(
    plan: HfSavePlan,
    items: Iterator[Item],
    staging: Path,
    world: World,
    ui: Ui,
    pool: BufferPool | None = None,
    fsync: bool = True,
    *,
    target: Sinks,
    record: Record | None = None,
) -> int:
    """Write this rank's byte ranges of the plan's files (`plan.writes_of`) from `items` (its writes with
    their data, in order, as unshard yields them), each in place; returns the bytes written. Tensors made
    in `pool` go back to it once written. With `fsync`, each file is fsynced as soon as this rank's writes to
    it are done, on a thread of its own while the next file is written, and all before this returns.
    `target`: the files' sinks (`publish.target`); `record(path, crcs)`: called (on the fsync thread) once a
    file this rank finished is on the device and closed, with the (offset, length, CRC-32) of what was
    written to it (computed by the writer from the bytes in memory: nothing is read back)."""
    sinks = target
    crcs: dict[str, list[tuple[int, int, int]] | None] = {}  # a finished file's, until its record is made
    after = None if record is None else lambda path: record(path, crcs.pop(str(path), None))
    mine = plan.writes_of(world.rank)
    files = len({w.file.name for w in mine})
    nbytes = bytes_per_rank(plan.writes, plan.world_size)[world.rank]
    written = done = 0
    with (
        ui.bytes_progress(f"writing {files} of {len(plan.files)} files", nbytes) as progress,
        Syncer(fsync, after=after) as syncer,
    ):
        writer: SafetensorsWriter | None = None
        try:
            for w, tensor in items:
                if writer is None or writer.path.name != w.file.name:
                    if writer is not None:
                        finished, writer = writer, None  # its file is the syncer's to close now
                        crcs[str(finished.path)] = finished.crcs
                        finished.close(syncer)
                        written += finished.bytes_sent
                    entries = [Entry(x.hf_key, x.dtype, x.file_shape) for x in w.file.tensors]
                    # a rank's writes to a file are one run, so the write with the header opens it
                    path = staging / w.file.name
                    sink, crc = sinks.sink(path), record is not None
                    writer = SafetensorsWriter(path, entries, header=w.header, sink=sink, crc=crc)
                if w.tensor.quant:
                    progress.advance(_write_quantized(writer, w.tensor, tensor))
                else:
                    check_range(w.tensor.hf_key, w.tensor.src.dtype, tensor)
                    writer.write(w.tensor.hf_key, tensor, w.start)
                    progress.advance(w.nbytes)
                done += 1
                if pool is not None:
                    pool.give(tensor)  # written: its memory makes a later tensor
                del tensor  # not held while the next tensor is assembled
            if writer is not None:
                finished, writer = writer, None
                crcs[str(finished.path)] = finished.crcs
                finished.close(syncer)
                written += finished.bytes_sent
            syncer.wait()  # every file this rank wrote is on the device before it says it is done
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
    assert done == len(mine), f"rank {world.rank}: {len(mine) - done} planned writes never came"
    return written


def _write_quantized(writer: SafetensorsWriter, t: OutTensor, tensor: torch.Tensor) -> int:
    """`--quantize`: the weight [R, C] (assembled in its source dtype) quantized once and written with its
    scales (fp8: as FP8 and its `weight_scale_inv`; fp8-block, nvfp4: cast to the release's dtype first, then
    as `quant.policy` lays them out), each a slab of rows at a time; returns the bytes written."""
    if t.quant == "fp8":
        q, scale = fp8.quantize_whole(tensor)
        writer.write(t.hf_key, q)
        writer.write(scale_key(t.hf_key), scale)
        return q.nbytes + scale.nbytes
    assert t.quant is not None and t.quant_dtype is not None
    return write_encoded(writer, t.hf_key, t.quant, t.quant_dtype, tensor)


def write_encoded(
    writer: SafetensorsWriter, key: str, scheme: str, dtype: torch.dtype, tensor: torch.Tensor
) -> int:
    """The weight `key` (`tensor`) cast to `dtype` (checked as any cast to fp16 is), quantized as `scheme`
    (fp8-block, nvfp4) and written with its scales; returns the bytes written. The cast is made a slab of
    rows at a time: besides the weight, only its quantized tensors are held whole."""
    if dtype == torch.float16 and tensor.dtype != dtype:
        check_range(key, tensor.dtype, tensor.abs().amax().to(dtype))  # its largest value, cast
    parts = encode(scheme, tensor, dtype)
    stored = QuantPolicy(scheme).stored(key, tuple(tensor.shape), dtype)
    for spec, part in zip(stored, parts, strict=True):
        writer.write(spec.key, part)
    return sum(p.nbytes for p in parts)


def follow_config(path: Path, plan: HfSavePlan, target: torch.dtype | None) -> list[str]:
    """Rank 0: the copied config.json made to name the dtype written and the quantization (config_edit)."""
    name: str | None
    if target is not None:
        name = str(target).removeprefix("torch.")
    else:
        name = release_dtype(
            (str(t.dtype).removeprefix("torch."), t.nbytes) for f in plan.files for t in f.tensors
        )
    raw, edits = edit_config(read_regular(path, limit=CONFIG_BYTES), name, plan.quantization)
    if edits:
        with naming(path):
            path.write_bytes(raw)
    return edits


def write_adapter_config(staging: Path, plan: HfSavePlan) -> None:
    """Rank 0, `--lora adapter`: the adapter_config.json PEFT reads beside adapter_model.safetensors."""
    if plan.lora is None or plan.lora.config is None:
        return
    path = staging / LORA_CONFIG_FILE
    with naming(path):
        path.write_text(json.dumps(plan.lora.config, indent=2) + "\n")
