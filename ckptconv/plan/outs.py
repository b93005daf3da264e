"""The tensors dcp-to-hf writes, before any file planning: the checkpoint's tensors selected (`release`),
their LoRA factors dealt with as `--lora` says (`lora`), mapped to HF keys (`mapping`), dtypes resolved.
Pure. `plan.plan_dcp_to_hf` lays them out in files; `verify` compares them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.lora.keys import PEFT_PREFIX
from ckptconv.lora.mapped import factor_targets
from ckptconv.lora.merge import LoraParts
from ckptconv.lora.select import LoraPlan, LoraRequest, Merge, lora_plan
from ckptconv.lora.settings import mapped_config
from ckptconv.mapping import presets
from ckptconv.mapping.rules import KeyMapping, Part, Target, map_keys
from ckptconv.plan.megatron_tp import check_tp_known
from ckptconv.plan.release import Selection, select_tensors
from ckptconv.plan.shift import check_shift
from ckptconv.plan.types import OutTensor, SourcePart, TiedHead
from ckptconv.remote.urls import UrlPath


def _out_tensors(
    ckpt: DcpCheckpoint,
    selection: Selection,
    policy: DtypePolicy,
    mapping: KeyMapping | None,
    config: dict[str, Any],
    allow_unmapped: bool,
    derive: Callable[[list[Target]], list[Target]] | None = None,
    sources: dict[str, str] | None = None,
    reference: Collection[str] | None = None,
) -> tuple[list[OutTensor], list[str], tuple[TiedHead, ...]]:
    """Output tensors (HF keys, parts) for the selected checkpoint tensors, mapped when a mapping is given;
    `derive` makes other targets of the mapped ones (an adapter's factors), whose parts read `sources`; and
    the heads a tied embedding drops. `reference`: the HF keys of the reference followed (`map_keys`)."""
    fqn_of = dict(selection.keys) | (sources or {})
    shapes = {key: ckpt.tensors[fqn].shape for key, fqn in selection.keys}
    tied: list[tuple[Target | None, str, str]] = []
    if mapping is None:
        targets = [
            Target(k, s, (Part(k, (0,) * len(s), s, (0,) * len(s), s),), "rename") for k, s in shapes.items()
        ]
        unmapped: list[str] = []
    else:
        check_tp_known(mapping, shapes, config)
        mapped = map_keys(
            mapping, "to_hf", shapes, config, allow_unmapped=allow_unmapped, reference=reference
        )
        targets, unmapped, tied = mapped.targets, mapped.unmapped, mapped.tied
    if derive is not None:
        targets = derive(targets)

    def out(target: Target) -> OutTensor:
        parts = tuple(SourcePart(ckpt.tensors[fqn_of[p.src]], p) for p in target.parts)
        dtypes = {sp.spec.dtype for sp in parts}
        if len(dtypes) > 1:
            raise CkptconvError(f"{target.key!r} would combine tensors of dtypes {sorted(map(str, dtypes))}")
        dtype = policy.resolve(target.key, parts[0].spec.dtype)
        check_shift(target, [parts[0].spec.dtype, dtype])
        shape, op, offset = target.shape, target.op, target.offset
        return OutTensor(target.key, shape, dtype, parts, op, target.layout, target.padded, offset=offset)

    heads = tuple(TiedHead(None if t is None else out(t), src, key) for t, src, key in tied)
    return [out(target) for target in targets], unmapped, heads


MEGATRON_KINDS = ("megatron", "fsdp_dtensor")


def unmapped_megatron() -> str:
    """What a Megatron checkpoint converted without a mapping gives, and the presets that map it."""
    names = ", ".join(name for name in presets() if name.startswith("megatron-"))
    return (
        "a Megatron checkpoint without --mapping keeps Megatron's names (decoder.layers.N...), which "
        f"transformers does not load: pass the --mapping of its model, one of {names} (docs/trainers.md)"
    )


def mapped_tensors(
    ckpt: DcpCheckpoint,
    policy: DtypePolicy,
    prefix: str | None = None,
    mapping: KeyMapping | None = None,
    config: dict[str, Any] | None = None,
    allow_unmapped: bool = False,
    keep_trainer_state: bool = False,
    lora: LoraRequest | None = None,
    reference: Collection[str] | None = None,
) -> tuple[Selection, list[OutTensor], list[str]]:
    """The checkpoint's tensors as HF-named output tensors (selected, mapped, LoRA applied as `lora` says,
    dtypes resolved), before any file planning: what dcp-to-hf writes and what verify compares. `reference`:
    the HF keys of the reference dcp-to-hf follows, if any (a mapping writes some copies only where it
    holds them)."""
    selection = select_tensors(ckpt, prefix, keep_trainer_state)
    if not selection.keys:
        raise CkptconvError(f"{ckpt.path}: holds no tensors to convert")
    if mapping is None and ckpt.kind in MEGATRON_KINDS:
        selection = dataclasses.replace(selection, warnings=(*selection.warnings, unmapped_megatron()))
    selection = _with_lora(ckpt, selection, lora, mapped=mapping is not None)
    plan = selection.lora
    if plan is not None and plan.mode == "adapter" and mapping is not None:
        targets = lora.targets if lora is not None else ()
        return _adapter_mapped(ckpt, selection, plan, policy, mapping, config or {}, allow_unmapped, targets)
    mapped, unmapped, tied = _out_tensors(
        ckpt, selection, policy, mapping, config or {}, allow_unmapped, reference=reference
    )
    if selection.lora is not None and selection.lora.merges:
        heads = [h.head for h in tied if h.head is not None]
        merged = _with_merges(mapped + heads, selection.lora.merges, ckpt, dict(selection.lora.sources))
        mapped, with_lora = merged[: len(mapped)], iter(merged[len(mapped) :])
        tied = tuple(h if h.head is None else dataclasses.replace(h, head=next(with_lora)) for h in tied)
    return dataclasses.replace(selection, tied=tied), mapped, unmapped


def _adapter_mapped(
    ckpt: DcpCheckpoint,
    selection: Selection,
    plan: LoraPlan,
    policy: DtypePolicy,
    mapping: KeyMapping,
    config: dict[str, Any],
    allow_unmapped: bool,
    targets: tuple[str, ...],
) -> tuple[Selection, list[OutTensor], list[str]]:
    """`--lora adapter --mapping M`: the base weights mapped, each adapted one's factors following it
    (`lora.mapped`), and the adapter's config saying target_modules / rank_pattern in the mapped names
    (`targets`: `--lora-targets`, which name the mapped modules)."""
    fqn_of = dict(plan.sources)
    base = dataclasses.replace(selection, keys=tuple((k, fqn_of[key]) for k, key in plan.base))
    shapes = {key: ckpt.tensors[fqn].shape for key, fqn in plan.sources}
    names: list[str] = []  # every mapped key: the mapped model's modules

    def derive(targets: list[Target]) -> list[Target]:
        names.extend(t.key for t in targets)
        return factor_targets(targets, plan.factors, shapes)

    # an adapter holds no base weight: a head tie_word_embeddings leaves out is nothing it would lose
    mapped, unmapped, _ = _out_tensors(ckpt, base, policy, mapping, config, allow_unmapped, derive, fqn_of)
    a = ".lora_A.weight"
    ranks = {o.hf_key[len(PEFT_PREFIX) : -len(a)]: o.shape[0] for o in mapped if o.hf_key.endswith(a)}
    modules = {k.removesuffix(".weight") for k in names if k.endswith(".weight")}
    assert plan.config is not None
    plan = dataclasses.replace(plan, config=mapped_config(plan.config, ranks, modules, targets))
    return dataclasses.replace(selection, lora=plan), mapped, unmapped


def _with_lora(
    ckpt: DcpCheckpoint, selection: Selection, request: LoraRequest | None, mapped: bool
) -> Selection:
    """The selection as the `--lora` mode makes it (`lora.select`); unchanged without LoRA factors.
    `mapped`: a mapping renames the modules (`--lora-targets` then names the mapped ones)."""
    fqn_of = dict(selection.keys)
    shapes = {key: ckpt.tensors[fqn].shape for key, fqn in selection.keys}
    local = not isinstance(ckpt.path, UrlPath)
    found = lora_plan(list(fqn_of), shapes, request, ckpt.path, read_trainer_config=local, mapped=mapped)
    if found is None:
        return selection
    keys = tuple((out, fqn_of[key]) for out, key in found.keys)
    factors = [key for m in found.merges.values() for key in (m.a, m.b, m.magnitude) if key]
    factors += [key for f in found.factors.values() for key in (f.a, f.b, f.magnitude) if key]
    factors += [key for _, key in found.base]
    sources = tuple((key, fqn_of[key]) for key in dict.fromkeys(factors))
    found = dataclasses.replace(found, sources=sources)
    return dataclasses.replace(selection, keys=keys, notes=(*selection.notes, found.note), lora=found)


def _with_merges(
    outs: list[OutTensor], merges: dict[str, Merge], ckpt: DcpCheckpoint, fqn_of: dict[str, str]
) -> list[OutTensor]:
    """Each output tensor made from a targeted weight, with its LoRA to merge (`LoraParts`): on the tensor
    when it is the weight as it is (then DoRA too), else on each part reading the weight, whatever the
    mapping does with its blocks (split, permute, unstack, copy): the update is added to the block read."""
    weights = {sp.part.src: sp.spec for t in outs for sp in t.parts if sp.part.src in merges}
    parts: dict[str, LoraParts] = {}
    for src, m in merges.items():
        if src not in weights:
            continue  # a weight the mapping leaves out (--allow-unmapped drops nothing; a rule may)
        spec = weights[src]
        magnitude = ckpt.tensors[fqn_of[m.magnitude]] if m.magnitude else None
        experts = spec.shape[0] if m.kind.startswith("experts") and spec.shape else 1
        a, b = ckpt.tensors[fqn_of[m.a]], ckpt.tensors[fqn_of[m.b]]
        parts[src] = LoraParts(a, b, m.kind, m.scaling, magnitude, experts)
        parts[src].check(src, spec.shape)
    result = []
    for t in outs:
        hit = [sp for sp in t.parts if sp.part.src in parts]
        if not hit:
            result.append(t)
        elif len(t.parts) == 1 and hit[0].whole and t.layout is None:
            lora = parts[hit[0].part.src]
            result.append(dataclasses.replace(t, lora=lora, op=f"{t.op}+lora_merge"))
        else:
            for sp in hit:
                if parts[sp.part.src].magnitude is not None:
                    raise CkptconvError(
                        f"--lora merge: {sp.part.src!r} becomes {t.hf_key!r} by {t.op}; DoRA is merged only "
                        "into a weight the mapping renames (its norm needs whole rows)"
                    )
            with_lora = tuple(dataclasses.replace(sp, lora=parts.get(sp.part.src)) for sp in t.parts)
            result.append(dataclasses.replace(t, parts=with_lora, op=f"{t.op}+lora_merge"))
    return result
