"""hf-to-dcp's write: the plan's tensors as meta placeholders for `dcp.save`, filled row window by row window
from the HF files (`compose.target_rows`), plus the stashed items restored where the job saved them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckptconv.core.dtype_names import torch_dtype
from ckptconv.core.dtypes import check_range
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.job.ui import Ui
from ckptconv.job.world import World
from ckptconv.plan.types import DcpOutTensor, DcpSavePlan, RankBytes
from ckptconv.publish.records import Item
from ckptconv.publish.resume import Resume
from ckptconv.publish.target import Sinks
from ckptconv.remote.urls import UrlPath
from ckptconv.stream.compose import expect_elsewhere, source_rows, target_rows

if TYPE_CHECKING:
    from ckptconv.formats.dcp_writer import Resumed


def save_dcp(
    plan: DcpSavePlan,
    staging: Path,
    world: World,
    ui: Ui,
    fsync: bool,
    target: Sinks,
    resume: Resume | None = None,
    file_bytes: int | None = None,
) -> RankBytes:
    """This rank's rows of every tensor into `staging` (collective), each file fsynced as it is written
    unless not `fsync`; returns the bytes it read and the bytes of the data files it wrote. `target`: where
    the files go (`publish.target`); `resume`: the records of the data files (each written whole by this
    rank), and the files kept from an interrupted run, neither read for nor written again. `file_bytes`: the
    largest data file (--max-file-size; None: its default)."""
    from ckptconv.formats.dcp_writer import DEFAULT_FILE_BYTES, write_dcp  # torch DCP: ~1 s to import

    sinks = target
    state_dict, raw_items, scalars = _dcp_state_dict(plan, world)
    by_key = {t.key: t for t in plan.tensors}
    reader = RowReader()

    def read_rows(fqn: str, lo: int, hi: int, scratch: torch.Tensor | None) -> torch.Tensor:
        if fqn in scalars:
            return scalars[fqn]
        t = by_key[fqn]
        rows = target_rows(t, lo, hi, reader, scratch)
        check_range(fqn, t.src.dtype, rows)  # --dtype fp16 of values beyond its range: refused, not inf
        return rows

    resumed = _resumed(resume, staging, world)
    for t in plan.tensors if resumed is None or not resumed.kept else ():
        # from object storage: what this rank reads, announced (neighbours fetched together); not when a
        # resume keeps files, whose rows are not read (which rows those are, torch's plan says later)
        lo, hi = plan.rows_of(t, world.rank)
        if hi > lo:
            for stored, a, b in source_rows(t, lo, hi):
                reader.expect(stored, a, b)
    expect_elsewhere(reader, plan, world.rank)  # and the other ranks' rows: never fetched here
    mine = plan.nbytes_of(world.rank)
    with ui.bytes_progress(f"rank {world.rank} of {world.size}: saving DCP", mine) as progress:
        try:
            store = sinks.store()
            advance = progress.advance
            most = file_bytes or DEFAULT_FILE_BYTES
            write_dcp(staging, state_dict, read_rows, raw_items, advance, fsync, store, resumed, most)
        finally:
            reader.close()
    written = sinks.written(staging, f"__{world.rank}_*.distcp")
    if resumed is not None and not isinstance(staging, UrlPath):  # (a kept object is never streamed)
        written -= sum((staging / name).stat().st_size for name in resumed.reused)
    return RankBytes(world.rank, reader.bytes_read, written, *reader.fetched())


def _resumed(resume: Resume | None, staging: Path, world: World) -> Resumed | None:
    """What `write_dcp` needs of `resume`: this rank's kept data files with their records' items, and the
    record of each file it writes."""
    from ckptconv.formats.dcp_writer import Resumed

    if resume is None:
        return None
    mine = [name for name in resume.kept if name.startswith(f"__{world.rank}_")]
    if isinstance(staging, UrlPath):  # object storage: the kept objects and their sizes (the uploads are
        # the records: each carries the run's fingerprint)
        return Resumed({}, lambda *record: None, sized={n: resume.object_sizes[n] for n in mine})
    kept = resume.items(staging, mine)

    def record(name: str, size: int, crc: int, items: list[Item]) -> None:
        resume.record_whole(staging, world.rank, world.size, name, size, crc, items)

    return Resumed(kept, record)


def _dcp_state_dict(
    plan: DcpSavePlan, world: World
) -> tuple[dict[str, Any], dict[str, bytes], dict[str, torch.Tensor]]:
    """Meta-device placeholders (DTensors with `Shard(0)` rows under torchrun) for `write_dcp` to fill, the
    stashed items written as their original bytes, and the stashed 0-d tensors' values."""
    mesh = None
    if world.distributed:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        world_group = dist.group.WORLD
        assert world_group is not None
        mesh = DeviceMesh.from_group(world_group, "cpu")  # the world group itself: no new gloo groups
    state: dict[str, Any] = {}
    lead = "".join(part + "." for part in plan.nesting)
    for t in plan.tensors:
        _nest(state, (*plan.nesting, t.key[len(lead) :]), _placeholder(plan, t, mesh, world.rank))
    raw_items, scalars = {}, {}
    for item in plan.stash:
        if item.tensor is not None and item.has_value:
            scalars[item.key] = torch.tensor(item.value, dtype=torch_dtype(item.tensor))
            _nest(state, item.path, _scalar_placeholder(scalars[item.key].dtype, mesh))
            continue
        _nest(state, item.path, item.value if item.has_value else item.raw)
        if not item.has_value:
            raw_items[item.key] = item.raw
    return state, raw_items, scalars


def _scalar_placeholder(dtype: torch.dtype, mesh: Any) -> torch.Tensor:
    local = torch.empty((), dtype=dtype, device="meta")
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(local, mesh, [Replicate()], run_check=False)


def _placeholder(plan: DcpSavePlan, t: DcpOutTensor, mesh: Any, rank: int) -> torch.Tensor:
    if mesh is None:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    from torch.distributed.tensor import DTensor, Shard

    if not t.shape:
        return _scalar_placeholder(t.dtype, mesh)
    lo, hi = plan.rows_of(t, rank)
    local = torch.empty((hi - lo, *t.shape[1:]), dtype=t.dtype, device="meta")
    stride = torch.empty(t.shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(t.shape), stride=stride
    )


def _nest(state: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    node = state
    for part in path[:-1]:
        node = node.setdefault(str(part), {})
    node[str(path[-1])] = value
