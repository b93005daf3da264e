"""hf-to-dcp as named steps, in order: locate and check the inputs, open the model, plan, then write, check
and finish in a staging directory that is published as OUT.

Every function here is collective under torchrun: call it on every rank with the same arguments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptconv.core.specs import HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import METADATA_FILE
from ckptconv.formats.files import is_directory
from ckptconv.formats.hf import checkpoint_root, open_hf
from ckptconv.formats.stash import read_stash
from ckptconv.job import gcpause
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone, from_main
from ckptconv.mapping import load_config
from ckptconv.mapping.family import mapping_for
from ckptconv.mapping.types import KeyMapping
from ckptconv.options import HfToDcpOptions
from ckptconv.plan import megatron as megatron_out
from ckptconv.plan import megatron_fsdp
from ckptconv.plan.family import family_plan
from ckptconv.plan.reference import Tensors
from ckptconv.plan.to_hf import plan_hf_to_dcp
from ckptconv.plan.types import DcpSavePlan, RankBytes
from ckptconv.publish import outcheck
from ckptconv.publish.target import Target
from ckptconv.remote.urls import location
from ckptconv.run import hf_reference
from ckptconv.run.dcp_staging import Planned, Staging, resume_state
from ckptconv.run.dcp_to_hf import refuse_remote_resume
from ckptconv.run.steps import config_file, return_freed_memory
from ckptconv.source import locate as sources
from ckptconv.source.lora import with_adapter
from ckptconv.stream.compose import dequantized_note
from ckptconv.stream.copies import check_copies


@dataclass
class DcpResult:
    """What `hf_to_dcp` planned and did."""

    out: Path
    source: Path
    plan: DcpSavePlan
    seconds: float = 0.0
    written: bool = False
    ranks: list[RankBytes] = field(default_factory=list)  # what each rank read and wrote
    reference: dict[str, Any] | None = None  # --reference: what the plan was compared with, how it differed
    resumed: list[str] | None = None  # --resume: the data files kept from an interrupted run (None: none)


def hf_to_dcp(
    src: str,
    out: str | Path,
    options: HfToDcpOptions = HfToDcpOptions(),
    *,
    world: World,
    ui: Ui,
) -> DcpResult:
    """Convert the HF model `src` (directory, file or hub repo id) to the DCP directory `out` as `options`
    say; with `options.lora_adapter` (a PEFT adapter directory or repo id) the base model and the adapter
    under a PEFT-wrapped model's names (`lora.wrap`). Collective."""
    start = time.perf_counter()
    return_freed_memory()
    out = location(out, "OUT")  # a URL without a bucket: refused before anything is downloaded
    path = sources.for_all(
        world, lambda: sources.hf_source(src, options.revision)
    )  # rank 0 downloads or lists
    adapter = sources.adapter_source(world, options.lora_adapter)  # an input too: OUT must keep clear of it
    with gcpause.paused():
        target = everyone(world, check_inputs, world, path, adapter, out, options)
        options = everyone(world, megatron_options, path, options)
        hf = everyone(
            world, from_main, world, lambda: with_adapter(open_hf(path), adapter, options.lora_name)
        )
        reference = hf_reference.read_reference(world, options)
        job = everyone(world, make_plan, world, path, hf, options, reference)
        compared = everyone(  # refused here: nothing written yet
            world, hf_reference.check_reference, world, ui, job.plan, options, reference
        )
    if job.plan.same and not options.output.dry_run:
        check_copies(world, hf, job.plan.same)
    tell(ui, job)
    result = DcpResult(out, path, job.plan, reference=compared)
    if target is not None:
        publish(world, ui, job, target, options, result)
    result.seconds = time.perf_counter() - start
    return result


def check_inputs(
    world: World, path: Path, adapter: Path | None, out: Path, options: HfToDcpOptions
) -> Target | None:
    """Every rank: `--reference` is a DCP checkpoint, OUT may be written and keeps clear of every input; the
    target (None: a dry run)."""
    hf_reference.check_path(options.reference)
    inputs = [("SRC", path), ("--config", options.mapping.config), ("--lora-adapter", adapter)]
    inputs.append(("--reference", options.reference))
    inputs.append(outcheck.mapping_input(options.mapping.mapping))
    if options.output.dry_run:
        return None
    resume = options.output.resume
    target = outcheck.hf_target(world.is_main, out, options.output.overwrite, inputs, False, resume=resume)
    refuse_remote_resume(target, out, resume)
    return target


def megatron_options(path: Path, options: HfToDcpOptions) -> HfToDcpOptions:
    """Every rank: `options` with `--format` and `--megatron-gdn` made runtime layouts of the mapping
    (`plan.megatron_fsdp.runtime_layouts`, which refuses them on a mapping without such layouts); for an
    fsdp_dtensor output also its `model.module.` prefix and, no --dtype given, fp32 (Megatron-FSDP's main
    weights: see plan/megatron_fsdp.py)."""
    keys = options.mapping
    if not keys.mapping:
        return options
    found = config_file(keys.config, (path, checkpoint_root(path)) if is_directory(path) else None)
    model_config = load_config(*found)
    key_mapping = mapping_for(keys.mapping, model_config)
    if key_mapping is None:
        return options
    layouts = megatron_fsdp.runtime_layouts(
        key_mapping,
        options.runtime_layout,
        options.format,
        options.megatron_gdn,
        options.megatron_tp,
        model_config,
    )
    options = replace(options, runtime_layout=layouts)
    if not megatron_fsdp.writes_fsdp(mapping_for(keys.mapping, model_config, runtime_layout=layouts)):
        return options
    if keys.prefix is not None:
        raise CkptconvError(
            f"--prefix {keys.prefix!r}: --format {megatron_fsdp.FSDP_DTENSOR} writes its keys under "
            f"{megatron_fsdp.PREFIX!r}; leave --prefix out"
        )
    mapping = replace(keys, prefix=megatron_fsdp.PREFIX)
    dtype = replace(options.dtype, dtype="fp32") if options.dtype.defaulted else options.dtype
    return replace(options, mapping=mapping, dtype=dtype)


def make_plan(
    world: World, path: Path, hf: HfCheckpoint, options: HfToDcpOptions, reference: Tensors | None = None
) -> Planned:
    """Every rank: the stash, the mapping and its config, and the plan of every tensor's rows (in the
    `reference`'s dtypes when no --dtype is given)."""
    keys = options.mapping
    found = config_file(keys.config, (path, checkpoint_root(path)) if is_directory(path) else None)
    stash = read_stash(path) if is_directory(path) else []
    model_config = megatron_fsdp.with_tp(load_config(*found), options.megatron_tp)
    key_mapping = mapping_for(keys.mapping, model_config, runtime_layout=options.runtime_layout)

    def planned(mapping: KeyMapping | None) -> DcpSavePlan:
        return plan_hf_to_dcp(
            hf,
            hf_reference.policy(options, reference),
            world_size=world.size,
            prefix=keys.prefix,
            stash=stash,
            mapping=mapping,
            config=model_config,
            allow_unmapped=keys.allow_unmapped,
        )

    plan, said = planned(key_mapping), None
    if reference is not None and not keys.mapping and options.lora_adapter is None:
        # a transformers-5 training job's checkpoint as the reference: its runtime layout, without the flag
        plan, said = family_plan(plan, lambda p: hf_reference.fits(p, reference), model_config, planned)
    if megatron_fsdp.writes_fsdp(key_mapping):
        assert key_mapping is not None
        plan = megatron_fsdp.with_items(plan, model_config, key_mapping)
    elif key_mapping is not None and key_mapping.checkpoint == "megatron":
        plan = megatron_out.with_extra_state(plan)
    notes = () if said is None else (f"written in {said}, as in --reference {options.reference}",)
    return Planned(path, hf, plan, model_config, found, notes)


def tell(ui: Ui, job: Planned) -> None:
    """What the plan found worth saying: its notes and warnings, and what was dequantized."""
    for line in job.notes:
        ui.info(line)
    for warning in job.plan.warnings:
        ui.warn(warning)
    note = dequantized_note(job.plan.tensors)
    if note:
        ui.info(note)


def publish(
    world: World, ui: Ui, job: Planned, target: Target, options: HfToDcpOptions, result: DcpResult
) -> None:
    """Write, check (with --verify) and finish the staging directory, and publish it as OUT."""
    for note in target.notes(world.size):
        ui.info(note)
    resume = resume_state(world, ui, job, options)
    staged = Staging(world, ui, job, options, target, resume)
    check = staged.check if options.output.verify else None
    with gcpause.paused():  # `.metadata` completes a DCP checkpoint: it is published last
        fsync, say = options.output.fsync, ui.warn
        target.publish(
            world, staged.write, staged.finish, check, last=METADATA_FILE, say=say, fsync=fsync, resume=resume
        )
    result.ranks = world.all_gather_object(staged.mine)
    result.written = True
    result.resumed = sorted(resume.kept) if resume is not None and resume.asked else None
