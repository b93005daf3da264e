"""A planned output compared with a reference's tensors (dcp-to-hf's `--reference` / `--copy-from`, an HF
model; hf-to-dcp's `--reference`, a training checkpoint): key set, shapes, dtypes, before a byte is written.
Pure: the caller reads the reference's headers or `.metadata`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckptconv.core.dtype_names import short_name
from ckptconv.plan.types import HfSavePlan, is_scale

Kind = Literal["missing", "extra", "shape", "dtype"]
KINDS: tuple[Kind, ...] = ("missing", "extra", "shape", "dtype")
REFUSING: frozenset[Kind] = frozenset({"missing", "extra", "shape"})  # a dtype difference is only told
Tensors = dict[str, tuple[tuple[int, ...], str]]  # key -> (shape, torch's dtype name: "bfloat16")


@dataclass(frozen=True)
class Difference:
    """One way the planned output differs from the reference."""

    kind: Kind
    """missing: in the reference, not in the output; extra: in the output only; shape; dtype."""
    key: str
    """The HF key."""
    planned: str | None
    """The output's shape or dtype as text (None: the key is not in the output)."""
    reference: str | None
    """The reference's shape or dtype as text (None: the key is not in the reference)."""

    @property
    def refuses(self) -> bool:
        """Whether this difference stops the conversion (without `--allow-layout-change`)."""
        return self.kind in REFUSING

    @property
    def text(self) -> str:
        """One line: `shape of 'lm_head.weight': [8, 4] in OUT, [16, 4] in the reference`."""
        if self.kind == "missing":
            return f"missing {self.key!r} (the reference has it {self.reference}, OUT would not)"
        if self.kind == "extra":
            return f"extra {self.key!r} ({self.planned} in OUT, not in the reference)"
        return f"{self.kind} of {self.key!r}: {self.planned} in OUT, {self.reference} in the reference"

    def to_json(self) -> dict[str, str | None]:
        """The --json report's entry."""
        return {"kind": self.kind, "key": self.key, "planned": self.planned, "reference": self.reference}


def planned_tensors(plan: HfSavePlan) -> Tensors:
    """The output's logical tensors, in file order: a weight written quantized counts as one tensor (its
    `weight_scale_inv` is no key of its own here, as `formats.hf.open_hf` reads a quantized reference)."""
    tensors = (t for f in plan.files for t in f.tensors if not is_scale(t))
    return {t.hf_key: (t.shape, short_name(t.dtype)) for t in tensors}


def compare(planned: Tensors, reference: Tensors, *, dtypes: bool = True) -> list[Difference]:
    """Every difference of `planned` from `reference`, ordered by kind (missing, extra, shape, dtype), then
    by the reference's key order (extra keys: the output's). `dtypes=False` (a `--quantize`d output, whose
    dtypes differ on purpose): dtypes are not compared.

    >>> ref = {"embed.weight": ((8, 4), "bfloat16"), "head.weight": ((8, 4), "bfloat16")}
    >>> out = {"embed.weight": ((8, 4), "float32"), "lm.weight": ((8, 4), "bfloat16")}
    >>> [(d.kind, d.key) for d in compare(out, ref)]
    [('missing', 'head.weight'), ('extra', 'lm.weight'), ('dtype', 'embed.weight')]
    """
    found: list[Difference] = []
    for key, (shape, dtype) in reference.items():
        if key not in planned:
            found.append(Difference("missing", key, None, f"{_shape(shape)} {dtype}"))
    for key, (shape, dtype) in planned.items():
        if key not in reference:
            found.append(Difference("extra", key, f"{_shape(shape)} {dtype}", None))
    for key, (ref_shape, ref_dtype) in reference.items():
        if key not in planned:
            continue
        shape, dtype = planned[key]
        if tuple(shape) != tuple(ref_shape):
            found.append(Difference("shape", key, _shape(shape), _shape(ref_shape)))
        if dtypes and dtype != ref_dtype:
            found.append(Difference("dtype", key, dtype, ref_dtype))
    return sorted(found, key=lambda d: KINDS.index(d.kind))  # stable: key order kept within a kind


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


DCP_TO_HF_FIXES = "--prefix, --mapping or --hf-experts"  # the flags that change dcp-to-hf's keys and shapes


def refusal(
    path: str,
    differences: list[Difference],
    shown: int = 3,
    fixes: str = DCP_TO_HF_FIXES,
    *,
    allow: str = "--allow-layout-change",
    out: str = "OUT",
) -> str | None:
    """The one-line refusal for the differences that refuse (None: none do); `fixes` names the command's
    flags that change the output's keys and shapes, `allow` the one that writes it anyway, `out` the
    output."""
    refusing = [d for d in differences if d.refuses]
    if not refusing:
        return None
    first = "; ".join(d.text for d in refusing[:shown])
    more = f"; and {len(refusing) - shown} more" if len(refusing) > shown else ""
    block = _missing_block(refusing)
    where = f", all of them keys under {block!r} that {out} lacks" if block else ""
    return (
        f"{out} would not match the reference {path}: {len(refusing)} difference(s){where} ({first}{more}); "
        f"fix {fixes}, or pass {allow} to write it anyway"
    )


def _missing_block(refusing: list[Difference]) -> str | None:
    """The dotted prefix every refusing difference's key shares, when they are all keys the output lacks
    (two or more): a block of the reference the source has no part of, such as an MTP block (`mtp.`).

    >>> keys = ["mtp.fc.weight", "mtp.layers.0.mlp.gate.weight", "mtp.norm.weight"]
    >>> _missing_block([Difference("missing", k, None, "[4] bfloat16") for k in keys])
    'mtp.'
    >>> _missing_block([Difference("missing", "a.x", None, "[4] bfloat16")]) is None
    True
    """
    if len(refusing) < 2 or any(d.kind != "missing" for d in refusing):
        return None
    parts = [d.key.split(".")[:-1] for d in refusing]
    common: list[str] = []
    for column in zip(*parts, strict=False):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return ".".join(common) + "." if common else None


def dtype_note(path: str, differences: list[Difference], chosen_by: str = "--dtype and --fp32") -> str | None:
    """One info line for the dtype differences (never refused: `chosen_by`, --dtype/--fp32, choose the
    output's dtypes)."""
    dtyped = [d for d in differences if d.kind == "dtype"]
    if not dtyped:
        return None
    return (
        f"{len(dtyped)} tensor(s) differ in dtype from the reference {path}, e.g. {dtyped[0].text} "
        f"({chosen_by} choose the output's dtypes)"
    )
