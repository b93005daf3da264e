"""The options objects (`ckptconv.options`) of each command, built from its flags: their checks run before
any work (each refusal one line, exit 2). The commands build them on every rank, inside `everyone`, so that a
refusal under torchrun is said once for the job, as every other error all ranks raise together."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ckptconv.cli.flags import push_request
from ckptconv.errors import CkptconvError
from ckptconv.lora.select import LoraRequest
from ckptconv.options import (
    DcpToHfOptions,
    DtypeOptions,
    HfToDcpOptions,
    InspectOptions,
    MappingOptions,
    OutputOptions,
    VerifyOptions,
)


def _dtype(flags: Mapping[str, Any]) -> DtypeOptions:
    return DtypeOptions(dtype=flags["dtype"] or None, fp32=tuple(flags["fp32"] or ()))


def _mapping(flags: Mapping[str, Any]) -> MappingOptions:
    return MappingOptions(
        mapping=flags["mapping"],
        config=flags["config"],
        allow_unmapped=flags["allow_unmapped"],
        prefix=flags["prefix"],
    )


def _output(flags: Mapping[str, Any]) -> OutputOptions:
    return OutputOptions(
        overwrite=flags["overwrite"],
        dry_run=flags["dry_run"],
        verify=flags["verify"],
        fsync=not flags["no_fsync"],
        resume=flags["resume"],
    )


def _names(values: list[str] | None) -> tuple[str, ...]:
    """A list flag that takes names comma-separated or repeated (`--lora-targets q_proj,v_proj`), blanks
    around them dropped (an empty one is kept, for the options to refuse)."""
    return tuple(name.strip() for value in values or () for name in value.split(","))


def dcp_to_hf_options(flags: Mapping[str, Any]) -> DcpToHfOptions:
    """`dcp-to-hf`'s options from its flags (the command's parameters, by name)."""
    push = push_request(
        flags["push_to_hub"], flags["revision"], flags["private"], flags["commit_message"], flags["create_pr"]
    )
    lora = LoraRequest(
        flags["lora"],
        flags["lora_name"],
        flags["lora_alpha"],
        flags["lora_config"],
        flags["lora_rslora"],
        flags["lora_base"],
        _names(flags["lora_targets"]),
    )  # checked by the options
    return DcpToHfOptions(
        dtype=_dtype(flags),
        mapping=_mapping(flags),
        output=_output(flags),
        max_shard_size=flags["max_shard_size"],
        bucket_size=flags["bucket_size"],
        read_path=flags["read"],
        write_granularity=flags["write_granularity"],
        hf_experts=flags["hf_experts"],
        keep_trainer_state=flags["keep_trainer_state"],
        megatron_tp=flags["megatron_tp"],
        keep_file_split=flags["keep_file_split"],
        file_split=flags["file_split"],
        quantize=flags["quantize"],
        quantize_skip=tuple(flags["quantize_skip"] or ()),
        copy_from=flags["copy_from"],
        reference=flags["reference"],
        allow_layout_change=flags["allow_layout_change"],
        drop_untied_head=flags["drop_untied_head"],
        deepspeed_weights=flags["deepspeed_weights"],
        push=push,
        lora=None if lora == LoraRequest() else lora,  # no --lora flag: as the library's default
    )


def hf_to_dcp_options(flags: Mapping[str, Any]) -> HfToDcpOptions:
    """`hf-to-dcp`'s options from its flags (the command's parameters, by name)."""
    return HfToDcpOptions(
        dtype=_dtype(flags),
        mapping=_mapping(flags),
        output=_output(flags),
        revision=flags["revision"],
        lora_adapter=flags["lora_adapter"],
        lora_name=flags["lora_name"],
        reference=flags["reference"],
        allow_layout_change=flags["allow_layout_change"],
        runtime_layout=flags["runtime_layout"],
        format=flags["format"],
        megatron_gdn=flags["megatron_gdn"],
        megatron_tp=flags["megatron_tp"],
        max_file_size=flags["max_file_size"],
    )


def verify_options(flags: Mapping[str, Any]) -> VerifyOptions:
    """`verify`'s options from its flags (the command's parameters, by name)."""
    lora = LoraRequest(  # checked by the options
        flags["lora"], flags["lora_name"], flags["lora_alpha"], flags["lora_config"], flags["lora_rslora"]
    )
    return VerifyOptions(
        mapping=_mapping(flags),
        atol=flags["atol"],
        rtol=flags["rtol"],
        revision=flags["revision"],
        lora=None if lora == LoraRequest() else lora,  # no --lora flag: as the library's default
        layout=flags["layout"],
        megatron_tp=flags["megatron_tp"],
    )


def inspect_options(flags: Mapping[str, Any]) -> InspectOptions:
    """`inspect`'s options from its flags (the command's parameters, by name)."""
    mapping = MappingOptions(
        mapping=flags["mapping"], config=flags["config"], allow_unmapped=flags["allow_unmapped"]
    )
    return InspectOptions(
        mapping=mapping,
        revision=flags["revision"],
        explain=flags["explain"],
        reference=flags["reference"],
        deepspeed_weights=flags["deepspeed_weights"],
    )


def refuses(build: Callable[[Mapping[str, Any]], object], flags: Mapping[str, Any]) -> bool:
    """Whether `build(flags)` refuses the flags (dcp-to-hf then reads nothing early: the refusal first)."""
    try:
        build(flags)
    except CkptconvError:
        return True
    return False
