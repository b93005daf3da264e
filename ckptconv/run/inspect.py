"""`inspect` as the command runs it: what a checkpoint holds (metadata and headers only), with a mapping its
mapped view too, the layout variant it holds and how it differs from `--reference`, or how one key was made
(`--explain`). Rendering is the CLI's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptconv.formats.deepspeed import deepspeed_weights
from ckptconv.formats.files import is_directory
from ckptconv.formats.hf import checkpoint_root
from ckptconv.mapping import load_config
from ckptconv.mapping.family import mapping_for
from ckptconv.options import InspectOptions
from ckptconv.plan.megatron_tp import with_tp
from ckptconv.remote.urls import location
from ckptconv.run.inspect_layout import layout, read_reference, reference
from ckptconv.run.report import inspect, mapped_targets, mapped_view
from ckptconv.source.hub import download, looks_like_repo_id

if TYPE_CHECKING:
    from ckptconv.mapping.types import KeyMapping, Target
    from ckptconv.plan.reference import Tensors


@dataclass
class Inspected:
    """What `inspect_checkpoint` found."""

    info: dict[str, Any]
    """The checkpoint's description (`report.inspect`), with `mapped` when a mapping was given, `layout` and
    `reference` (but with `--explain`)."""
    explained: dict[str, Any] | None = None
    """`--explain KEY`: the rule and operation that made the key (`explain.explain`)."""


def inspect_checkpoint(path: str, options: InspectOptions = InspectOptions()) -> Inspected:
    """The checkpoint at `path` (a directory, a file, a URL, or a hub repo id) as `options` say."""
    # a bad --reference is refused before SRC is read (or downloaded)
    base = None if options.reference is None else (options.reference, read_reference(options.reference))
    local = download(path, options.revision) if looks_like_repo_id(path) else location(path, "PATH")
    with deepspeed_weights(options.deepspeed_weights):
        info = inspect(local)
    m = options.mapping
    if not m.mapping:
        return Inspected(_laid_out(info, None, None, base))
    beside = (local / "config.json", checkpoint_root(local)) if is_directory(local) else (None, None)
    model_config = load_config(m.config) if m.config else load_config(*beside)
    megatron = info.get("megatron") or {}  # the TP size a Megatron checkpoint was saved at, for its rules
    model_config = with_tp(model_config, megatron.get("tensor_model_parallel_size"), None)
    key_mapping = mapping_for(m.mapping, model_config)
    if key_mapping is None:  # --mapping transformers, a family saved as it runs: nothing to map
        return Inspected(_laid_out(info, None, None, base))
    targets = mapped_targets(info, key_mapping, model_config, m.allow_unmapped).targets
    info["mapped"] = mapped_view(targets)
    if not options.explain:
        return Inspected(_laid_out(info, key_mapping, targets, base))
    from ckptconv.run.explain import explain

    return Inspected(info, explain(key_mapping, targets, options.explain))


def _laid_out(
    info: dict[str, Any],
    mapping: KeyMapping | None,
    targets: list[Target] | None,
    base: tuple[Path, Tensors] | None,
) -> dict[str, Any]:
    """`info` with `layout` (the variants it holds) and `reference` (how it differs from BASE; None: no
    --reference). An HF checkpoint is compared as it is, a DCP with a mapping as the mapping writes it."""
    info["layout"] = layout(info, mapping, targets)
    compared = targets if info["format"] == "dcp" else None
    info["reference"] = None if base is None else reference(*base, info, compared)
    return info
