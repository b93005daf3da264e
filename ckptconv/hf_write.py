"""dcp-to-hf's write: this rank's safetensors files from the tensors unshard (or gather) assembles, weights
quantized on the way when the plan says so, and the copied config.json made to follow what was written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from . import outdir
from .config_edit import edit_config, release_dtype
from .formats.dcp import DcpCheckpoint
from .formats.dcp_reader import DcpReader, RowPiece
from .formats.files import read_regular
from .formats.safetensors_io import Entry, SafetensorsWriter
from .gather import gather_tensors
from .plan import HfSavePlan, OutTensor
from .quant import fp8
from .quant.policy import scale_key
from .ui import Ui
from .unshard import Item, direct_rows, direct_tensors
from .world import World

ReadPath = Literal["direct", "gather"]


def write_shards(
    plan: HfSavePlan,
    ckpt: DcpCheckpoint,
    staging: Path,
    world: World,
    ui: Ui,
    bucket: int,
    read_path: ReadPath,
) -> list[RowPiece]:
    """This rank's files into `staging`; returns the chunks' pieces it read (some rows of a chunk)."""
    with DcpReader(ckpt) as reader:
        if read_path == "gather":
            items = gather_tensors(plan, world, direct_rows(reader), bucket)
        else:
            items = direct_tensors(plan, world, reader, bucket)
        write_files(plan, items, staging, world, ui)
        return reader.pieces()


def write_files(plan: HfSavePlan, items: Iterator[Item], staging: Path, world: World, ui: Ui) -> None:
    """Write this rank's files of `plan` from `items` (its tensors in file order, as unshard yields them)."""
    mine = plan.files_of(world.rank)
    with ui.bytes_progress(
        f"writing {len(mine)} of {len(plan.files)} files", sum(f.nbytes for f in mine)
    ) as progress:
        writer: SafetensorsWriter | None = None
        try:
            for f, t, tensor in items:
                if writer is None or writer.path.name != f.name:
                    if writer is not None:
                        writer.close()
                    writer = SafetensorsWriter(
                        staging / f.name, [Entry(x.hf_key, x.dtype, x.shape) for x in f.tensors]
                    )
                if t.quant:
                    progress.advance(_write_quantized(writer, t, tensor))
                else:
                    writer.write(t.hf_key, tensor)
                    progress.advance(t.nbytes)
                del tensor  # not held while the next tensor is assembled
            if writer is not None:
                writer.close()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise


def _write_quantized(writer: SafetensorsWriter, t: OutTensor, tensor: torch.Tensor) -> int:
    """`--quantize fp8`: the weight [R, C] (in its source dtype) as FP8 and its `weight_scale_inv`, quantized
    one 128-row slab at a time; returns the bytes written."""
    q, scale = fp8.quantize_whole(tensor)
    writer.write(t.hf_key, q)
    writer.write(scale_key(t.hf_key), scale)
    return q.nbytes + scale.nbytes


def follow_config(path: Path, plan: HfSavePlan, target: torch.dtype | None) -> list[str]:
    """Rank 0: the copied config.json made to name the dtype written and the quantization (config_edit)."""
    name: str | None
    if target is not None:
        name = str(target).removeprefix("torch.")
    else:
        name = release_dtype(
            (str(t.dtype).removeprefix("torch."), t.nbytes) for f in plan.files for t in f.tensors
        )
    raw, edits = edit_config(read_regular(path), name, plan.quantization)
    if edits:
        with outdir.naming(path):
            path.write_bytes(raw)
    return edits
