"""The data of a mapping: rules, the mapping, and the targets it makes (each a list of `Part`s). Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ckptconv.errors import CkptconvError
from ckptconv.mapping.parts import Part
from ckptconv.mapping.patterns import Range

Direction = Literal["to_hf", "to_runtime"]


@dataclass(frozen=True)
class Target:
    key: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    op: str  # rename, permute, stack, unstack, split, concat, ... joined with "+"; tied, passthrough
    layout: tuple[int, ...] | None = None  # the shape the parts address, when it differs (a reshape)
    rule: int | None = None  # the rule's number in its mapping file
    offset: float | None = None  # added to every value (a rule's `offset`; negated to runtime), else None

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(p.src for p in self.parts))

    @property
    def padded(self) -> bool:
        """Some elements come from no part (vocabulary padding): they are zeros."""
        return sum(p.numel for p in self.parts) < math.prod(self.layout or self.shape)


@dataclass(frozen=True)
class Rule:
    runtime: tuple[str, ...]
    hf: tuple[str, ...]
    dim: int = 0
    sizes: tuple[int | str, ...] = ()
    stack: str | tuple[str, ...] | None = None  # as written: one placeholder, or several (consecutive dims)
    permute: str | None = None
    drop: bool = False
    tied: str | None = None
    when: str | None = None  # only with this variant ("per_expert" or "fused" HF experts)
    layout: tuple[str, ...] | None = None  # only with these runtime layouts, all ([[mapping.layouts]] names)
    ndim: int | None = None  # the runtime tensor's number of dims, where a layout's key name is not enough
    unbind: bool = False  # the list's tensors are the slices of `dim` (one per key), which they drop
    stack_dim: int | None = None
    heads: int | str | None = None
    transpose: tuple[int, int] | None = None
    interleave: bool = False
    groups: int | str | None = None
    narrow: int | str | None = None
    padded: int | str | None = None
    multiple: int | str | None = None
    hf_shape: tuple[int | str, ...] | None = None
    runtime_shape: tuple[int | str, ...] | None = None
    duplicate: bool = False
    reference_copies: bool = False  # `duplicate = "reference"`: copies only where a reference has them
    hf_groups: int | str | None = None  # the row groups a repeated hf key is laid out in (default 1)
    offset: float | None = None  # HF value = runtime value + offset
    number: int = 0

    @property
    def stacks(self) -> tuple[str, ...]:
        """The stacked placeholders, in the order of their dims (from `stack_dim` on)."""
        if self.stack is None:
            return ()
        return (self.stack,) if isinstance(self.stack, str) else self.stack

    @property
    def fused_is_runtime(self) -> bool:
        return len(self.runtime) == 1

    @property
    def repeated(self) -> bool:
        """The hf list names a key more than once: that key is the concatenation of its pieces."""
        return len(set(self.hf)) < len(self.hf)

    @property
    def hf_keys(self) -> tuple[str, ...]:
        """The hf list with each key once, in order of first mention."""
        return tuple(dict.fromkeys(self.hf))

    @property
    def slots(self) -> tuple[int, ...]:
        """For each entry of the hf list, the index of its key in `hf_keys`."""
        keys = self.hf_keys
        return tuple(keys.index(k) for k in self.hf)

    def ops(self, to_fused: bool) -> list[str]:
        """The operation names, as seen going from the fused tensor (`to_fused` False) or into it."""
        names = []
        if self.narrow is not None:
            names.append("pad" if to_fused else "narrow")
        if self.stack:
            names.append("stack" if to_fused else "unstack")
        if self.transpose:
            names.append("transpose")
        if len(self.hf) > 1 and self.duplicate:
            names.append("duplicate")
        elif max(len(self.hf), len(self.runtime)) > 1:
            if self.unbind:
                names.append("stack-dim" if to_fused else "unbind")
            else:
                kind = "interleave" if self.interleave else "grouped " if self.groups is not None else ""
                names.append(kind.strip() + ("" if not kind else "-") + ("concat" if to_fused else "split"))
            if self.repeated:  # the pieces of a repeated hf key: joined to HF, cut apart from it
                names.append(
                    ("hf-ungroup" if to_fused else "hf-regroup")
                    if self.hf_groups is not None
                    else ("hf-split" if to_fused else "hf-concat")
                )
        if self.hf_shape is not None:
            names.append("reshape")
        if self.permute:
            names.append("permute")
        if self.offset is not None:
            names.append("shift")
        return names or ["rename"]


@dataclass(frozen=True)
class Layout:
    """One way a trainer has stored a family of keys (a `[[mapping.layouts]]` entry): torchtitan 0.3.0's
    separate w1 / w3, a fused w13 with rows interleaved, a stacked w13, ..."""

    name: str
    """What rules (`layout = NAME`) and `--runtime-layout NAME` call it."""
    description: str
    """One line for messages and docs: which trainer version writes it."""
    group: str = "runtime"
    """The family of keys it is a layout of: a source holds one layout of each group."""
    default: bool = False
    """The one of its group hf-to-dcp writes unless `--runtime-layout` names another."""


@dataclass(frozen=True)
class KeyMapping:
    name: str
    rules: tuple[Rule, ...]
    hf_experts: str = "per_expert"  # the variant written to HF; both are read
    variants: tuple[str, ...] = field(default=())
    ranges: tuple[tuple[str, Range], ...] = ()
    defaults: tuple[tuple[str, int], ...] = ()  # config key -> value when config.json lacks it
    checkpoint: str = "dcp"  # what hf-to-dcp writes: a plain DCP, or a Megatron-Core one ("megatron")
    layouts: tuple[Layout, ...] = ()  # the runtime layouts its rules know (none: one layout, untagged)
    runtime_layouts: tuple[str, ...] = ()  # the layouts hf-to-dcp writes (`--runtime-layout`); else defaults

    def written_layouts(self) -> dict[str, str]:
        """Group -> the layout hf-to-dcp writes: the one `--runtime-layout` names, else its default."""
        chosen = {layout.group: layout.name for layout in self.layouts if layout.default}
        by_name = {layout.name: layout for layout in self.layouts}
        for name in self.runtime_layouts:
            chosen[by_name[name].group] = name
        return chosen


@dataclass
class Mapped:
    targets: list[Target]
    unmapped: list[str]
    same: list[tuple[str, str]]  # (copy, primary): HF copies the source must hold equal (duplicate rules)
    # to HF with tie_word_embeddings: (the dropped head as its rule maps it untied, or None when it cannot,
    # its source key, the HF key it is tied to): what the caller checks the head repeats
    tied: list[tuple[Target | None, str, str]] = field(default_factory=list)


def rope_perm(rows: int, heads: int) -> tuple[int, ...]:
    """The rotary row permutation to HF, as torchtitan's Llama adapter `_permute` (and HF's own conversion
    script) apply it: `w.view(heads, half, 2, cols).transpose(1, 2)`; interleaved pairs become halves.

    HF row (h, j, i) is runtime row (h, i, j): head h, pair i < half, j in {0, 1}. perm[hf_row] = runtime_row.
    """
    if heads <= 0 or rows % (2 * heads):
        raise CkptconvError(f"rope permutation: {rows} rows do not split into {heads} heads of even size")
    half = rows // heads // 2
    if not half:  # no rows: nothing to count through, however many heads
        return ()
    return tuple(h * 2 * half + 2 * i + j for h in range(heads) for j in range(2) for i in range(half))


def rope_rows(shape: tuple[int, ...], heads: int, where: str, back: bool = False) -> tuple[int, ...] | None:
    """The rows of a tensor of `shape` under a `permute` rule: `rope_perm` (`inverse` of it, `back`), checked
    against the heads; None for a tensor with no elements, whose rows hold nothing to move (and whose number
    of rows no data backs: a permutation as long as it is never made)."""
    if not shape:
        raise CkptconvError(f"{where}: a rope permutation moves rows, and a 0-d tensor has none")
    if heads <= 0 or shape[0] % (2 * heads):
        raise CkptconvError(f"{where}: {shape[0]} rows do not split into {heads} heads of even size")
    if not math.prod(shape):
        return None
    perm = rope_perm(shape[0], heads)
    return inverse(perm) if back else perm


def inverse(perm: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for r, s in enumerate(perm):
        out[s] = r
    return tuple(out)


def whole(key: str, shape: tuple[int, ...], perm: tuple[int, ...] | None = None) -> Part:
    """All of `key`, as all of its target (optionally with rows permuted)."""
    zeros = (0,) * len(shape)
    return Part(key, zeros, shape, zeros, shape, perm)
