"""dcp-to-hf's plan, and the steps that write it into the staging directory before it is published: write
and check on every rank, finish on rank 0."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptconv.core.specs import DcpCheckpoint
from ckptconv.formats.dcp_pieces import RowPiece
from ckptconv.formats.files import naming
from ckptconv.formats.hf import INDEX_FILE, write_index
from ckptconv.formats.stash import collect_stash, write_stash
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main
from ckptconv.mapping import CONFIG_FILE
from ckptconv.options import DcpToHfOptions
from ckptconv.plan.coverage import file_size, plan_digest, rank_ranges
from ckptconv.plan.follow import config_dtype
from ckptconv.plan.types import HfSavePlan, RankBytes
from ckptconv.publish.copy_from import copy_non_weights
from ckptconv.publish.resume import (
    Resume,
    file_stamp,
    local_stamps,
    object_stamps,
    options_digest,
    stamps_digest,
)
from ckptconv.publish.target import Target
from ckptconv.remote.urls import UrlPath
from ckptconv.run import sides
from ckptconv.run.steps import check_output
from ckptconv.stream.hf_write import follow_config, write_adapter_config, write_shards
from ckptconv.stream.unshard import check_read_pieces


@dataclass
class Planned:
    """The plan step's outcome: the checkpoint, its plan, the model's config and where its files come from."""

    ckpt: DcpCheckpoint
    plan: HfSavePlan
    config: dict[str, Any]
    described: tuple[Path, Path] | None  # the directory the model's files are copied from, and their root


class Staging:
    """The steps run on the staging directory before it is published: `write` and `check` on every rank,
    `finish` on rank 0; what they read and changed is kept for the result."""

    def __init__(
        self,
        world: World,
        ui: Ui,
        job: Planned,
        options: DcpToHfOptions,
        target: Target,
        resume: Resume | None = None,
    ) -> None:
        self.world, self.ui, self.job, self.options, self.target = world, ui, job, options, target
        self.resume = resume  # the records of the files written (`--resume`); None: none kept
        self.pieces: list[RowPiece] = []  # the chunks' pieces this rank read (some rows of a chunk)
        self.mine = RankBytes(world.rank, 0, 0)
        self.config_edits: list[str] = []

    def write(self, staging: Path) -> None:
        """This rank's share of the shards, but of the files `--resume` kept (neither read nor written)."""
        o, plan, record = self.options, self.job.plan, None
        if self.resume is not None:
            kept = self.resume.kept
            plan = replace(plan, writes=tuple(w for w in plan.writes if w.file.name not in kept))
            if not isinstance(staging, UrlPath):  # in object storage the uploads are the records
                ranges = rank_ranges(plan, self.world.rank)
                record = self.resume.recorder(staging, self.world.rank, self.world.size, ranges).done
        read, self.mine = write_shards(
            plan,
            self.job.ckpt,
            staging,
            self.world,
            self.ui,
            o.bucket_bytes,
            o.read_path,
            o.output.fsync,
            self.target,
            record,
        )
        self.pieces.extend(read)

    def check(self, staging: Path) -> None:
        """The CRC-32s of chunks read in pieces; with --verify, the staged output against the source."""
        check_read_pieces(self.world, self.job.ckpt, self.pieces)
        if self.options.output.verify:
            raw = self.options.quantize not in (None, "fp8")  # compared as stored: the bytes written
            output = lambda a: sides.hf_side("output", staging, like=a, raw=raw)  # noqa: E731
            check_output(self.world, self.ui, self.source, output)

    def source(self) -> sides.Side:
        """The source side of --verify, as the plan read it."""
        plan, keys, o = self.job.plan, self.options.mapping, self.options
        quantized = frozenset(t.hf_key for f in plan.files for t in f.tensors if t.quant == "fp8")
        encoded = {
            t.hf_key: (t.quant, t.quant_dtype)
            for f in plan.files
            for t in f.tensors
            if t.quant and t.quant_dtype is not None
        }
        return sides.dcp_side(
            "source",
            self.job.ckpt.path,
            keys.prefix,
            keys.mapping,
            self.job.config,
            keys.allow_unmapped,
            o.hf_experts,
            quantized=quantized,
            lora=o.lora,
            drop_untied_head=o.drop_untied_head,
            encoded=encoded,
        )

    def finish(self, staging: Path) -> list[str]:
        """Rank 0, after every shard is written: index, stash, adapter config, copied files."""
        plan, ckpt, described = self.job.plan, self.job.ckpt, self.job.described
        if plan.sharded:
            with naming(staging / INDEX_FILE):
                write_index(staging, plan.weight_map, plan.total_size)
        if plan.stashed:
            write_stash(staging, collect_stash(ckpt, plan.stash, plan.scalars, plan.common, self.ui.warn))
        write_adapter_config(staging, plan)
        copied = copy_non_weights(described[0], staging, described[1]) if described is not None else []
        if CONFIG_FILE in copied:
            # dtypes taken from the reference (no --dtype given): the config names the one most bytes have
            o = self.options
            target = config_dtype(plan, o.dtype.target(), o.dtype.defaulted, bool(o.quantize))
            self.config_edits = follow_config(staging / CONFIG_FILE, plan, target)
        return copied


# what changes how a dcp-to-hf run writes, not what: left out of its fingerprint
OUTPUT_ONLY = ("output", "bucket_size", "read_path", "write_granularity", "push", "wording")


def resume_state(world: World, ui: Ui, job: Planned, options: DcpToHfOptions) -> Resume:
    """The records a dcp-to-hf run writes and `--resume` checks: the fingerprint is the source's stamps
    (`.metadata` and every data file; in object storage each object's size and version, from one listing),
    the options that change what is written, and each file's name, header and size (the same at any number
    of ranks: a run may resume at another)."""
    ckpt, plan = job.ckpt, job.plan
    # the stamps .metadata's reader took, and the ctimes it did not (a file rewritten in place with its size
    # and mtime set back still has a new ctime)
    more: list[object] = [file_stamp(ckpt.path / ".metadata"), local_stamps(ckpt.path, sorted(ckpt.stamps))]
    root = ckpt.path
    if isinstance(root, UrlPath):  # its stamps hold sizes only: the listing's versions (ETag, ...) too
        more.append(everyone(world, from_main, world, lambda: object_stamps(root)))
    source = stamps_digest(ckpt.stamps, *more)
    fingerprint = (source, options_digest(options, OUTPUT_ONLY), plan_digest(plan.files))
    sizes = {f.name: file_size(f) for f in plan.files}
    return Resume(fingerprint, sizes, options.output.resume, info=ui.info, warn=ui.warn)
