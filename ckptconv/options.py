"""Options objects: what each conversion is asked to do, every check of the values alone made in one place.

The CLI builds them from its flags (`cli.build`), `save_hf` and `load_hf` from their keywords, and the run
steps read them. A value refused here is refused before any work, with one line (exit 2). What needs the file
system or the network (OUT, a `--copy-from` directory, a download) is checked by the step that does that I/O.
Nothing here imports torch: the CLI builds its options before the early `.metadata` read (`source.early`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ckptconv.core.dtype_names import check_dtype_flag
from ckptconv.core.sizes import parse_size
from ckptconv.core.user_regex import UserRegex
from ckptconv.errors import CkptconvError
from ckptconv.lora.select import LoraRequest
from ckptconv.plan.base import FLAG_WORDS, KEYWORD_WORDS, Following, Words
from ckptconv.publish.hub_push import PushRequest
from ckptconv.quant.schemes import check_scheme

if TYPE_CHECKING:
    import torch

    from ckptconv.core.dtypes import DtypePolicy
    from ckptconv.plan.types import Granularity
    from ckptconv.quant.policy import QuantPolicy

ReadPath = Literal["direct", "gather"]  # as stream.hf_write names it
READ_PATHS: tuple[str, ...] = ("direct", "gather")
FILE_SPLITS: tuple[str, ...] = ("size", "source", "reference")  # --file-split
WRITE_GRANULARITIES: tuple[str, ...] = ("tensor", "file")  # the user's choices (a plan also has "parts")
MEGATRON_FORMATS: tuple[str, ...] = ("torch_dist", "fsdp_dtensor")  # hf-to-dcp --format
MEGATRON_GDN: tuple[str, ...] = ("split", "fused")  # hf-to-dcp --megatron-gdn


@dataclass(frozen=True, kw_only=True, slots=True)
class Wording:
    """How the checks' messages name what they refuse: the command's flags, or (`SAVE_HF`, `LOAD_HF`) the
    keywords of a library function, worded as that function always worded them."""

    dtype: str = "--dtype"
    """The name of the dtype option."""
    bucket_size: str = "--bucket-size"
    """The name of the bucket size option."""
    quantize_skip: str = "--quantize-skip applies with --quantize fp8"
    """The message for skip patterns given without quantizing."""
    write_granularity: str = "--write-granularity {!r} is not one of tensor, file"
    """The message for an unknown write granularity (`{!r}`: the value)."""
    reference: Words = FLAG_WORDS
    """How the reference model's steps name their options (`plan.base.Words`)."""


FLAGS = Wording()
SAVE_HF = Wording(
    reference=KEYWORD_WORDS,
    bucket_size="bucket_size",
    quantize_skip="save_hf: quantize_skip applies with quantize='fp8'",
    write_granularity="save_hf: write_granularity={!r} is not one of 'tensor', 'file'",
)
LOAD_HF = Wording(dtype="dtype")


@dataclass(frozen=True, kw_only=True, slots=True)
class DtypeOptions:
    """`--dtype` and `--fp32`: the dtype of each floating output tensor."""

    dtype: str | None = None
    """bf16, fp16, fp32 or keep; None: the command's default (the options object holding this fills it in;
    `load_hf`: each key's promoted dtype)."""
    fp32: tuple[str, ...] = ()
    """Regexes (RE2) searched in the output key: the tensors they match are kept fp32, whatever `dtype`."""
    wording: Wording = field(default=FLAGS, repr=False)
    """How messages name the options (library-only)."""
    defaulted: bool = field(default=False, repr=False, compare=False)
    """`dtype` is the command's default, filled in by the options object, not given (a reference's dtypes
    then win over it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp32", tuple(self.fp32))
        if self.dtype is not None:
            check_dtype_flag(self.dtype, self.wording.dtype)
        for pattern in self.fp32:
            UserRegex(pattern, "--fp32")

    def target(self) -> torch.dtype | None:
        """The torch dtype `dtype` names (None: keep, or no dtype given)."""
        from ckptconv.core.dtypes import parse_dtype_flag

        return None if self.dtype is None else parse_dtype_flag(self.dtype, self.wording.dtype)

    def policy(self, reference: Mapping[str, str] | None = None) -> DtypePolicy:
        """The dtype each output tensor gets (`core.dtypes.DtypePolicy`; imports torch); `reference` (key ->
        dtype name) is followed where no dtype was given."""
        from ckptconv.core.dtypes import DtypePolicy

        if reference is None:
            return DtypePolicy(self.target(), self.fp32)
        return DtypePolicy(self.target(), self.fp32, reference, explicit=not self.defaulted)


def check_deepspeed_weights(which: str) -> None:
    """Refuse a `--deepspeed-weights` other than fp32 or module."""
    if which not in ("fp32", "module"):
        raise CkptconvError(f"--deepspeed-weights {which!r} is not one of fp32, module")


def check_megatron_tp(tp: int | None, job: str = "saving") -> None:
    """`--megatron-tp N` names a TP size (of the `job` that saved or will load the checkpoint): an integer of
    at least 1."""
    if tp is not None and (type(tp) is not int or tp < 1):
        raise CkptconvError(f"--megatron-tp {tp!r}: must be an integer of at least 1 (the {job} job's TP)")


@dataclass(frozen=True, kw_only=True, slots=True)
class MappingOptions:
    """Which keys are converted and what they are called: `--mapping`, its config, `--prefix`."""

    mapping: str | None = None
    """A key mapping: a preset name or a TOML file of rules; None: the keys as they are."""
    config: Path | None = None
    """The config.json the mapping reads sizes from; None: the one found beside the model."""
    allow_unmapped: bool = False
    """Pass keys no mapping rule covers through unchanged (refused otherwise)."""
    prefix: str | None = None
    """dcp-to-hf: convert only the keys under it, stripped; hf-to-dcp: prepended to every key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputOptions:
    """How OUT is written: replaced or not, written at all, checked before it is published, fsynced."""

    overwrite: bool = False
    """Replace an OUT that holds a checkpoint (atomically, at the end); other directories are refused."""
    dry_run: bool = False
    """Plan only: nothing is written."""
    verify: bool = False
    """Re-read the staged output and compare it with the source before publishing OUT."""
    fsync: bool = True
    """Fsync OUT's files and directories before publishing it (False: `--no-fsync`, scratch work)."""
    resume: bool = False
    """Keep the files an interrupted run completed in the staging directory and write only the rest."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpToHfOptions:
    """What `dcp_to_hf` (the `dcp-to-hf` command) and `save_hf` are asked to write."""

    dtype: DtypeOptions = field(default_factory=DtypeOptions)
    """The output dtypes; no dtype given: bf16, or keep with `lora` in adapter mode (its trained dtype)."""
    mapping: MappingOptions = field(default_factory=MappingOptions)
    """The keys converted and their names."""
    output: OutputOptions = field(default_factory=OutputOptions)
    """How OUT is written."""
    max_shard_size: str | int = "5GB"
    """The largest output file, HF notation ('500MB', '5GB') or bytes."""
    bucket_size: str | int = "128MB"
    """Bytes in flight per rank while reading or gathering."""
    read_path: ReadPath = "direct"
    """direct: writers read chunks from storage; gather: ranks read and send."""
    write_granularity: Granularity = "tensor"
    """tensor: every rank writes its share of every file; file: each file written whole by one rank."""
    hf_experts: str | None = None
    """per_expert or fused: how a mapping writes MoE experts (None: the mapping's default)."""
    keep_trainer_state: bool = False
    """Also stash the dataloader, LR-scheduler, RNG and module extra state."""
    megatron_tp: int | None = None
    """The TP size of the Megatron job that saved the checkpoint, where its args do not say (`--megatron-tp`):
    what mapping rules grouping fused tensors by `gdn_tensor_parallel_size` read."""
    keep_file_split: bool = False
    """Write each tensor to the file the source's writer put it in, not split by `max_shard_size` (the same as
    `file_split="source"`)."""
    file_split: str = "size"
    """size: files of at most `max_shard_size`; source: the files the source's writer made; reference: the
    files the reference's index names (`reference`, or `copy_from` holding weights)."""
    quantize: str | None = None
    """fp8: linear weights written as block FP8 (DeepSeek's layout); fp8-block: as compressed-tensors' block
    FP8; nvfp4: as ModelOpt's NVFP4 (`quant.policy`); None: no quantization."""
    quantize_skip: tuple[str, ...] = ()
    """Regexes on the output key: weights left unquantized (with `quantize` only)."""
    copy_from: Path | None = None
    """An HF directory whose config, tokenizer and other files are copied (and, holding weights and no
    `reference` given, the reference the output is compared with)."""
    reference: Path | None = None
    """An HF directory whose index and safetensors headers the planned output must match (key set, shapes;
    dtypes are only told) before anything is written; None: `copy_from`'s, when it holds weights."""
    allow_layout_change: bool = False
    """Write an output that differs from the reference, each difference a warning (refused otherwise)."""
    drop_untied_head: bool = False
    """Leave out an output head that differs from the embedding config.json ties it to (refused otherwise)."""
    deepspeed_weights: str = "fp32"
    """A DeepSpeed ZeRO checkpoint's weights: fp32 (the optimizer's master partitions) or module (the 16-bit
    `module` state dict of mp_rank_00_model_states.pt)."""
    push: PushRequest | None = None
    """After OUT is published, upload it to this hub repo."""
    lora: LoraRequest | None = None
    """What to write of LoRA factors (`lora.select`); None: a checkpoint holding them is refused."""
    wording: Wording = field(default=FLAGS, repr=False)
    """How messages name the options (library-only)."""
    shard_bytes: int = field(init=False, repr=False, compare=False)
    """`max_shard_size` in bytes (derived)."""
    bucket_bytes: int = field(init=False, repr=False, compare=False)
    """`bucket_size` in bytes (derived)."""

    def __post_init__(self) -> None:
        wording = self.wording
        if self.read_path not in READ_PATHS:
            raise CkptconvError(f"--read {self.read_path!r} is not one of direct, gather")
        check_deepspeed_weights(self.deepspeed_weights)
        if self.lora is not None:
            self.lora.check()
        if self.dtype.dtype is None:  # the one place this default lives (the CLI and save_hf share it)
            adapter = self.lora is not None and self.lora.mode == "adapter"
            default = "keep" if adapter else "bf16"
            object.__setattr__(self, "dtype", replace(self.dtype, dtype=default, defaulted=True))
        if self.file_split not in FILE_SPLITS:
            raise CkptconvError(f"--file-split {self.file_split!r} is not one of {', '.join(FILE_SPLITS)}")
        if self.keep_file_split:
            if self.file_split not in ("size", "source"):
                raise CkptconvError(
                    "--keep-file-split is --file-split source; leave it out with "
                    f"--file-split {self.file_split}"
                )
            object.__setattr__(self, "file_split", "source")
        elif self.file_split == "source":
            object.__setattr__(self, "keep_file_split", True)
        if self.lora is not None and self.lora.mode == "merge" and self.read_path == "gather":
            raise CkptconvError("--lora merge reads with --read direct (the default) only, for now")
        object.__setattr__(self, "quantize_skip", tuple(self.quantize_skip))
        if self.quantize_skip and not self.quantize:
            raise CkptconvError(wording.quantize_skip)
        if self.quantize:
            check_scheme(self.quantize)
            for pattern in self.quantize_skip:
                UserRegex(pattern, "--quantize-skip")
        check_megatron_tp(self.megatron_tp)
        if self.write_granularity not in WRITE_GRANULARITIES:
            raise CkptconvError(wording.write_granularity.format(self.write_granularity))
        if self.push is not None:
            self.push.check()
        object.__setattr__(self, "shard_bytes", parse_size(self.max_shard_size))
        object.__setattr__(self, "bucket_bytes", parse_size(self.bucket_size, wording.bucket_size))

    def quant_policy(self) -> QuantPolicy | None:
        """Which output tensors become block FP8 (`quant.policy`; imports torch); None without `quantize`."""
        from ckptconv.quant.policy import QuantPolicy

        return QuantPolicy(self.quantize, self.quantize_skip) if self.quantize else None

    def following(self) -> Following:
        """What is asked of the reference model (`source.reference`): which one, and how it is followed."""
        return Following(
            reference=self.reference,
            copy_from=self.copy_from,
            by_files=self.file_split == "reference",
            adapter=self.lora is not None and self.lora.mode == "adapter",
            allow_layout_change=self.allow_layout_change,
            quantized=bool(self.quantize),
            words=self.wording.reference,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class HfToDcpOptions:
    """What `hf_to_dcp` (the `hf-to-dcp` command) is asked to write."""

    dtype: DtypeOptions = field(default_factory=DtypeOptions)
    """The output dtypes; no dtype given: keep."""
    mapping: MappingOptions = field(default_factory=MappingOptions)
    """The keys converted and their names."""
    output: OutputOptions = field(default_factory=OutputOptions)
    """How OUT is written."""
    revision: str | None = None
    """The hub revision (branch, tag or commit) of a repo id SRC."""
    lora_adapter: str | None = None
    """A PEFT adapter (directory or hub repo id) added: the DCP holds the PEFT-wrapped model's keys."""
    lora_name: str = "default"
    """The adapter's name in the PEFT-wrapped keys (with `lora_adapter`)."""
    reference: Path | None = None
    """A DCP checkpoint of the target job whose `.metadata` the planned DCP must match (model tensors' keys,
    shapes; dtypes only told), checked before anything is written; with no `dtype` given, each floating
    tensor is written in the reference's dtype for its key."""
    allow_layout_change: bool = False
    """Write a DCP that differs from `reference`, each difference a warning (refused otherwise)."""
    runtime_layout: str | None = None
    """The mapping's runtime layout(s) written, comma-separated names (None: each layout group's default)."""
    format: str | None = None
    """A Megatron mapping's checkpoint format: torch_dist or fsdp_dtensor (the layout of its "format" group;
    None: the mapping's default)."""
    megatron_gdn: str | None = None
    """split or fused: the GDN tensors' layout (the mapping's "gdn" layouts gdn-split / gdn-fused)."""
    megatron_tp: int | None = None
    """The tensor-parallel size of the Megatron job that will load the checkpoint: fused GDN tensors are
    grouped by it, the vocabulary padded for it, and fsdp_dtensor's `args` say it."""
    max_file_size: str | int = "4GB"
    """The largest data file a rank writes (`dcp_writer.bins`: a larger tensor chunk alone in its file);
    its files are written a few at a time (CKPTCONV_WRITE_THREADS), so an interrupted run leaves the
    files it finished for `--resume`."""
    file_bytes: int = field(init=False, repr=False, compare=False)
    """`max_file_size` in bytes (derived)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "file_bytes", parse_size(self.max_file_size, "--max-file-size"))
        if self.dtype.dtype is None:  # keep; with a reference, each key its reference's dtype (`policy`)
            # (the run step makes it fp32 for --format fsdp_dtensor: Megatron-FSDP's main weights)
            object.__setattr__(self, "dtype", replace(self.dtype, dtype="keep", defaulted=True))
        self._check_megatron()
        if self.lora_adapter is not None and self.mapping.mapping:
            raise CkptconvError("--lora-adapter with --mapping is not supported yet; leave --mapping out")
        if self.runtime_layout is not None and not self.mapping.mapping:
            raise CkptconvError("--runtime-layout picks a layout of a mapping; pass --mapping too")

    def _check_megatron(self) -> None:
        """--format, --megatron-gdn and --megatron-tp on their own (the mapping's checks: the run step)."""
        for flag, value, known in (
            ("--format", self.format, MEGATRON_FORMATS),
            ("--megatron-gdn", self.megatron_gdn, MEGATRON_GDN),
        ):
            if value is not None and value not in known:
                raise CkptconvError(f"{flag} {value!r} is not one of {', '.join(known)}")
            if value is not None and not self.mapping.mapping:
                raise CkptconvError(f"{flag} applies to a Megatron mapping; pass --mapping too")
        check_megatron_tp(self.megatron_tp, "loading")
        if self.megatron_tp is not None and not self.mapping.mapping:
            raise CkptconvError("--megatron-tp applies to a Megatron mapping; pass --mapping too")
        if self.megatron_gdn == "fused" and self.megatron_tp is None:
            raise CkptconvError(
                "--megatron-gdn fused needs the TP size of the job that will load it: --megatron-tp N"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyOptions:
    """`verify A B`: how the two checkpoints' keys are matched and their values compared."""

    mapping: MappingOptions = field(default_factory=MappingOptions)
    """A DCP side's keys mapped as dcp-to-hf maps them (`prefix`: only the keys under it, stripped)."""
    atol: float | None = None
    """Absolute tolerance: |a-b| <= atol + rtol*|b| in fp32; with `rtol` also None, bit for bit."""
    rtol: float | None = None
    """Relative tolerance (see `atol`)."""
    revision: str | None = None
    """The hub revision of a repo id among A and B."""
    lora: LoraRequest | None = None
    """What to make of LoRA factors on a DCP side (`--lora`: merged as dcp-to-hf merges them, ...)."""
    layout: bool = False
    """Compare layouts only (keys, shapes, dtypes; two HF directories' file split too), reading no tensor
    bytes: the index, safetensors headers and `.metadata`."""
    megatron_tp: int | None = None
    """The TP size of the Megatron job that saved a DCP side, where its args do not say (`--megatron-tp`)."""

    def __post_init__(self) -> None:
        for flag, value in (("--atol", self.atol), ("--rtol", self.rtol)):
            if value is not None and not value >= 0:
                raise CkptconvError(f"{flag} {value}: must be a number >= 0")
            if value is not None and self.layout:
                raise CkptconvError(f"{flag} with --layout: --layout compares no values; leave {flag} out")
        if self.lora is not None:
            self.lora.check()
        check_megatron_tp(self.megatron_tp)

    @property
    def bit_for_bit(self) -> bool:
        """No tolerance given: values must match bit for bit."""
        return self.atol is None and self.rtol is None


@dataclass(frozen=True, kw_only=True, slots=True)
class InspectOptions:
    """`inspect PATH`: which checkpoint is read, and how it is shown mapped."""

    mapping: MappingOptions = field(default_factory=MappingOptions)
    """With `mapping.mapping`: the keys as that mapping writes them too (the mapped view)."""
    revision: str | None = None
    """The hub revision when PATH is a repo id."""
    explain: str | None = None
    """With a mapping: which rule and operation made this key (shown instead of the checkpoint)."""
    reference: Path | None = None
    """An HF directory (the base model) whose index and safetensors headers the checkpoint's tensors are
    compared with (a DCP's as the mapping writes them, with a mapping): keys, shapes, dtypes."""
    deepspeed_weights: str = "fp32"
    """A DeepSpeed ZeRO checkpoint's weights shown: fp32 (the master partitions) or module (16-bit)."""

    def __post_init__(self) -> None:
        check_deepspeed_weights(self.deepspeed_weights)
        if self.explain and not self.mapping.mapping:
            raise CkptconvError("--explain needs --mapping: name the mapping whose rules made the key")
        if self.explain and self.reference is not None:
            raise CkptconvError(
                "--reference: not with --explain, which shows how one key was made; leave one of them out"
            )
