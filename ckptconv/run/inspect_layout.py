"""`inspect`'s layout lines: the variant a checkpoint holds (`plan/variants.py`) and, with `--reference BASE`,
how its tensors (a DCP's mapped ones with `--mapping`) differ from BASE's safetensors headers. Reads headers
only; the lines are rendered from the --json report's fields."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptconv.core.specs import HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.hf import is_hf_dir
from ckptconv.plan.reference import KINDS, Difference, Tensors, compare
from ckptconv.plan.variants import Seen, detect, line
from ckptconv.source.hub_reference import fetch
from ckptconv.source.reference import open_base

if TYPE_CHECKING:
    from rich.console import Console

    from ckptconv.mapping.types import KeyMapping, Target

SHOWN = 3  # differences of each kind listed in the human output; --json lists every one
FLAG = "--reference"
DCP_DTYPES = "(a DCP's dtypes as stored: dcp-to-hf writes --dtype, bf16 unless told, and --fp32's keys fp32)"


def read_reference(path: Path) -> Tensors:
    """BASE's tensors from its index and headers alone (a quantized weight as its logical tensor, as
    dcp-to-hf's reference check reads it; a hub repo id's by ranged reads, or from the hub cache offline);
    a BASE that is no HF directory is refused naming the flag."""
    hub = fetch(path, FLAG)
    if hub is not None:
        return _tensors(open_base(f"{FLAG} {path}", path, hub))
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise CkptconvError(f"{FLAG} {path}: {what}; name the base model's HF directory")
    if not is_hf_dir(path):
        raise CkptconvError(
            f"{FLAG} {path}: no model.safetensors.index.json or *.safetensors in it; name the base model's "
            "HF directory"
        )
    return _tensors(open_base(f"{FLAG} {path}", path))


def _tensors(hf: HfCheckpoint) -> Tensors:
    return {key: (t.shape, t.dtype_name) for key, t in hf.tensors.items()}


def checkpoint_tensors(info: dict[str, Any], targets: list[Target] | None) -> Tensors:
    """What is compared with BASE: an HF checkpoint's tensors (a quantized one in the dtype it is read in);
    a DCP's as dcp-to-hf takes them, or with a mapping the tensors the mapping writes, in their stored
    dtype."""
    if info["format"] != "dcp":
        return {t["key"]: (tuple(t["shape"]), _logical_dtype(t)) for t in info["tensors"]}
    stored = {t["key"]: t for t in info["tensors"]}
    model: dict[str, str] = info["release"]["model"]  # output key -> checkpoint key
    if targets is None:
        return {key: (tuple(stored[fqn]["shape"]), stored[fqn]["dtype"]) for key, fqn in model.items()}
    return {t.key: (t.shape, stored[model[t.sources[0]]]["dtype"]) for t in targets}


def _logical_dtype(t: dict[str, Any]) -> str:
    q = t.get("quantized")
    return str(t["dtype"] if q is None else q["dequantized_dtype"])


def layout(info: dict[str, Any], mapping: KeyMapping | None, targets: list[Target] | None) -> dict[str, Any]:
    """The report's `layout`: {aspect: its variant's entry} for every aspect the checkpoint shows."""
    shapes = {key: shape for key, (shape, _) in checkpoint_tensors(info, None).items()}
    if mapping is None or targets is None:
        seen = Seen(shapes)
    else:
        mapped = {t.key: t.shape for t in targets}
        dcp = info["format"] == "dcp"
        seen = Seen(
            mapped if dcp else shapes,
            shapes if dcp else mapped,
            mapping,
            targets,
            "to_hf" if dcp else "to_runtime",
        )
    return {v.aspect: v.to_json() for v in detect(seen)}


def reference(
    path: Path, base: Tensors, info: dict[str, Any], targets: list[Target] | None
) -> dict[str, Any]:
    """The report's `reference`: BASE's path, every difference of the checkpoint's tensors from BASE's
    (`plan.reference.compare`, dtypes included), and BASE's own layout."""
    found = compare(checkpoint_tensors(info, targets), base)
    theirs = detect(Seen({key: shape for key, (shape, _) in base.items()}))
    return {
        "path": str(path),
        "differences": [d.to_json() for d in found],
        "layout": {v.aspect: v.to_json() for v in theirs},
    }


def render_layout(info: dict[str, Any], console: Console) -> None:
    """A line per aspect of `info["layout"]` (nothing for a checkpoint that shows none)."""
    for aspect, entry in info.get("layout", {}).items():
        console.print(line(aspect, entry), markup=False)


def render_reference(info: dict[str, Any], console: Console) -> None:
    """`info["reference"]`: the counts per kind, the first differences of each kind, and BASE's layout."""
    doc = info.get("reference")
    if doc is None:
        return
    found = [Difference(**d) for d in doc["differences"]]
    mapped = " (the mapped view)" if info["format"] == "dcp" and "mapped" in info else ""
    if not found:
        console.print(
            f"reference {doc['path']}: no difference in keys, shapes or dtypes{mapped}", markup=False
        )
    else:
        counts = Counter(d.kind for d in found)
        per_kind = ", ".join(f"{counts[k]} {k}" for k in KINDS if counts[k])
        head = f"reference {doc['path']}: {len(found)} difference(s){mapped}: {per_kind}"
        console.print(head, markup=False)
        for kind in KINDS:
            of_kind = [d for d in found if d.kind == kind]
            for d in of_kind[:SHOWN]:
                console.print(f"  {_text(d)}", markup=False)
            if len(of_kind) > SHOWN:
                more = f"  and {len(of_kind) - SHOWN} more {kind} (--json lists every one)"
                console.print(more, markup=False)
        if counts["dtype"] and info["format"] == "dcp":  # a training run's fp32 is not what a release holds
            console.print(f"  {DCP_DTYPES}", markup=False)
    for aspect, entry in doc["layout"].items():
        console.print(line(aspect, entry, "layout of the reference"), markup=False)


def _text(d: Difference) -> str:
    """One difference, the checkpoint's side first (`Difference.text` says OUT: dcp-to-hf's wording)."""
    if d.kind == "missing":
        return f"missing {d.key!r}: the reference has it ({d.reference}), the checkpoint does not"
    if d.kind == "extra":
        return f"extra {d.key!r}: the checkpoint has it ({d.planned}), the reference does not"
    return f"{d.kind} of {d.key!r}: {d.planned} in the checkpoint, {d.reference} in the reference"
