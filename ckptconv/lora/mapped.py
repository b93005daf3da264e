"""`--lora adapter` through a mapping: the factors of a weight follow what the mapping does to the weight.
Pure.

A LoRA update B @ A has W's rows from B and W's columns from A, so a mapping that moves whole rows of W moves
the rows of B (and of DoRA's magnitude) and keeps A, and one that moves whole columns moves A's columns and
keeps B:

    rows      T [rows of W, in]  <- W [out, in]:  B_T [rows, r] <- B [out, r] (same rows, order, steps);
              A_T = A [r, in]                      (a rename, a rotary permutation, a split of fused QKV or
                                                   gate/up, an interleaved split)
    columns   T [out, cols of W] <- W [out, in]:  A_T [r, cols] <- A [r, in] (same columns); B_T = B

Then B_T @ A_T is exactly the mapped B @ A (each element the same dot product), so PEFT's merge of the
converted adapter equals the mapped merge. A target made of several weights (a fusion), a reshape, a
transpose, a stacked expert, or a column move of a DoRA weight has no such factors: exit 2 naming it.
"""

from __future__ import annotations

from ckptconv.errors import CkptconvError
from ckptconv.lora.keys import PEFT_PREFIX, Factors
from ckptconv.mapping.parts import Part
from ckptconv.mapping.types import Target, whole


def factor_targets(
    targets: list[Target], factors: dict[str, Factors], shapes: dict[str, tuple[int, ...]]
) -> list[Target]:
    """The adapter's tensors as PEFT names them for the mapped model: for each target made from a targeted
    weight (`factors`: weight key -> its factors, `shapes`: factor key -> shape), its A, B (and magnitude)."""
    out: list[Target] = []
    for t in targets:
        hit = [p for p in t.parts if p.src in factors]
        if not hit:
            continue
        f = factors[hit[0].src]
        if len(hit) != len(t.parts) or len({p.src for p in t.parts}) > 1:
            raise _inexact(t, "is made of several tensors")
        if f.kind != "linear" or t.layout is not None or len(t.shape) != 2 or t.padded:
            if f.kind == "embedding" and len(t.parts) == 1 and t.parts[0].plain and t.layout is None:
                out += _renamed(t, f, shapes)
                continue
            if f.kind == "param":
                raise _inexact(
                    t, f"is an expert of {f.weight!r}, stacked experts adapted by target_parameters"
                )
            raise _inexact(t, f"is made of {f.weight!r} by {t.op} (a reshape, a padding or a stack)")
        if not t.key.endswith(".weight"):
            raise _inexact(t, "is not named NAME.weight")
        cols = shapes[f.a][1]  # W's columns (A is [r, in])
        out += _rows(t, f, shapes) if all(_whole_rows(p, cols) for p in t.parts) else _columns(t, f, shapes)
    return out


def _inexact(t: Target, why: str) -> CkptconvError:
    return CkptconvError(
        f"--lora adapter: {t.key!r} {why}; its LoRA factors have no exact counterpart there "
        "(--lora merge writes the merged weights instead)"
    )


def _key(t: Target, suffix: str) -> str:
    return PEFT_PREFIX + t.key.removesuffix(".weight") + suffix


def _renamed(t: Target, f: Factors, shapes: dict[str, tuple[int, ...]]) -> list[Target]:
    """An embedding the mapping only renames: its factors, renamed (and its base weight, as PEFT saves it)."""
    a, b = shapes[f.a], shapes[f.b]
    return [
        # the base weight is the mapped weight, offset and all: PEFT's merge adds the update to it
        Target(_key(t, ".base_layer.weight"), t.shape, t.parts, t.op, rule=t.rule, offset=t.offset),
        Target(_key(t, ".lora_embedding_A"), a, (whole(f.a, a),), t.op),
        Target(_key(t, ".lora_embedding_B"), b, (whole(f.b, b),), t.op),
    ]


def _whole_rows(p: Part, cols: int) -> bool:
    """The part moves rows of W (of `cols` columns) with all their columns."""
    return (
        p.axes is None
        and p.src_offsets[1] == 0
        and p.dst_offsets[1] == 0
        and p.src_sizes[1] == p.dst_sizes[1] == cols
        and p.step("src", 1) == p.step("dst", 1) == 1
    )


def _rows(t: Target, f: Factors, shapes: dict[str, tuple[int, ...]]) -> list[Target]:
    r = shapes[f.a][0]
    b_parts = tuple(_row_part(p, f.b, (r,)) for p in t.parts)
    out = [
        Target(_key(t, ".lora_A.weight"), shapes[f.a], (whole(f.a, shapes[f.a]),), t.op),
        Target(_key(t, ".lora_B.weight"), (t.shape[0], r), b_parts, t.op),
    ]
    if f.magnitude:
        m_parts = tuple(_row_part(p, f.magnitude, ()) for p in t.parts)
        out.append(Target(_key(t, ".lora_magnitude_vector"), (t.shape[0],), m_parts, t.op))
    return out


def _row_part(p: Part, src: str, rest: tuple[int, ...]) -> Part:
    """`p`'s rows of another tensor whose other dims are `rest` (all of them)."""
    zeros = (0,) * len(rest)
    steps = lambda s: None if s is None else (s[0], *(1,) * len(rest))  # noqa: E731
    return Part(
        src,
        (p.src_offsets[0], *zeros),
        (p.src_sizes[0], *rest),
        (p.dst_offsets[0], *zeros),
        (p.dst_sizes[0], *rest),
        p.perm,
        steps(p.src_steps),
        steps(p.dst_steps),
    )


def _columns(t: Target, f: Factors, shapes: dict[str, tuple[int, ...]]) -> list[Target]:
    out_rows = shapes[f.b][0]
    r = shapes[f.a][0]
    for p in t.parts:
        moves_rows = p.src_offsets[0] != 0 or p.dst_offsets[0] != 0 or p.src_sizes[0] != out_rows
        if p.axes is not None or p.perm is not None or moves_rows or p.dst_sizes[0] != t.shape[0]:
            raise _inexact(t, "takes blocks of W that are neither whole rows nor whole columns")
    if f.magnitude:
        raise _inexact(t, "is a DoRA weight whose columns the mapping moves (its norm runs over whole rows)")
    a_parts = tuple(
        Part(
            f.a,
            (0, p.src_offsets[1]),
            (r, p.src_sizes[1]),
            (0, p.dst_offsets[1]),
            (r, p.dst_sizes[1]),
            None,
            None if p.src_steps is None else (1, p.src_steps[1]),
            None if p.dst_steps is None else (1, p.dst_steps[1]),
        )
        for p in t.parts
    )
    return [
        Target(_key(t, ".lora_A.weight"), (r, t.shape[1]), a_parts, t.op),
        Target(_key(t, ".lora_B.weight"), shapes[f.b], (whole(f.b, shapes[f.b]),), t.op),
    ]
