"""dcp-to-hf as named steps, in order: locate and check the inputs, open the checkpoint, plan, then write,
check and finish in a staging directory that is published as OUT (and pushed to the hub).

Every function here is collective under torchrun: call it on every rank with the same arguments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.deepspeed import deepspeed_weights
from ckptconv.formats.hf import INDEX_FILE, checkpoint_root
from ckptconv.formats.hf_sharded import metadata_dir
from ckptconv.formats.rank_files import model_files
from ckptconv.job import gcpause
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, on_main
from ckptconv.mapping import load_config
from ckptconv.mapping.family import mapping_for
from ckptconv.mapping.types import KeyMapping
from ckptconv.options import DcpToHfOptions
from ckptconv.plan.base import Base
from ckptconv.plan.family import follow_family
from ckptconv.plan.follow import follow_experts, reference_dtypes
from ckptconv.plan.megatron_tp import saved_tp, with_tp
from ckptconv.plan.to_hf import plan_dcp_to_hf
from ckptconv.plan.types import HfSavePlan, RankBytes
from ckptconv.publish import hub_push, multipart, outcheck, remote_target
from ckptconv.publish.copy_from import check_copy
from ckptconv.publish.target import Target
from ckptconv.remote.urls import location
from ckptconv.run.hf_staging import Planned, Staging, resume_state
from ckptconv.run.steps import config_file, return_freed_memory
from ckptconv.source import locate as sources
from ckptconv.source.early import Early
from ckptconv.source.reference import Bases, check_reference, locate_bases, read_base
from ckptconv.source.share import open_dcp_shared
from ckptconv.stream import tied


@dataclass
class Result:
    """What `dcp_to_hf` planned and did."""

    out: Path
    plan: HfSavePlan
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)
    config_edits: list[str] = field(default_factory=list)  # what the copied config.json was changed to say
    written: bool = False
    ranks: list[RankBytes] = field(default_factory=list)  # what each rank read and wrote
    hub: dict[str, Any] | None = None  # --push-to-hub: where the result went (hub_push.push)
    reference: dict[str, Any] | None = None  # what the plan was compared with, and how it differed
    resumed: list[str] | None = None  # --resume: the files kept from the interrupted run (None: no --resume)


def dcp_to_hf(
    src: str | Path,
    out: str | Path,
    options: DcpToHfOptions = DcpToHfOptions(),
    *,
    world: World,
    ui: Ui,
    early: Early | None = None,
) -> Result:
    """Convert the DCP checkpoint `src` into the HF directory `out` as `options` say, and with `options.push`
    upload it to the hub once published. `early`: `src` as opened before torch was imported (`early_open`).
    Collective."""
    start = time.perf_counter()
    return_freed_memory()
    src, out = location(src, "SRC"), location(out, "OUT")  # a URL without a bucket: refused before any work
    with gcpause.paused(), deepspeed_weights(options.deepspeed_weights):
        located = sources.for_all(world, lambda: early.path if early is not None else sources.dcp_source(src))
        following = options.following()
        bases = locate_bases(world, following)  # rank 0 fetches a repo id's small files and headers, for all
        target = everyone(world, check_inputs, world, located, out, options, bases)
        ckpt = everyone(world, open_dcp_shared, world, located, early)  # rank 0 reads .metadata, for all
        base = read_base(world, ui, following, bases)  # rank 0 reads the reference's headers, for all
        job = everyone(world, make_plan, world, ckpt, out, options, base, bases)
        compared = check_reference(world, ui, job.plan, following, base)  # refused here: nothing written yet
        if job.plan.tied and not options.output.dry_run:
            job.plan = tied.checked(world, ckpt, job.plan, options.drop_untied_head)
    tell(ui, job, src, options)
    result = Result(out, job.plan, reference=compared)
    if target is None:
        if options.push is not None:
            ui.info(f"--dry-run: nothing is written, nor pushed to {options.push.repo_id}")
    else:
        publish(world, ui, job, target, options, result)
    result.seconds = time.perf_counter() - start
    return result


def check_inputs(
    world: World, located: Path, out: Path, options: DcpToHfOptions, bases: Bases | None = None
) -> Target | None:
    """Every rank: `--copy-from` and `--reference` are directories (a repo id's: its snapshot in the hub
    cache), and OUT may be written and keeps clear of every input; the target to write (None: a dry run)."""
    if bases is None:
        bases = Bases(options.copy_from, options.reference)
    copy_from, reference, lora = bases.copy_from, bases.reference, options.lora
    for flag, directory in (("--copy-from", copy_from), ("--reference", reference)):
        if directory is not None and not directory.is_dir():
            raise CkptconvError(f"{flag} {directory}: not a directory")
    inputs = [("SRC", located), ("--copy-from", copy_from), ("--reference", reference)]
    inputs.append(("--config", options.mapping.config))
    inputs += [
        outcheck.mapping_input(options.mapping.mapping),
        ("--lora-config", lora.config if lora else None),
    ]
    if options.output.dry_run:
        return None
    pushed = options.push is not None
    resume = options.output.resume
    target = outcheck.hf_target(world.is_main, out, options.output.overwrite, inputs, pushed, resume=resume)
    refuse_remote_resume(target, out, resume)
    return target


def refuse_remote_resume(target: Target, out: Path, resume: bool) -> None:
    """--resume into object storage: a run into S3 resumes (remote_resume); into another store it is
    refused by name (no listing of uploads in progress, no user metadata ckptconv can check)."""
    in_s3 = isinstance(target, remote_target.RemoteTarget) and multipart.supported(target.url)
    if resume and target.local_path is None and not in_s3:
        raise CkptconvError(
            f"--resume: OUT {out} is in object storage, where this run cannot be resumed: only a run into "
            "S3 can; leave --resume out (the run then writes every file)"
        )


def make_plan(
    world: World,
    ckpt: DcpCheckpoint,
    out: Path,
    options: DcpToHfOptions,
    base: Base | None = None,
    bases: Bases | None = None,
) -> Planned:
    """Every rank: the model's files and config, the mapping, and the plan of every output file (following
    the reference model `base`, when there is one)."""
    if bases is None:
        bases = Bases(options.copy_from, options.reference)
    located, copy_from, keys = ckpt.path, bases.copy_from, options.mapping
    # the model's files: --copy-from's, else NeMo Automodel's .hf_metadata beside the shards, or verl's
    # huggingface/ beside its rank files (each with the root its files must resolve inside)
    meta = None if copy_from else metadata_dir(located) if ckpt.file_split is not None else model_files(ckpt)
    described = (copy_from, checkpoint_root(copy_from)) if copy_from else ((meta, located) if meta else None)
    if described is not None and world.is_main:
        check_copy(*described)  # what the copy would refuse, refused before the weights are written
    if options.keep_file_split and ckpt.file_split is None:
        raise CkptconvError(
            f"--keep-file-split: {located} records no file split (only the shards of torch's distributed "
            "HF writer do); leave the flag out to split by --max-shard-size"
        )
    # config.json: --config, else --copy-from's, else --reference's, else .hf_metadata's, else the DCP's own
    reference = (bases.reference, checkpoint_root(bases.reference)) if bases.reference else None
    places = (described, reference) if copy_from else (reference, described)
    model_config = load_config(*config_file(keys.config, *places, (located, located)))
    # the TP size a Megatron checkpoint was saved at, for the rules that group by it (`megatron_tp`)
    model_config = with_tp(model_config, saved_tp(ckpt), options.megatron_tp)
    key_mapping = mapping_for(keys.mapping, model_config, options.hf_experts)
    # BASE's way of writing the experts, unless --hf-experts names one (then the check tells)
    key_mapping, experts = follow_experts(key_mapping, base, model_config or {}, options.hf_experts)
    quant = options.quant_policy()
    # BASE's dtype per key where --dtype is not given; a --quantize'd output keeps its own dtypes
    dtypes = reference_dtypes(base, quant is not None)

    def planned(mapping: KeyMapping | None, experts: str | None) -> HfSavePlan:
        return plan_dcp_to_hf(
            ckpt,
            options.dtype.policy(dtypes),
            max_shard_size=options.shard_bytes,
            world_size=world.size,
            prefix=keys.prefix,
            mapping=mapping,
            config=model_config,
            allow_unmapped=keys.allow_unmapped,
            keep_trainer_state=options.keep_trainer_state,
            file_split=ckpt.file_split if options.keep_file_split else None,
            quantize=quant,
            write_granularity=remote_target.granularity(out, options.write_granularity, quant is not None),
            lora=options.lora,
            base=base,
            split_as_base=options.file_split == "reference",
            experts=experts,
        )

    hf_plan = planned(key_mapping, experts)
    # without --mapping, a transformers-5 runtime layout the reference calls for (not for a LoRA run's keys)
    if not keys.mapping and (options.lora is None or options.lora.mode is None):
        hf_plan = follow_family(hf_plan, base, model_config, options.hf_experts, planned)
    return Planned(ckpt, hf_plan, model_config, described)


def tell(ui: Ui, job: Planned, src: Path, options: DcpToHfOptions) -> None:
    """What the plan found worth saying: where the model's files come from, its notes and warnings."""
    if job.described is not None and options.copy_from is None:
        ui.info(
            f"copying the model's files from {job.described[0]} (--copy-from DIR takes them from elsewhere)"
        )
    if job.ckpt.path != src:
        ui.info(f"{src}: holds one checkpoint, {job.ckpt.path}; converting it")
    for note in job.plan.notes:
        ui.info(note)
    for warning in job.plan.warnings:
        ui.warn(warning)


def publish(
    world: World,
    ui: Ui,
    job: Planned,
    target: Target,
    options: DcpToHfOptions,
    result: Result,
) -> None:
    """Write, check and finish the staging directory, publish it as OUT, then push it (`options.push`)."""
    plan = job.plan
    granularity = target.granularity(options.write_granularity, bool(options.quantize))
    for note in target.notes(world.size, granularity):
        ui.info(note)
    resume = resume_state(world, ui, job, options)
    staged = Staging(world, ui, job, options, target, resume)
    # the object completed last: model.safetensors (or an adapter's one file), else the index
    last = INDEX_FILE if plan.sharded or not plan.files else plan.files[0].name
    with gcpause.paused():  # the plan's records are not walked again and again while the bytes move
        copied = target.publish(
            world,
            staged.write,
            staged.finish,
            staged.check,
            last=last,
            layout=(plan.files, plan.writes),
            say=ui.warn,
            fsync=options.output.fsync,
            resume=resume,
        )
    result.copied, result.config_edits = copied or [], staged.config_edits
    result.ranks = world.all_gather_object(staged.mine)
    result.written = True
    result.resumed = sorted(resume.kept) if resume is not None and resume.asked else None
    if options.push is not None:
        assert target.local_path is not None  # a URL OUT with --push-to-hub was refused
        result.hub = on_main(world, hub_push.push, options.push, target.local_path)
