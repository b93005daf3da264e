"""hf-to-dcp's plan, and the steps that write it into the staging directory before it is published: write
and check (--verify) on every rank, finish on rank 0."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.core.specs import HfCheckpoint
from ckptconv.formats import megatron as megatron_files
from ckptconv.formats.files import exists, naming, read_regular
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main
from ckptconv.lora.select import AS_STORED
from ckptconv.mapping import CONFIG_FILE, MAX_CONFIG_BYTES
from ckptconv.options import HfToDcpOptions
from ckptconv.plan import megatron as megatron_out
from ckptconv.plan.config import dequantized_config
from ckptconv.plan.types import DcpSavePlan, RankBytes
from ckptconv.publish.resume import (
    Resume,
    digest,
    file_stamp,
    object_stamps,
    options_digest,
    stamps_digest,
)
from ckptconv.publish.target import Target
from ckptconv.remote import tree as remote_tree
from ckptconv.remote.urls import UrlPath
from ckptconv.run import sides
from ckptconv.run.steps import ConfigFile, check_output
from ckptconv.stream.dcp_save import save_dcp


@dataclass
class Planned:
    """The plan step's outcome: the model (with its adapter), its plan, and the config a mapping read."""

    path: Path  # the model's directory or file, local or in object storage
    hf: HfCheckpoint
    plan: DcpSavePlan
    config: dict[str, Any]
    config_file: ConfigFile  # where `config` came from
    notes: tuple[str, ...] = ()  # info lines about the plan (a mapping the reference called for)


class Staging:
    """The steps run on the staging directory before it is published: `write` and `check` (--verify) on
    every rank, `finish` on rank 0."""

    def __init__(
        self,
        world: World,
        ui: Ui,
        job: Planned,
        options: HfToDcpOptions,
        target: Target,
        resume: Resume | None = None,
    ) -> None:
        self.world, self.ui, self.job, self.options, self.target = world, ui, job, options, target
        self.resume = resume  # the records of the data files written (`--resume`); None: none kept
        self.mine = RankBytes(world.rank, 0, 0)  # what this rank read and wrote

    def write(self, staging: Path) -> None:
        """This rank's rows of every tensor, but of the data files `--resume` kept (neither read nor
        written)."""
        o, plan = self.options, self.job.plan
        self.mine = save_dcp(
            plan, staging, self.world, self.ui, o.output.fsync, self.target, self.resume, o.file_bytes
        )

    def check(self, staging: Path) -> None:
        """--verify: the staged output against the HF tensors the plan read."""
        check_output(self.world, self.ui, self.source, lambda hf: self.output(staging, hf))

    def source(self) -> sides.Side:
        """The HF tensors the plan reads (keys a mapping drops are not output), as the plan names them."""
        plan, hf = self.job.plan, self.job.hf
        used = {id(stored) for t in plan.tensors for stored, _ in t.parts}
        read = {key for key, stored in hf.tensors.items() if id(stored) in used}
        return sides.hf_side("source", self.job.path, keys=read | {copy for copy, _ in plan.same}, hf=hf)

    def output(self, staging: Path, hf: sides.Side) -> sides.Side:
        """The staged DCP checkpoint, read in the HF side's expert form."""
        keys = self.options.mapping
        lora = AS_STORED if self.options.lora_adapter is not None else None  # the wrapped names, as written
        return sides.dcp_side(
            "output",
            staging,
            keys.prefix,
            keys.mapping,
            self.job.config,
            keys.allow_unmapped,
            like=hf,
            lora=lora,
        )

    def finish(self, staging: Path) -> None:
        """Rank 0: the config a mapping read, and Megatron's side files for a megatron mapping."""
        plan = self.job.plan
        _keep_config(staging, self.job.config_file if self.options.mapping.mapping else (None, None))
        if any(megatron_out.is_extra_state(item.key) for item in plan.stash):  # with_extra_state added them
            megatron_files.write_side_files(staging, megatron_out.iteration_of(plan.stash))


def _keep_config(staging: Path, found: ConfigFile) -> None:
    """Rank 0, hf-to-dcp with a mapping: the config.json the mapping read, kept beside `.metadata` (where
    dcp.load ignores it), so dcp-to-hf, verify and inspect of this checkpoint map it back without --config."""
    path, root = found
    if path is None or not exists(path):
        return
    raw = dequantized_config(read_regular(path, root, limit=MAX_CONFIG_BYTES))
    with naming(staging / CONFIG_FILE):
        (staging / CONFIG_FILE).write_bytes(raw)


# what changes how an hf-to-dcp run writes, not what: left out of its fingerprint
OUTPUT_ONLY = ("output",)


def resume_state(world: World, ui: Ui, job: Planned, options: HfToDcpOptions) -> Resume:
    """The records an hf-to-dcp run writes and `--resume` checks: the fingerprint is the source's stamps
    (each safetensors file, the config), the options that change what is written, and the plan with the
    number of ranks and of files per rank (`__{rank}_{k}.distcp` and what each holds depend on both: a
    resume runs at the same number of ranks, else one line says so). A data file's size is its record's."""
    from ckptconv.formats.dcp_writer import file_count, write_threads  # torch DCP: imported to write anyway

    hf, plan = job.hf, job.plan
    stamps = {str(f): _stamp(f) for f in hf.files}
    config = job.config_file[0]
    more: list[object] = [None if config is None else (str(config), _stamp(config))]
    root = hf.path
    if isinstance(root, UrlPath):  # their stamps hold sizes only: the listing's versions (ETag, ...) too
        more.append(everyone(world, from_main, world, lambda: object_stamps(root)))
    source = stamps_digest(stamps, *more)
    threads = write_threads()
    layout = digest(plan.tensors, plan.nesting, plan.stash, world.size, threads)
    fingerprint = (source, options_digest(options, OUTPUT_ONLY), layout)
    # each rank's files: at most as many as the largest share (rank 0's: torch.chunk's split), with every
    # stashed 0-d tensor (8 bytes at most; torch's planner may give any rank one), makes at --max-file-size
    scalars = sum(1 for item in plan.stash if item.tensor is not None and item.has_value)
    most = plan.nbytes_of(0) + 8 * scalars
    files = file_count(most, len(plan.tensors) + scalars, threads, options.file_bytes)
    sizes: dict[str, int | None] = {
        f"__{rank}_{k}.distcp": None for rank in range(world.size) for k in range(files)
    }
    return Resume(fingerprint, sizes, options.output.resume, info=ui.info, warn=ui.warn, ranks=world.size)


def _stamp(path: Path) -> object:
    """A source file's stamp: a local file's (device, inode, size, mtime); an object's size (its version is
    `object_stamps`')."""
    if isinstance(path, UrlPath):
        return ("object", remote_tree.size(path))
    return file_stamp(path)
