"""The options the `ckptconv` commands share, as typer annotations (one definition, one help text)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


def _local(flag: str) -> Any:
    """A typer callback: a URL given to an option that reads a local file is refused by name (a `Path`
    would take `s3://b/x` for a local `s3:/b/x` and find nothing there)."""

    def check(value: Path | None) -> Path | None:
        from ckptconv.formats.files import refuse_url

        if value is not None:
            refuse_url(value, flag)
        return value

    return check


DTYPE_HELP = "bf16, fp16, fp32 or keep: dtype of floating tensors (int/bool never change)."
DtypeOpt = Annotated[  # hf-to-dcp: with --reference and no --dtype, the reference's dtypes
    str | None,
    typer.Option(
        "--dtype", help=DTYPE_HELP + " [default: keep; --reference's with --reference]", show_default=False
    ),
]
ReleaseDtypeOpt = Annotated[  # dcp-to-hf: an adapter keeps its trained dtype unless told otherwise
    str | None,
    typer.Option(
        "--dtype", help=DTYPE_HELP + " [default: bf16; keep with --lora adapter]", show_default=False
    ),
]
Fp32Opt = Annotated[
    list[str] | None,
    typer.Option(
        "--fp32", help="Regex (RE2) searched in the output key: tensors kept fp32; repeatable; beats --dtype."
    ),
]
MaxShardOpt = Annotated[
    str, typer.Option("--max-shard-size", help="Largest output file, HF notation ('500MB', '5GB') or bytes.")
]
MaxFileOpt = Annotated[
    str,
    typer.Option(
        "--max-file-size",
        help="Largest data file a rank writes (a larger tensor chunk alone in its file), HF notation or "
        "bytes: smaller files keep more of an interrupted run for --resume.",
    ),
]
PrefixOpt = Annotated[
    str | None, typer.Option("--prefix", help="Convert only keys under this prefix, and strip it ('model.').")
]
CopyFromOpt = Annotated[
    Path | None,
    typer.Option(
        "--copy-from",
        help="HF directory or hub repo id (org/name, org/name@revision; the default branch otherwise) whose "
        "config, tokenizer and other files to copy (a repo's weights are never downloaded).",
        callback=_local("--copy-from"),
    ),
]
ReferenceOpt = Annotated[
    Path | None,
    typer.Option(
        "--reference",
        help="HF directory or hub repo id (org/name[@revision]: its index, config.json and headers only) "
        "whose index and safetensors headers OUT must match (keys, shapes), checked before writing; nothing "
        "is copied; its config.json is the mapping's after --config and --copy-from's [default: "
        "--copy-from's, when it holds weights].",
        show_default=False,
        callback=_local("--reference"),
    ),
]
InspectReferenceOpt = Annotated[
    Path | None,
    typer.Option(
        "--reference",
        help="HF directory or hub repo id, org/name[@revision] (the base model), whose index and safetensors "
        "headers PATH's tensors are compared with: keys, shapes, dtypes (a DCP's as --mapping writes them, "
        "with --mapping); the differences are shown, the exit code stays 0.",
        show_default=False,
        callback=_local("--reference"),
    ),
]
AllowLayoutChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-layout-change",
        help="Write OUT even where its keys or shapes differ from --reference (or --copy-from): each "
        "difference a warning.",
    ),
]
DcpReferenceOpt = Annotated[  # hf-to-dcp's: a training checkpoint of the target job
    Path | None,
    typer.Option(
        "--reference",
        help="DCP checkpoint of the target job whose .metadata OUT must match (model tensors' keys, shapes), "
        "checked before writing; without --dtype, its dtypes are OUT's.",
        show_default=False,
        callback=_local("--reference"),
    ),
]
DcpAllowLayoutChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-layout-change",
        help="Write OUT even where its keys or shapes differ from --reference: each difference a warning.",
    ),
]
LayoutOpt = Annotated[
    bool,
    typer.Option(
        "--layout",
        help="Compare layouts only (keys, shapes, dtypes; two HF directories' file split too), reading "
        "headers and .metadata, no tensor bytes.",
    ),
]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an OUT that holds a checkpoint (atomically, at the end); other directories "
        "are refused.",
    ),
]
NoFsyncOpt = Annotated[
    bool,
    typer.Option(
        "--no-fsync",
        help="Scratch work: publish OUT without fsyncing its files and directories first (faster; a power "
        "loss soon after may leave it with empty or short files).",
    ),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Keep the files an interrupted run of the same conversion completed (in S3 also the parts it "
        "sent), checked against their records, and write only the rest; refused when the source or options "
        "changed since.",
    ),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print the plan (files, keys, dtypes, bytes, ranks).")
]
BucketOpt = Annotated[
    str, typer.Option("--bucket-size", help="Bytes in flight per rank while reading or gathering ('128MB').")
]
StorageOptionsOpt = Annotated[
    str | None,
    typer.Option(
        "--storage-options",
        help="URL paths (s3://, gs://, az://): a JSON object of keyword arguments for the backend's file "
        "system (s3fs: key, secret, endpoint_url, client_kwargs, ...); wins over the environment's "
        "variables.",
        show_default=False,
    ),
]
CoalesceGapOpt = Annotated[
    str,
    typer.Option(
        "--coalesce-gap",
        help="URL paths: one request reads across at most this many unneeded bytes between needed ranges "
        "(0: never a byte not needed).",
    ),
]
PushOpt = Annotated[
    str | None,
    typer.Option(
        "--push-to-hub",
        help="After the result is published, upload it to this hub repo (org/name; created when missing).",
        show_default=False,
    ),
]
PushRevisionOpt = Annotated[
    str | None,
    typer.Option("--revision", help="--push-to-hub: the branch to push to (made from main when missing)."),
]
PrivateOpt = Annotated[bool, typer.Option("--private", help="--push-to-hub: a repo it creates is private.")]
CommitMessageOpt = Annotated[
    str | None,
    typer.Option("--commit-message", help="--push-to-hub: the commit's message.", show_default=False),
]
CreatePrOpt = Annotated[
    bool, typer.Option("--create-pr", help="--push-to-hub: open a pull request instead of committing.")
]
ReadOpt = Annotated[
    str, typer.Option("--read", help="direct: writers read chunks from storage; gather: ranks read and send.")
]
WriteGranularityOpt = Annotated[
    str,
    typer.Option(
        "--write-granularity",
        help="tensor: every rank writes its share of every file in place; "
        "file: each file written whole by one rank (storage without concurrent writes to one file).",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Only warnings and errors on stderr.")]
ProgressOpt = Annotated[
    bool | None,
    typer.Option(
        "--progress/--no-progress",
        help="Progress bar (default: on a terminal; log lines every 10 s otherwise).",
    ),
]
RevisionOpt = Annotated[
    str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit) of a repo id.")
]
MappingOpt = Annotated[
    str | None,
    typer.Option(
        "--mapping",
        help="Key mapping: a preset name (docs/mapping.md lists them), 'transformers' (transformers 5's "
        "runtime layout of config.json's model_type) or a TOML file of rules.",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="config.json the mapping reads sizes from (heads, tied embeddings).",
        callback=_local("--config"),
    ),
]
KeepTrainerStateOpt = Annotated[
    bool,
    typer.Option(
        "--keep-trainer-state",
        help="Also stash the dataloader, LR-scheduler, RNG and module extra state (left out by default).",
    ),
]
MegatronTpOpt = Annotated[
    int | None,
    typer.Option(
        "--megatron-tp",
        help="The tensor-parallel size of the Megatron job that saved the checkpoint, where its args do not "
        "say (mapping rules that group fused tensors by it need it).",
        show_default=False,
    ),
]
DeepSpeedWeightsOpt = Annotated[
    str,
    typer.Option(
        "--deepspeed-weights",
        help="A DeepSpeed ZeRO checkpoint's weights: fp32 (the optimizer's master partitions, as "
        "zero_to_fp32.py puts them together) or module (the 16-bit module weights of "
        "mp_rank_00_model_states.pt).",
    ),
]
KeepFileSplitOpt = Annotated[
    bool,
    typer.Option(
        "--keep-file-split",
        help="Write each tensor to the file the source's writer put it in (torch's distributed HF writer, "
        "NeMo Automodel's .hf_metadata) instead of splitting by --max-shard-size.",
    ),
]
FileSplitOpt = Annotated[
    str,
    typer.Option(
        "--file-split",
        help="size: files of at most --max-shard-size; source: the files the source's writer made (as "
        "--keep-file-split); reference: the file --reference's (or --copy-from's) index names for each key.",
    ),
]
QuantizeOpt = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        help="fp8: write linear weights as block FP8 (float8_e4m3fn + weight_scale_inv per 128x128 block), "
        "as DeepSeek-V3 / transformers' fp8 releases do. fp8-block: compressed-tensors' float-quantized "
        "block FP8 (weight_scale per 128x128 block), as llm-compressor's FP8_BLOCK writes it for vLLM. "
        "nvfp4: ModelOpt's NVFP4 (packed E2M1 + float8 weight_scale per 16 values + weight_scale_2), as "
        "vLLM and sglang load it.",
    ),
]
QuantizeSkipOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--quantize-skip",
        help="Regex (repeatable) on the output key: weights left unquantized (besides embeddings, norms, "
        "router gates and lm_head).",
    ),
]
DropUntiedHeadOpt = Annotated[
    bool,
    typer.Option(
        "--drop-untied-head",
        help="With tie_word_embeddings true in config.json, leave out an output head that differs from the "
        "embedding (refused otherwise; --verify says it was left out).",
    ),
]
AllowUnmappedOpt = Annotated[
    bool, typer.Option("--allow-unmapped", help="Pass keys no mapping rule covers through unchanged.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout (rank 0).")]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        help="Load pickled objects outside DCP's own classes (in .metadata or non-tensor items) with a full "
        "unpickler. This runs code from the checkpoint: only for checkpoints you trust.",
    ),
]
VerifyOpt = Annotated[
    bool,
    typer.Option("--verify", help="Re-read the output and compare it with the source before publishing OUT."),
]
ExplainOpt = Annotated[
    str | None,
    typer.Option(
        "--explain",
        help="With --mapping: which rule and operation made KEY (a mapped key or one PATH holds).",
        metavar="KEY",
        show_default=False,
    ),
]


def use_storage(storage_options: str | None, coalesce_gap: str) -> None:
    """Apply `--storage-options` and `--coalesce-gap` to the URL paths of this run."""
    from ckptconv.remote.urls import configure

    if coalesce_gap.strip() == "0":
        gap = 0
    else:
        from ckptconv.core.sizes import parse_size

        gap = parse_size(coalesce_gap, "--coalesce-gap")
    configure(storage_options, gap)


def push_request(
    repo_id: str | None, revision: str | None, private: bool, commit_message: str | None, create_pr: bool
) -> Any:
    """`--push-to-hub` and its flags as a `hub_push.PushRequest` (None without it; its flags then refused)."""
    from ckptconv.errors import CkptconvError
    from ckptconv.publish.hub_push import PushRequest

    if repo_id is None:
        given = [
            f
            for f, v in [
                ("--revision", revision),
                ("--private", private),
                ("--commit-message", commit_message),
                ("--create-pr", create_pr),
            ]
            if v
        ]
        if given:
            raise CkptconvError(f"{given[0]} applies with --push-to-hub REPO_ID")
        return None
    return PushRequest(repo_id, revision, private or None, commit_message, create_pr)


LoraOpt = Annotated[
    str | None,
    typer.Option(
        "--lora",
        help="What to write of a checkpoint holding LoRA factors: adapter (PEFT's adapter_model.safetensors "
        "and adapter_config.json), merge (the model with W + scaling * B @ A) or drop (the base model).",
        show_default=False,
    ),
]
LoraNameOpt = Annotated[
    str | None,
    typer.Option(
        "--lora-name", help="The adapter to convert, when the checkpoint holds several.", show_default=False
    ),
]
LoraAlphaOpt = Annotated[
    float | None,
    typer.Option(
        "--lora-alpha",
        help="The adapter's lora_alpha (scaling = alpha / r), when no --lora-config gives it.",
        show_default=False,
    ),
]
LoraConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--lora-config",
        help="The trainer's PEFT adapter_config.json (default: SRC/adapter_config.json, if present).",
        show_default=False,
        callback=_local("--lora-config"),
    ),
]
LoraRsloraOpt = Annotated[
    bool, typer.Option("--lora-rslora", help="rsLoRA scaling (alpha / sqrt(r)), when no --lora-config says.")
]
LoraBaseOpt = Annotated[
    str | None,
    typer.Option(
        "--lora-base",
        help="base_model_name_or_path for the adapter_config.json that --lora adapter derives.",
        show_default=False,
    ),
]
LoraTargetsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--lora-targets",
        help="target_modules for the adapter_config.json that --lora adapter derives: module names "
        "(comma-separated or repeated) that PEFT matches to exactly the adapted modules (default: their last "
        "names, or a regex of their full names).",
        show_default=False,
    ),
]


LoraAdapterOpt = Annotated[
    str | None,
    typer.Option(
        "--lora-adapter",
        help="A PEFT adapter (directory or hub repo id) to add: the DCP then holds the PEFT-wrapped model's "
        "keys (base_layer, lora_A.NAME, ...), to resume LoRA training from it.",
        show_default=False,
    ),
]
LoraWrapNameOpt = Annotated[
    str,
    typer.Option("--lora-name", help="The adapter's name in the PEFT-wrapped keys (with --lora-adapter)."),
]
