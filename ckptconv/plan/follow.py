"""Planning that follows a reference model (`--reference` / `--copy-from`, save_hf's `reference` /
`copy_from`): its HF expert form, the copies it holds or lacks, its per-key dtypes, and its files
(`--file-split reference`). Pure: the caller reads the reference's index and headers (`Base`) once, on rank 0,
for every rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptconv.core.dtype_names import short_name
from ckptconv.errors import CkptconvError
from ckptconv.mapping.types import KeyMapping
from ckptconv.mapping.variant import hf_variant
from ckptconv.plan.base import Adopted, Base
from ckptconv.plan.types import HfSavePlan, OutTensor, TiedHead

if TYPE_CHECKING:
    import torch

EXTRA_FILE = "model-not-in-reference.safetensors"  # --file-split reference: keys the reference lacks


def copy_group(t: OutTensor) -> tuple[Any, ...]:
    """What an output tensor is made of: two tensors with the same group hold the same data (one copies the
    other, as a mapping's `duplicate` rule writes its copies)."""
    parts = tuple((sp.spec.fqn, sp.part, sp.lora is None) for sp in t.parts)
    return (t.shape, parts, t.op, t.layout, t.padded, t.lora is None)


def follow_copies(
    outs: list[OutTensor], tied: Sequence[TiedHead], base: Base, adopted: Adopted
) -> tuple[list[OutTensor], tuple[TiedHead, ...]]:
    """The output tensors as the reference holds its copies: a tensor that only repeats another written one
    is left out when the reference lacks it (never the last of its group: no distinct data is dropped), and a
    head `tie_word_embeddings` leaves out is written when the reference holds it."""
    groups: dict[tuple[Any, ...], list[OutTensor]] = {}
    for t in outs:
        groups.setdefault(copy_group(t), []).append(t)
    dropped: set[str] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        kept = [t for t in members if t.hf_key in base.tensors]
        if kept:
            dropped.update(t.hf_key for t in members if t.hf_key not in base.tensors)
    adopted.left_out = [t.hf_key for t in outs if t.hf_key in dropped]
    outs = [t for t in outs if t.hf_key not in dropped]
    heads = [h for h in tied if h.head is not None and h.head.hf_key in base.tensors]
    adopted.written = [h.head.hf_key for h in heads if h.head is not None]
    written = [h.head for h in heads if h.head is not None]
    return outs + written, tuple(h for h in tied if h not in heads)


def follow_experts(
    mapping: KeyMapping | None, base: Base | None, config: Mapping[str, Any], chosen: str | None
) -> tuple[KeyMapping | None, str | None]:
    """The mapping writing MoE experts in the reference's HF form (per expert or fused), and that form;
    unchanged, and None, without a reference, without a mapping, with a form `chosen` (`--hf-experts`: the
    check then tells a difference), or when the reference's keys are in no one form."""
    if base is None or mapping is None or chosen is not None:
        return mapping, None
    experts = hf_variant(mapping, base.tensors, config)
    if experts is None:
        return mapping, None
    return dataclasses.replace(mapping, hf_experts=experts), experts


def dtypes_of(base: Base) -> dict[str, str]:
    """key -> the reference's dtype name, for the dtype policy."""
    return {key: dtype for key, (_, dtype) in base.tensors.items()}


def reference_dtypes(base: Base | None, quantized: bool) -> dict[str, str] | None:
    """The reference's dtypes for the dtype policy to follow where no dtype was given (None: no reference,
    or a quantized output, which keeps its own dtypes)."""
    return dtypes_of(base) if base is not None and not quantized else None


def config_dtype(
    plan: HfSavePlan, target: torch.dtype | None, defaulted: bool, quantized: bool
) -> torch.dtype | None:
    """The dtype a copied config.json is made to name: `target` (the dtype given, or the default), or None
    (the one most bytes were written in) when the dtypes were taken from the reference (no dtype given)."""
    followed = plan.adopted is not None and defaulted and not quantized
    return None if followed else target


def kept_dtypes(outs: Iterable[OutTensor], chosen: Iterable[str], adopted: Adopted) -> None:
    """Record in `adopted` the keys written in the reference's dtype where the default would differ."""
    chosen = set(chosen)
    for t in outs:
        if t.hf_key in chosen:
            adopted.dtypes.setdefault(short_name(t.dtype), []).append(t.hf_key)


def split_as_reference(outs: dict[str, OutTensor], base: Base) -> dict[str, list[str]]:
    """{file name: HF keys, in the reference's order}: each tensor in the file the reference puts it in; a
    weight's block FP8 scale the reference lacks beside its weight; keys the reference lacks in `EXTRA_FILE`.
    The reference's files that hold none of the keys written are not written."""
    by_file: dict[str, list[str]] = {}
    for key in base.tensors:
        if key in outs:
            by_file.setdefault(base.files[key], []).append(key)
    extra = []
    for key, t in outs.items():
        if key in base.tensors:
            continue
        if t.scale_of is not None and t.scale_of in base.files:
            by_file[base.files[t.scale_of]].append(key)
        else:
            extra.append(key)
    seen: dict[str, str] = {}
    for name, keys in by_file.items():
        _plain_file_name(name, keys[0], base)
        # on a file system that ignores case (macOS, Windows) two such names are one file: one would be lost
        other = seen.setdefault(name.casefold(), name)
        if other != name:
            words = base.words
            raise CkptconvError(
                f"{words.lead}{words.split_reference}: {base.text} has files {other!r} and {name!r}, one "
                f"file where case is ignored; use {words.split_size}"
            )
    if extra:
        if EXTRA_FILE.casefold() in seen or any(name == EXTRA_FILE for name in base.files.values()):
            words = base.words
            raise CkptconvError(
                f"{words.lead}{words.split_reference}: {base.text} has a file named {EXTRA_FILE}; use "
                f"{words.split_size}"
            )
        by_file[EXTRA_FILE] = extra
    return by_file


# the most bytes a file name may take on Linux and macOS file systems (NAME_MAX)
_NAME_MAX = 255


def _plain_file_name(name: str, key: str, base: Base) -> None:
    """Refuse a file name of the reference that is not a plain `*.safetensors` name in OUT's top directory.

    The names come from BASE's index (or a lone file's own name), which whoever made BASE wrote: each is
    written into OUT as is, so one naming `..`, a subdirectory, a hidden file, or a file that is not a
    weight (config.json, the index, the stash `ckptconv_state.json`, a tokenizer file `--copy-from` copies)
    would write outside OUT or overwrite, or be overwritten by, another file of the release."""
    plain = (
        name.endswith(".safetensors")
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and name.isprintable()
        and len(name.encode("utf-8", "surrogatepass")) <= _NAME_MAX
    )
    if not plain:
        words = base.words
        raise CkptconvError(
            f"{words.lead}{words.split_reference}: {base.text} puts {key!r} in the file {name!r}, which is "
            f"not a plain *.safetensors file name; use {words.split_size}"
        )


def in_reference_order(tensors: Sequence[OutTensor], base: Base) -> tuple[OutTensor, ...]:
    """A file's tensors in the reference's order (a scale just after its weight, extra keys last in the
    order they came)."""
    rank = {key: i for i, key in enumerate(base.tensors)}
    last = len(rank)

    def where(t: OutTensor) -> tuple[int, int]:
        if t.hf_key in rank:
            return rank[t.hf_key], 0
        weight = t.scale_of
        return (rank[weight], 1) if weight is not None and weight in rank else (last, 0)

    return tuple(sorted(tensors, key=where))
