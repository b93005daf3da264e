"""The tensors dcp-to-hf writes, before any file planning: the checkpoint's tensors selected (`release`),
their LoRA factors dealt with as `--lora` says (`lora`), mapped to HF keys (`mapping`), dtypes resolved.
Pure. `plan.plan_dcp_to_hf` lays them out in files; `verify` compares them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from .dtypes import DtypePolicy
from .errors import CkptconvError
from .formats.dcp import DcpCheckpoint
from .lora.merge import LoraParts
from .lora.select import LoraRequest, Merge, lora_plan
from .mapping.rules import KeyMapping, Part, Target, map_keys
from .release import Selection, select_tensors
from .remote.urls import UrlPath
from .specs import TensorSpec


@dataclass(frozen=True)
class SourcePart:
    """A block of a stored tensor that lands in a block of an output tensor (see mapping.rules.Part)."""

    spec: TensorSpec
    part: Part

    @property
    def whole(self) -> bool:
        """The whole stored tensor, unpermuted, lands at the origin of the output (alone, if shapes match)."""
        p = self.part
        return p.plain and p.src_sizes == self.spec.shape == p.dst_sizes and not any(p.dst_offsets)

    @property
    def nbytes(self) -> int:
        return math.prod(self.part.src_sizes) * self.spec.dtype.itemsize


@dataclass(frozen=True)
class OutTensor:
    hf_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[SourcePart, ...]
    op: str = "rename"
    layout: tuple[int, ...] | None = None  # the shape the parts address (a reshape), when not `shape`
    padded: bool = False  # some elements come from no part: zeros
    quant: str | None = None  # "fp8": assembled in the source dtype, written quantized with its scale
    lora: LoraParts | None = None  # --lora merge: W + scaling * B @ A, assembled in fp32, cast once

    @property
    def work_dtype(self) -> torch.dtype:
        """The dtype the tensor is assembled in: its own, for a quantized one its source's, fp32 to merge."""
        if self.lora is not None:
            return torch.float32
        return self.src.dtype if self.quant else self.dtype

    @property
    def src(self) -> TensorSpec:
        """The (first) stored tensor this one comes from."""
        return self.parts[0].spec

    @property
    def src_nbytes(self) -> int:
        """Bytes read from the checkpoint to make this tensor (its LoRA factors too)."""
        extra = sum(s.nbytes for s in self.lora.specs) if self.lora is not None else 0
        return sum(p.nbytes for p in self.parts) + extra

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _out_tensors(
    ckpt: DcpCheckpoint,
    selection: Selection,
    policy: DtypePolicy,
    mapping: KeyMapping | None,
    config: dict[str, Any],
    allow_unmapped: bool,
) -> tuple[list[OutTensor], list[str]]:
    """Output tensors (HF keys, parts) for the selected checkpoint tensors, mapped when a mapping is given."""
    fqn_of = dict(selection.keys)
    shapes = {key: ckpt.tensors[fqn].shape for key, fqn in selection.keys}
    if mapping is None:
        targets = [
            Target(k, s, (Part(k, (0,) * len(s), s, (0,) * len(s), s),), "rename") for k, s in shapes.items()
        ]
        unmapped: list[str] = []
    else:
        mapped = map_keys(mapping, "to_hf", shapes, config, allow_unmapped=allow_unmapped)
        targets, unmapped = mapped.targets, mapped.unmapped
    outs = []
    for target in targets:
        parts = tuple(SourcePart(ckpt.tensors[fqn_of[p.src]], p) for p in target.parts)
        dtypes = {sp.spec.dtype for sp in parts}
        if len(dtypes) > 1:
            raise CkptconvError(f"{target.key!r} would combine tensors of dtypes {sorted(map(str, dtypes))}")
        dtype = policy.resolve(target.key, parts[0].spec.dtype)
        outs.append(
            OutTensor(target.key, target.shape, dtype, parts, target.op, target.layout, target.padded)
        )
    return outs, unmapped


def mapped_tensors(
    ckpt: DcpCheckpoint,
    policy: DtypePolicy,
    prefix: str | None = None,
    mapping: KeyMapping | None = None,
    config: dict[str, Any] | None = None,
    allow_unmapped: bool = False,
    keep_trainer_state: bool = False,
    lora: LoraRequest | None = None,
) -> tuple[Selection, list[OutTensor], list[str]]:
    """The checkpoint's tensors as HF-named output tensors (selected, mapped, LoRA applied as `lora` says,
    dtypes resolved), before any file planning: what dcp-to-hf writes and what verify compares."""
    selection = select_tensors(ckpt, prefix, keep_trainer_state)
    if not selection.keys:
        raise CkptconvError(f"{ckpt.path}: holds no tensors to convert")
    selection = _with_lora(ckpt, selection, lora)
    if selection.lora is not None and selection.lora.mode == "adapter" and mapping is not None:
        raise CkptconvError(
            "--lora adapter with --mapping: renaming LoRA factors through a mapping is not supported yet; "
            "convert the adapter without --mapping"
        )
    mapped, unmapped = _out_tensors(ckpt, selection, policy, mapping, config or {}, allow_unmapped)
    if selection.lora is not None and selection.lora.merges:
        mapped = _with_merges(mapped, selection.lora.merges, ckpt, dict(selection.lora.sources))
    return selection, mapped, unmapped


def _with_lora(ckpt: DcpCheckpoint, selection: Selection, request: LoraRequest | None) -> Selection:
    """The selection as the `--lora` mode makes it (`lora.select`); unchanged without LoRA factors."""
    fqn_of = dict(selection.keys)
    shapes = {key: ckpt.tensors[fqn].shape for key, fqn in selection.keys}
    local = not isinstance(ckpt.path, UrlPath)
    found = lora_plan(list(fqn_of), shapes, request, ckpt.path, read_trainer_config=local)
    if found is None:
        return selection
    keys = tuple((out, fqn_of[key]) for out, key in found.keys)
    sources = tuple(
        (key, fqn_of[key]) for m in found.merges.values() for key in (m.a, m.b, m.magnitude) if key
    )
    found = dataclasses.replace(found, sources=sources)
    return dataclasses.replace(selection, keys=keys, notes=(*selection.notes, found.note), lora=found)


def _with_merges(
    outs: list[OutTensor], merges: dict[str, Merge], ckpt: DcpCheckpoint, fqn_of: dict[str, str]
) -> list[OutTensor]:
    """Each output tensor made whole from a targeted weight, with its LoRA to merge (`LoraParts`)."""
    done: set[str] = set()
    result = []
    for t in outs:
        hit = [sp for sp in t.parts if sp.part.src in merges]
        if not hit:
            result.append(t)
            continue
        src = hit[0].part.src
        if len(t.parts) > 1 or not hit[0].whole or t.layout is not None or src in done:
            raise CkptconvError(
                f"--lora merge: {src!r} becomes {t.hf_key!r} by {t.op}; merging LoRA into a tensor that the "
                "mapping splits, fuses, permutes or copies is not supported yet"
            )
        done.add(src)
        m = merges[src]
        spec = ckpt.tensors.__getitem__
        magnitude = spec(fqn_of[m.magnitude]) if m.magnitude else None
        experts = t.shape[0] if m.kind.startswith("experts") and t.shape else 1
        lora = LoraParts(spec(fqn_of[m.a]), spec(fqn_of[m.b]), m.kind, m.scaling, magnitude, experts)
        lora.check(src, t.shape)
        result.append(dataclasses.replace(t, lora=lora, op=f"{t.op}+lora_merge"))
    return result
