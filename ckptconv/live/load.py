"""load_hf: HF safetensors straight into a live, sharded state dict inside a training job (`live` describes
the state dict's blocks); each rank reads only the rows of its own block from the files."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.errors import CkptconvError
from ckptconv.formats.hf import open_hf
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.live.save import LoadSpec, flatten, local_data
from ckptconv.mapping.family import mapping_for
from ckptconv.options import LOAD_HF, DtypeOptions
from ckptconv.plan.to_hf import plan_hf_to_dcp
from ckptconv.remote import urls
from ckptconv.source.lora import with_adapter
from ckptconv.stream.compose import block_of, expect_block


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the state dict, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the state dict
    replaced: list[str] = field(default_factory=list)  # entry replaced by another dtype's (see load_hf)


def load_hf(
    state_dict: dict[str, Any],
    path: str | Path,
    *,
    mapping: str | None = None,
    dtype: str | None = None,
    fp32: Sequence[str] = (),
    strict: bool = True,
    config: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    lora_adapter: str | Path | None = None,
    lora_name: str = "default",
) -> LoadReport:
    """Fill the tensors of `state_dict` (DTensors with any placements, or plain tensors) from HF safetensors.

    Each rank reads only the rows of its own block. Dtypes: by default a key is loaded as
    `torch.promote_types(checkpoint dtype, target dtype)`; when that is the target's dtype (same dtypes, or a
    wider target) the values are copied into the target in place. When the checkpoint is wider (an fp32
    `A_log` into a bf16 model), the target is not rounded: `state_dict[key]` is replaced by a new tensor of
    the wider dtype (a DTensor with the same mesh and placements) and the key is listed in `replaced`.
    `dtype="bf16"` (or fp16, fp32) instead loads every floating key in that dtype, rounding if need be, and
    keys matching an `fp32` pattern load as fp32; a target of another dtype is replaced the same way.
    A quantized weight (block FP8, MXFP4, compressed-tensors, ModelOpt NVFP4, ...: `formats.hf_quant`,
    docs/quantized.md) counts as config.json's dtype (bf16 when it names none), and each rank reads only its
    block's weight and scale rows, dequantized straight into the dtype loaded as the format's own
    dequantizer computes it.
    `strict` raises on missing or unexpected keys.
    `path` may be a URL (`s3://bucket/model`): each rank lists the prefix, reads the headers and then its
    blocks' bytes by ranged GETs; `storage_options` go to the backend's file system (as `--storage-options`).
    `lora_adapter` (a PEFT adapter directory, repo id or URL) loads the base model and the adapter into a
    PEFT-wrapped model's state dict (`base_layer`, `lora_A.<lora_name>`, ...), as hf-to-dcp's --lora-adapter.
    Not collective: ranks do not talk to each other.
    """
    dtypes = DtypeOptions(dtype=dtype, fp32=tuple(fp32), wording=LOAD_HF)  # None: each key's promoted dtype
    if storage_options is not None:
        urls.use_options(storage_options)
    hf = with_adapter(open_hf(urls.location(path, "load_hf")), lora_adapter, lora_name)
    plan = plan_hf_to_dcp(
        hf,
        DtypePolicy(None),
        world_size=1,
        prefix=None,
        stash=[],
        mapping=mapping_for(mapping, config or {}),
        config=dict(config or {}),
        allow_unmapped=not strict,
    )
    sources = {t.key: t for t in plan.tensors}
    targets = {".".join(p): (p, v) for p, v in flatten(state_dict) if isinstance(v, torch.Tensor)}
    report = LoadReport(
        missing=[k for k in targets if k not in sources], unexpected=[k for k in sources if k not in targets]
    )
    if strict and (report.missing or report.unexpected):
        raise CkptconvError(
            f"load_hf {path}: missing keys {report.missing[:5]}, unexpected keys {report.unexpected[:5]}"
            " (strict=False loads the rest)"
        )
    policy, forced = dtypes.policy(), dtypes.target()  # "keep" forces nothing: each key is promoted
    reader = RowReader()
    specs = {key: LoadSpec.from_tensor(key, target) for key, (_, target) in targets.items() if key in sources}
    for key, spec in specs.items():  # from object storage, neighbouring blocks are fetched together
        expect_block(reader, sources[key], spec.offsets, spec.sizes)
    try:
        for key, (p, target) in targets.items():
            if key not in sources:
                continue
            src, spec = sources[key], specs[key]
            if spec.shape != src.shape:
                raise CkptconvError(
                    f"load_hf: {key!r} is {list(src.shape)} in {path}, {list(spec.shape)} in the state dict"
                )
            if forced is not None or policy.forces_fp32(key):
                want = policy.resolve(key, src.dtype)
            else:
                want = torch.promote_types(src.dtype, spec.dtype)
            # a quantized weight is dequantized straight into `want` (one rounding), and a shifted one (its
            # rule's offset) shifted straight into it; others cast after reading
            quantized = any(stored.quant is not None for stored, _ in src.parts)
            once = quantized or src.offset is not None
            values = block_of(replace(src, dtype=want) if once else src, spec.offsets, spec.sizes, reader)
            local = local_data(target)
            if want == local.dtype:
                with torch.no_grad():
                    local.copy_(values)
            else:
                _replace(state_dict, p, _like(target, values.to(want)))
                report.replaced.append(key)
            report.loaded.append(key)
    finally:
        reader.close()
    return report


def _like(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        return DTensor.from_local(
            local.to(target.to_local().device).contiguous(),
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
    return local.to(target.device).contiguous()


def _replace(state_dict: dict[str, Any], path: tuple[str, ...], value: torch.Tensor) -> None:
    node = state_dict
    for name in path[:-1]:
        node = node[name]
    node[path[-1]] = value
