"""The `ckptconv` command: parse flags, call the library, render results.

Errors become exit codes in `exits.py`.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from typing import Annotated

import typer

from ckptconv.cli import flags as opt
from ckptconv.cli.exits import say_agreed
from ckptconv.cli.flags import (
    AllowUnmappedOpt,
    BucketOpt,
    CoalesceGapOpt,
    CommitMessageOpt,
    ConfigOpt,
    CopyFromOpt,
    CreatePrOpt,
    DryRunOpt,
    DtypeOpt,
    ExplainOpt,
    Fp32Opt,
    JsonOpt,
    KeepFileSplitOpt,
    KeepTrainerStateOpt,
    MappingOpt,
    MaxShardOpt,
    OverwriteOpt,
    PrefixOpt,
    PrivateOpt,
    ProgressOpt,
    PushOpt,
    PushRevisionOpt,
    QuantizeOpt,
    QuantizeSkipOpt,
    QuietOpt,
    ReadOpt,
    RevisionOpt,
    StorageOptionsOpt,
    TrustOpt,
    VerifyOpt,
    WriteGranularityOpt,
    use_storage,
)
from ckptconv.cli.render import print_json as _print_json
from ckptconv.cli.render import trust as _trust
from ckptconv.formats.deepspeed import deepspeed_weights as _deepspeed_weights

app = typer.Typer(
    name="ckptconv",
    help="Convert LLM checkpoints between PyTorch Distributed Checkpoint (DCP) and Hugging Face safetensors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from ckptconv import __version__

        sys.stdout.write(f"ckptconv {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Convert LLM checkpoints between PyTorch Distributed Checkpoint (DCP) and Hugging Face safetensors."""
    from ckptconv.job import env, limits

    env.check_all()  # a bad CKPTCONV_* variable fails before any work, with one line
    limits.check_all()


@app.command("dcp-to-hf")
def dcp_to_hf_cmd(
    src: Annotated[
        str,
        typer.Argument(help="DCP checkpoint directory (with .metadata).", show_default=False, metavar="SRC"),
    ],
    out: Annotated[
        str, typer.Argument(help="Output Hugging Face directory.", show_default=False, metavar="OUT")
    ],
    dtype: opt.ReleaseDtypeOpt = None,
    fp32: Fp32Opt = None,
    max_shard_size: MaxShardOpt = "5GB",
    prefix: PrefixOpt = None,
    copy_from: CopyFromOpt = None,
    reference: opt.ReferenceOpt = None,
    allow_layout_change: opt.AllowLayoutChangeOpt = False,
    overwrite: OverwriteOpt = False,
    no_fsync: opt.NoFsyncOpt = False,
    resume: opt.ResumeOpt = False,
    dry_run: DryRunOpt = False,
    bucket_size: BucketOpt = "128MB",
    read: ReadOpt = "direct",
    write_granularity: WriteGranularityOpt = "tensor",
    mapping: MappingOpt = None,
    config: ConfigOpt = None,
    allow_unmapped: AllowUnmappedOpt = False,
    drop_untied_head: opt.DropUntiedHeadOpt = False,
    hf_experts: Annotated[
        str | None, typer.Option("--hf-experts", help="per_expert or fused: how MoE experts are written.")
    ] = None,
    keep_trainer_state: KeepTrainerStateOpt = False,
    megatron_tp: opt.MegatronTpOpt = None,
    keep_file_split: KeepFileSplitOpt = False,
    deepspeed_weights: opt.DeepSpeedWeightsOpt = "fp32",
    file_split: opt.FileSplitOpt = "size",
    quantize: QuantizeOpt = None,
    quantize_skip: QuantizeSkipOpt = None,
    verify: VerifyOpt = False,
    trust_pickle: TrustOpt = False,
    storage_options: StorageOptionsOpt = None,
    coalesce_gap: CoalesceGapOpt = "1MB",
    push_to_hub: PushOpt = None,
    revision: PushRevisionOpt = None,
    private: PrivateOpt = False,
    commit_message: CommitMessageOpt = None,
    create_pr: CreatePrOpt = False,
    lora: opt.LoraOpt = None,
    lora_name: opt.LoraNameOpt = None,
    lora_alpha: opt.LoraAlphaOpt = None,
    lora_config: opt.LoraConfigOpt = None,
    lora_rslora: opt.LoraRsloraOpt = False,
    lora_base: opt.LoraBaseOpt = None,
    lora_targets: opt.LoraTargetsOpt = None,
    quiet: QuietOpt = False,
    progress: ProgressOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Convert a DCP checkpoint to Hugging Face safetensors (under torchrun: every rank shares the work)."""
    flags = dict(locals())  # the command's parameters by name, for `build`
    from ckptconv.cli.build import dcp_to_hf_options, refuses
    from ckptconv.cli.render import show_dcp_to_hf
    from ckptconv.job.ui import Ui
    from ckptconv.job.world import everyone, world_from_env
    from ckptconv.remote.urls import location
    from ckptconv.source.early import open_early

    source, target = location(src, "SRC"), location(out, "OUT")  # as strings: a Path makes s3: of s3://
    use_storage(storage_options, coalesce_gap)
    with _trust(trust_pickle), _deepspeed_weights(deepspeed_weights):
        early = None
        if not refuses(dcp_to_hf_options, flags):  # a refused flag comes first, with nothing read
            early = open_early(source, None if dry_run else target, overwrite)  # before torch (early_open)
        with world_from_env(say_agreed=say_agreed) as world:
            options = everyone(world, dcp_to_hf_options, flags)  # refused: one line for the job (rank 0)
            from ckptconv.run.dcp_to_hf import dcp_to_hf

            ui = Ui(rank=world.rank, quiet=quiet, progress=progress)
            result = dcp_to_hf(source, target, options, world=world, ui=ui, early=early)
            show_dcp_to_hf(
                result, source, target, world, ui, dry_run=dry_run, verify=verify, json_out=json_out
            )


@app.command("hf-to-dcp")
def hf_to_dcp_cmd(
    src: Annotated[
        str,
        typer.Argument(
            help="HF model directory, .safetensors file, or hub repo id (org/name).",
            show_default=False,
            metavar="SRC",
        ),
    ],
    out: Annotated[
        str, typer.Argument(help="Output DCP checkpoint directory.", show_default=False, metavar="OUT")
    ],
    dtype: DtypeOpt = None,
    fp32: Fp32Opt = None,
    prefix: Annotated[
        str | None, typer.Option("--prefix", help="Prepend this to every key, as nested groups ('model.').")
    ] = None,
    revision: RevisionOpt = None,
    mapping: MappingOpt = None,
    config: ConfigOpt = None,
    allow_unmapped: AllowUnmappedOpt = False,
    reference: opt.DcpReferenceOpt = None,
    allow_layout_change: opt.DcpAllowLayoutChangeOpt = False,
    runtime_layout: Annotated[
        str | None,
        typer.Option(
            "--runtime-layout",
            help="The mapping's runtime layout(s) to write, comma-separated (default: the mapping's).",
        ),
    ] = None,
    format: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="A Megatron mapping's checkpoint format: torch_dist or fsdp_dtensor (Megatron-FSDP) "
            "(default: the mapping's).",
        ),
    ] = None,
    megatron_gdn: Annotated[
        str | None,
        typer.Option(
            "--megatron-gdn",
            help="GDN tensors split (Megatron's torch_dist, dev) or fused by TP rank (Megatron-LM main's "
            "fsdp_dtensor; needs --megatron-tp) (default: the mapping's).",
        ),
    ] = None,
    megatron_tp: Annotated[
        int | None,
        typer.Option(
            "--megatron-tp",
            help="The TP size of the Megatron job that will load it: fused GDN grouping, vocabulary "
            "padding, fsdp_dtensor's args.",
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
    no_fsync: opt.NoFsyncOpt = False,
    resume: opt.ResumeOpt = False,
    dry_run: DryRunOpt = False,
    verify: VerifyOpt = False,
    storage_options: StorageOptionsOpt = None,
    coalesce_gap: CoalesceGapOpt = "1MB",
    max_file_size: opt.MaxFileOpt = "4GB",
    lora_adapter: opt.LoraAdapterOpt = None,
    lora_name: opt.LoraWrapNameOpt = "default",
    quiet: QuietOpt = False,
    progress: ProgressOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Convert a Hugging Face model to a DCP checkpoint that dcp.load reads at any world size."""
    flags = dict(locals())  # the command's parameters by name, for `build`
    from ckptconv.cli.build import hf_to_dcp_options
    from ckptconv.cli.render import show_hf_to_dcp
    from ckptconv.job.ui import Ui
    from ckptconv.job.world import everyone, world_from_env
    from ckptconv.remote.urls import location

    use_storage(storage_options, coalesce_gap)
    target = location(out, "OUT")  # as a string: a Path makes s3: of s3://
    with world_from_env(say_agreed=say_agreed) as world:
        options = everyone(world, hf_to_dcp_options, flags)  # refused: one line for the job (rank 0)
        from ckptconv.run.hf_to_dcp import hf_to_dcp

        ui = Ui(rank=world.rank, quiet=quiet, progress=progress)
        result = hf_to_dcp(src, target, options, world=world, ui=ui)
        show_hf_to_dcp(result, src, target, world, ui, dry_run=dry_run, verify=verify, json_out=json_out)


@app.command("verify")
def verify_cmd(
    a: Annotated[
        str,
        typer.Argument(
            help="DCP dir, HF dir, .safetensors file or hub repo id.", show_default=False, metavar="A"
        ),
    ],
    b: Annotated[
        str, typer.Argument(help="The same kinds, in any combination.", show_default=False, metavar="B")
    ],
    mapping: MappingOpt = None,
    config: ConfigOpt = None,
    prefix: Annotated[
        str | None,
        typer.Option("--prefix", help="DCP sides: compare only keys under this prefix, stripped ('model.')."),
    ] = None,
    allow_unmapped: AllowUnmappedOpt = False,
    megatron_tp: opt.MegatronTpOpt = None,
    atol: Annotated[
        float | None, typer.Option("--atol", help="Absolute tolerance: |a-b| <= atol + rtol*|b| in fp32.")
    ] = None,
    rtol: Annotated[float | None, typer.Option("--rtol", help="Relative tolerance (see --atol).")] = None,
    layout: opt.LayoutOpt = False,
    revision: RevisionOpt = None,
    trust_pickle: TrustOpt = False,
    storage_options: StorageOptionsOpt = None,
    coalesce_gap: CoalesceGapOpt = "1MB",
    lora: opt.LoraOpt = None,
    lora_name: opt.LoraNameOpt = None,
    lora_alpha: opt.LoraAlphaOpt = None,
    lora_config: opt.LoraConfigOpt = None,
    lora_rslora: opt.LoraRsloraOpt = False,
    quiet: QuietOpt = False,
    progress: ProgressOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Compare two checkpoints tensor by tensor: exit 0 when they match, 1 on any mismatch, 2 on bad input."""
    flags = dict(locals())
    from ckptconv.cli.build import verify_options
    from ckptconv.cli.render import show_layout, show_verify
    from ckptconv.job.ui import Ui
    from ckptconv.job.world import world_from_env
    from ckptconv.run.verify import tolerance_of, verify

    options = verify_options(flags)
    use_storage(storage_options, coalesce_gap)
    with _trust(trust_pickle), world_from_env(say_agreed=say_agreed) as world:
        ui = Ui(rank=world.rank, quiet=quiet, progress=progress)
        if options.layout:  # names, shapes, dtypes, file split: headers and .metadata only
            from ckptconv.run.verify_layout import verify_layout

            show_layout(verify_layout(a, b, options, world=world), a, b, world, ui, json_out)
            return
        report = verify(a, b, options, world=world, ui=ui)
        show_verify(report, a, b, world, tolerance_of(options), json_out)


@app.command("inspect")
def inspect_cmd(
    path: Annotated[
        str,
        typer.Argument(
            help="DCP directory, HF directory, .safetensors file or hub repo id.",
            show_default=False,
            metavar="PATH",
        ),
    ],
    revision: RevisionOpt = None,
    mapping: MappingOpt = None,
    config: ConfigOpt = None,
    allow_unmapped: AllowUnmappedOpt = False,
    trust_pickle: TrustOpt = False,
    storage_options: StorageOptionsOpt = None,
    json_out: JsonOpt = False,
    explain: ExplainOpt = None,
    reference: opt.InspectReferenceOpt = None,
    deepspeed_weights: opt.DeepSpeedWeightsOpt = "fp32",
) -> None:
    """Show what a checkpoint holds (reads metadata and headers only); with --mapping, the mapped view too;
    with --reference, how it differs from a base model."""
    flags = dict(locals())
    from rich.console import Console

    from ckptconv.cli.build import inspect_options
    from ckptconv.run.inspect import inspect_checkpoint
    from ckptconv.run.inspect_layout import render_layout, render_reference
    from ckptconv.run.report import render_inspect, render_mapped

    options = inspect_options(flags)
    use_storage(storage_options, "0")
    with _trust(trust_pickle), _deepspeed_weights(deepspeed_weights):
        found = inspect_checkpoint(path, options)
    console = Console(highlight=False, soft_wrap=True)
    if found.explained is not None:
        from ckptconv.run.explain import render_explain

        _print_json(found.explained) if json_out else render_explain(found.explained, console)
        return
    if json_out:
        _print_json(found.info)
        return
    render_inspect(found.info, console)
    if mapping:
        console.print(f"mapped with {mapping}:", markup=False)
        render_mapped(found.info["mapped"], console)
    render_layout(found.info, console)
    render_reference(found.info, console)


def main(argv: list[str] | None = None) -> None:
    """Run the `ckptconv` command on `argv` and exit with its code (see `exits`)."""
    from ckptconv.cli.exits import call

    call(app, argv)


def run() -> None:
    """Entry point of `ckptconv`, `python -m ckptconv` and `torchrun -m ckptconv`: `main`, then exit.

    Once torch is loaded, leave without interpreter teardown: unloading torch takes 0.5-0.9 s (measured),
    paid after the work is done, and under torchrun torch 2.13's gloo threads occasionally abort a finished
    process at teardown ("terminate called without an active exception"), failing a job that succeeded.
    Every file ckptconv writes is closed by then; only stdout and stderr need a flush. The cyclic collector
    stays off for the whole run (see gcpause): turned back on after planning, its first passes would walk the
    million records of a 1 TB plan again (1.5 s measured), in a process that is about to end.
    """
    gc.disable()
    # ckptconv never uses numpy, and a plain install has none: torch's import warns about that otherwise
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            sys.stderr.write(e.code + "\n")
    if "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
