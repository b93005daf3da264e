"""The command line, frozen: every flag of `dcp-to-hf`, `hf-to-dcp`, `verify` and `inspect` maps to exactly
one field of its options object (ckptconv/options.py), and every field to a flag, but for the few listed
below.

A new flag fails this test until it is listed here with its field (or as a flag of the command alone), and a
new field until it has a flag (or is listed as library-only): the CLI and the library stay one surface.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import typer

from ckptconv.cli.app import app
from ckptconv.cli.build import dcp_to_hf_options, hf_to_dcp_options, inspect_options, verify_options
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
from ckptconv.publish.hub_push import PushRequest

GROUPS: dict[str, type[Any]] = {
    "dtype": DtypeOptions,
    "mapping": MappingOptions,
    "output": OutputOptions,
    "push": PushRequest,
    "lora": LoraRequest,
}

# flags of the command that are not options of the conversion: how the process runs and reports
COMMAND_ONLY = {
    "--trust-pickle",  # how pickles are loaded, for the whole process (cli.render.trust)
    "--storage-options",  # the URL paths' file system, for the whole process (cli.flags.use_storage)
    "--coalesce-gap",  # ditto
    "--quiet",  # what the command prints
    "--progress",
    "--json",
}
# fields with no flag: the library's alone
LIBRARY_ONLY = {
    "wording",  # how messages name options: save_hf / load_hf keep their keyword names
    "dtype.wording",
    "dtype.defaulted",  # whether the command filled in its default dtype (a reference's dtypes then win)
    "shard_bytes",  # derived from max_shard_size / bucket_size / max_file_size
    "bucket_bytes",
    "file_bytes",
}

DCP_TO_HF = {
    "--dtype": "dtype.dtype",
    "--fp32": "dtype.fp32",
    "--max-shard-size": "max_shard_size",
    "--prefix": "mapping.prefix",
    "--copy-from": "copy_from",
    "--reference": "reference",
    "--allow-layout-change": "allow_layout_change",
    "--overwrite": "output.overwrite",
    "--no-fsync": "output.fsync",
    "--resume": "output.resume",
    "--dry-run": "output.dry_run",
    "--bucket-size": "bucket_size",
    "--read": "read_path",
    "--write-granularity": "write_granularity",
    "--mapping": "mapping.mapping",
    "--config": "mapping.config",
    "--allow-unmapped": "mapping.allow_unmapped",
    "--drop-untied-head": "drop_untied_head",
    "--hf-experts": "hf_experts",
    "--keep-trainer-state": "keep_trainer_state",
    "--megatron-tp": "megatron_tp",
    "--keep-file-split": "keep_file_split",
    "--deepspeed-weights": "deepspeed_weights",
    "--file-split": "file_split",
    "--quantize": "quantize",
    "--quantize-skip": "quantize_skip",
    "--verify": "output.verify",
    "--push-to-hub": "push.repo_id",
    "--revision": "push.revision",
    "--private": "push.private",
    "--commit-message": "push.commit_message",
    "--create-pr": "push.create_pr",
    "--lora": "lora.mode",
    "--lora-name": "lora.name",
    "--lora-alpha": "lora.alpha",
    "--lora-config": "lora.config",
    "--lora-rslora": "lora.rslora",
    "--lora-base": "lora.base_model",
    "--lora-targets": "lora.targets",
}
HF_TO_DCP = {
    "--dtype": "dtype.dtype",
    "--fp32": "dtype.fp32",
    "--prefix": "mapping.prefix",
    "--revision": "revision",
    "--mapping": "mapping.mapping",
    "--config": "mapping.config",
    "--allow-unmapped": "mapping.allow_unmapped",
    "--runtime-layout": "runtime_layout",
    "--format": "format",
    "--megatron-gdn": "megatron_gdn",
    "--megatron-tp": "megatron_tp",
    "--overwrite": "output.overwrite",
    "--no-fsync": "output.fsync",
    "--resume": "output.resume",
    "--dry-run": "output.dry_run",
    "--verify": "output.verify",
    "--lora-adapter": "lora_adapter",
    "--lora-name": "lora_name",
    "--reference": "reference",
    "--allow-layout-change": "allow_layout_change",
    "--max-file-size": "max_file_size",
}
VERIFY = {
    "--mapping": "mapping.mapping",
    "--config": "mapping.config",
    "--prefix": "mapping.prefix",
    "--allow-unmapped": "mapping.allow_unmapped",
    "--atol": "atol",
    "--rtol": "rtol",
    "--layout": "layout",
    "--megatron-tp": "megatron_tp",
    "--revision": "revision",
    "--lora": "lora.mode",
    "--lora-name": "lora.name",
    "--lora-alpha": "lora.alpha",
    "--lora-config": "lora.config",
    "--lora-rslora": "lora.rslora",
}
INSPECT = {
    "--revision": "revision",
    "--mapping": "mapping.mapping",
    "--config": "mapping.config",
    "--allow-unmapped": "mapping.allow_unmapped",
    "--explain": "explain",
    "--reference": "reference",
    "--deepspeed-weights": "deepspeed_weights",
}
# per command: fields its flags do not set (verify compares factors: it writes no adapter config; inspect
# shows every key a checkpoint holds)
COMMAND_LIBRARY_ONLY = {"verify": {"lora.base_model", "lora.targets"}, "inspect": {"mapping.prefix"}}


def _flags(command: str) -> dict[str, Any]:
    """The command's flags, by their first name, and its click parameters."""
    group = typer.main.get_command(app)
    params = group.commands[command].params  # type: ignore[attr-defined]
    return {p.opts[0]: p for p in params if p.opts[0].startswith("-")}


def _fields(cls: type[Any]) -> set[str]:
    """Every field of an options class, a group's as `group.field`."""
    out = set()
    for f in dataclasses.fields(cls):
        if f.name in GROUPS:
            out |= {f"{f.name}.{sub.name}" for sub in dataclasses.fields(GROUPS[f.name])}
        else:
            out.add(f.name)
    return out


@pytest.mark.parametrize(
    ("command", "table", "cls"),
    [
        ("dcp-to-hf", DCP_TO_HF, DcpToHfOptions),
        ("hf-to-dcp", HF_TO_DCP, HfToDcpOptions),
        ("verify", VERIFY, VerifyOptions),
        ("inspect", INSPECT, InspectOptions),
    ],
)
def test_every_flag_is_one_options_field(command: str, table: dict[str, str], cls: type[Any]) -> None:
    flags = set(_flags(command))
    assert flags - COMMAND_ONLY == set(table), "a flag was added or removed: list it here with its field"
    assert len(set(table.values())) == len(table), "two flags map to one field"
    fields = _fields(cls)
    assert set(table.values()) <= fields, "a flag maps to no field"
    unflagged = fields - set(table.values()) - LIBRARY_ONLY - COMMAND_LIBRARY_ONLY.get(command, set())
    assert not unflagged, f"fields without a flag: {sorted(unflagged)}"


@pytest.mark.parametrize(
    ("command", "build", "cls"),
    [
        ("dcp-to-hf", dcp_to_hf_options, DcpToHfOptions),
        ("hf-to-dcp", hf_to_dcp_options, HfToDcpOptions),
        ("verify", verify_options, VerifyOptions),
        ("inspect", inspect_options, InspectOptions),
    ],
)
def test_the_flags_defaults_are_the_library_defaults(command: str, build: Any, cls: type[Any]) -> None:
    """A command with no flags given converts as the library function called with no options."""
    group = typer.main.get_command(app)
    defaults = {p.name: p.default for p in group.commands[command].params}  # type: ignore[attr-defined]
    assert build(defaults) == cls()
