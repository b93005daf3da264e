"""verify: do two checkpoints hold the same tensors? Any format on either side, bit-exact by default.

Each side (DCP directory, HF directory, .safetensors file, hub repo id) is opened as a `Side`: its tensors
under HF key names and a way to read one whole tensor. A DCP side goes through the same selection (the
`model` group, `--prefix`) and key mapping as dcp-to-hf, dtypes kept, so a conversion's output is compared
with exactly what it was made from. Keys are shared out over the ranks (largest first, like output files);
each rank reads and compares its keys one at a time (memory: the tensor pair being compared) and the
findings are gathered on every rank, so the verdict does not depend on the number of ranks.

What matches is `compare.compare`'s rule (bit for bit by default, or a tolerance), applied a slab at a
time: a rank holds the tensor pair it compares plus one slab's temporaries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.core.keyorder import natural_key
from ckptconv.core.specs import DcpCheckpoint, HfCheckpoint
from ckptconv.errors import CkptconvError, VerifyMismatch
from ckptconv.formats.dcp import is_dcp_dir, open_dcp
from ckptconv.formats.dcp_reader import DcpReader
from ckptconv.formats.files import exists
from ckptconv.formats.hf import checkpoint_root, open_hf
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone
from ckptconv.lora.select import LoraRequest
from ckptconv.mapping import VARIANTS, load_config
from ckptconv.mapping.family import mapping_for
from ckptconv.options import VerifyOptions
from ckptconv.plan.megatron_tp import saved_tp, with_tp
from ckptconv.plan.outs import mapped_tensors
from ckptconv.plan.to_hf import assign_owners
from ckptconv.plan.types import OutTensor, TiedHead
from ckptconv.quant import fp8
from ckptconv.remote.urls import is_url
from ckptconv.run.compare import Finding, Tolerance, compare, describe
from ckptconv.source.locate import any_source, for_all
from ckptconv.stream import tied
from ckptconv.stream.unshard import assemble, check_read_pieces, direct_rows, expect_rows


@dataclass
class Report:
    a: str
    b: str
    compared: int
    nbytes: int
    findings: list[Finding]
    tolerance: Tolerance | None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    untied: list[str] = field(default_factory=list)  # of `notes`: tied output heads left out (`tied`)

    @property
    def match(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {
            "command": "verify",
            "a": self.a,
            "b": self.b,
            "match": self.match,
            "compared": self.compared,
            "compared_bytes": self.nbytes,
            "mismatches": [asdict(f) for f in self.findings],
            "tolerance": asdict(self.tolerance) if self.tolerance else None,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
        }


@dataclass
class Side:
    """One checkpoint, seen as HF-named tensors."""

    label: str
    path: Path
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    read: Callable[[str], torch.Tensor]
    close: Callable[[], None]
    check_pieces: Callable[[World], None] = lambda world: None  # collective, after every read
    dequantized: frozenset[str] = frozenset()  # quantized weights: read in the other side's dtype (`follow`)
    expect: Callable[[str], None] = lambda key: None  # this key will be read soon (object storage: coalesce)
    # collective, before comparing: a DCP side's output heads tie_word_embeddings leaves out that differ from
    # their embedding become keys of its own (the other side must hold them), or, dropped, notes
    untied: Callable[[World], list[str]] = lambda world: []


def hf_side(
    label: str,
    path: Path,
    keys: set[str] | None = None,
    like: Side | None = None,
    hf: HfCheckpoint | None = None,
) -> Side:
    """An HF directory or file (or the checkpoint `hf` read from it already: hf-to-dcp's, with an adapter's
    tensors); only `keys` of it if given. A quantized weight (`formats.hf_quant`) is read dequantized, in
    the dtype `shapes` gives it (config.json's, or the other side's after `follow`)."""
    hf = hf or open_hf(path)
    reader = RowReader()
    shapes = {k: (t.shape, t.dtype) for k, t in hf.tensors.items() if keys is None or k in keys}

    def read(key: str) -> torch.Tensor:
        t = hf.tensors[key]
        return reader.rows(t, 0, t.shape[0] if t.shape else 1, dtype=shapes[key][1])

    def expect(key: str) -> None:
        t = hf.tensors[key]
        if t.quant is None:
            reader.expect(t, 0, t.shape[0] if t.shape else 1)

    dequantized = frozenset(k for k in shapes if hf.tensors[k].quant is not None)
    side = Side(label, path, shapes, read, reader.close, dequantized=dequantized, expect=expect)
    if like is not None:
        follow(side, like)
    return side


def follow(side: Side, other: Side) -> None:
    """Read `side`'s quantized weights in the (floating) dtype `other` holds them in: an fp32 DCP made from a
    block-FP8 checkpoint holds the fp32 product, which a bf16 read would round."""
    for key in side.dequantized & other.shapes.keys():
        dtype = other.shapes[key][1]
        if dtype.is_floating_point and dtype.itemsize > 1:
            side.shapes[key] = (side.shapes[key][0], dtype)


def dequantized_notes(*sides: Side) -> list[str]:
    """What `verify`'s report says about the quantized weights it compared."""
    return [
        f"{s.label}: {len(s.dequantized)} quantized weights compared as their dequantized values (the fp32 "
        "product rounded once to the other side's dtype)"
        for s in sides
        if s.dequantized
    ]


def dcp_side(
    label: str,
    path: Path,
    prefix: str | None,
    mapping: str | None,
    config: dict[str, Any],
    allow_unmapped: bool,
    variant: str | None = None,
    like: Side | None = None,
    quantized: frozenset[str] = frozenset(),
    lora: LoraRequest | None = None,
    drop_untied_head: bool = False,
    megatron_tp: int | None = None,
) -> Side:
    """A DCP directory seen as dcp-to-hf would write it, dtypes kept. With a mapping and no `variant`, in the
    expert form (per expert or fused) that shares the most keys with the HF side `like`. The `quantized` keys
    (`dcp-to-hf --quantize fp8 --verify`) read as their block-FP8 round trip, dequantize(quantize(w)) in w's
    dtype: what the FP8 output holds, read in this side's dtype, iff its bytes and scales are right. An
    output head tie_word_embeddings leaves out is a key of this side when it differs from its embedding
    (`tied`), unless `drop_untied_head` (then a note says it was left out). `megatron_tp`: the TP size a
    Megatron checkpoint was saved at, where its args do not say (`--megatron-tp`)."""
    ckpt = open_dcp(path)
    config = with_tp(config, saved_tp(ckpt), megatron_tp)  # a Megatron checkpoint's TP size at save
    like_keys = None if like is None else like.shapes.keys()
    outs, heads = dcp_outs(ckpt, prefix, mapping, config, allow_unmapped, variant, like_keys, lora)
    reader = DcpReader(ckpt)
    rows = direct_rows(reader)

    def read(key: str) -> torch.Tensor:
        tensor = assemble(outs[key], rows, reader)
        if key in quantized:
            q, scale = fp8.quantize_whole(tensor)
            return fp8.dequantize(q, scale, tensor.dtype)
        return tensor

    shapes = {k: (t.shape, t.dtype) for k, t in outs.items()}
    side = Side(
        label,
        path,
        shapes,
        read,
        reader.close,
        lambda world: check_read_pieces(world, ckpt, reader.pieces()),
        quantized,
        lambda key: expect_rows(reader, outs[key]),
    )

    def untied(world: World) -> list[str]:
        notes = []
        for head in tied.differing(world, ckpt, heads, outs):
            if drop_untied_head or head.head is None:
                notes.append(f"{label}: {tied.dropped(head, outs)}")
            else:  # the release must hold it as a key of its own
                outs[head.head.hf_key] = head.head
                shapes[head.head.hf_key] = (head.head.shape, head.head.dtype)
        return notes

    side.untied = untied
    if like is not None:
        follow(like, side)
    return side


def dcp_outs(
    ckpt: DcpCheckpoint,
    prefix: str | None,
    mapping: str | None,
    config: dict[str, Any],
    allow_unmapped: bool,
    variant: str | None = None,
    like: Collection[str] | None = None,
    lora: LoraRequest | None = None,
) -> tuple[dict[str, OutTensor], tuple[TiedHead, ...]]:
    """A DCP checkpoint's tensors as dcp-to-hf would write them, by HF key, dtypes kept, and the output heads
    a tied embedding leaves out. With a mapping and no `variant`, in the expert form (per expert or fused)
    that shares the most keys with the other side's keys `like`. Reads `.metadata` only."""
    forms = VARIANTS if mapping and variant is None and like is not None else (variant,)
    candidates = []
    refused: list[CkptconvError] = []
    for form in forms:
        key_mapping = mapping_for(mapping, config, form)
        try:
            selection, mapped, _ = mapped_tensors(
                ckpt, DtypePolicy(None), prefix, key_mapping, config, allow_unmapped, lora=lora
            )
        except CkptconvError as e:  # keys read into one form only (per-layer experts: per expert)
            refused.append(e)
            continue
        candidates.append(({t.hf_key: t for t in mapped}, selection.tied))
    if not candidates:
        raise refused[0]
    pick = (lambda c: len(c[0].keys() & like)) if like is not None else (lambda c: 0)
    return max(candidates, key=pick)


def open_sides(
    a: Path,
    b: Path,
    *,
    prefix: str | None = None,
    mapping: str | None = None,
    config: dict[str, Any] | None = None,
    allow_unmapped: bool = False,
    lora: LoraRequest | None = None,
    megatron_tp: int | None = None,
) -> tuple[Side, Side]:
    """Both sides; with a mapping, every DCP side is viewed under HF names, in the expert form (per expert or
    fused) of the other side when that is HF."""
    if mapping and not (is_dcp_dir(a) or is_dcp_dir(b)):
        raise CkptconvError("--mapping applies to DCP checkpoints; neither A nor B is one")
    sides: list[Side | None] = [None, None]
    for i, (label, path) in enumerate((("A", a), ("B", b))):
        if not is_dcp_dir(path):
            sides[i] = hf_side(label, path)
    for i, (label, path) in enumerate((("A", a), ("B", b))):
        if is_dcp_dir(path):
            other = sides[1 - i]
            sides[i] = dcp_side(
                label,
                path,
                prefix,
                mapping,
                config or {},
                allow_unmapped,
                like=other,
                lora=lora,
                megatron_tp=megatron_tp,
            )
    assert sides[0] is not None and sides[1] is not None
    follow(sides[0], sides[1])
    follow(sides[1], sides[0])
    return sides[0], sides[1]


def verify_sides(a: Side, b: Side, world: World, ui: Ui, tolerance: Tolerance | None = None) -> Report:
    """Collective: compare every key (this rank's share, with a progress display); the same `Report` on every
    rank."""
    start = time.perf_counter()
    untied = a.untied(world) + b.untied(world)
    keys = sorted(a.shapes.keys() | b.shapes.keys(), key=natural_key)
    findings = [
        Finding(k, "only_in_a" if k in a.shapes else "only_in_b", _side(a, k), _side(b, k))
        for k in keys
        if (k in a.shapes) != (k in b.shapes)
    ]
    common = [k for k in keys if k in a.shapes and k in b.shapes]
    sizes = [max(_nbytes(a, k), _nbytes(b, k)) for k in common]
    owners = assign_owners(sizes, world.size)
    own = [k for k, owner in zip(common, owners, strict=True) if owner == world.rank]
    mine: list[Finding] = []
    error: Exception | None = None
    progress_label = f"rank {world.rank} of {world.size}: verifying"
    with ui.bytes_progress(progress_label, sum(_nbytes(b, k) for k in own)) as progress:
        try:
            for key in own:  # from object storage, neighbouring tensors are then fetched together
                a.expect(key)
                b.expect(key)
            for key in own:
                if a.shapes[key][0] != b.shapes[key][0]:
                    mine.append(Finding(key, "shape", _side(a, key), _side(b, key)))
                    continue
                finding = compare(key, a.read(key), b.read(key), tolerance)
                if finding is not None:
                    mine.append(finding)
                progress.advance(_nbytes(b, key))
        except Exception as e:  # every rank must reach the gather below
            error = e
    world.agree(error)
    a.check_pieces(world)  # chunks read in pieces (split experts) against their CRC-32
    b.check_pieces(world)
    for part in world.all_gather_object(mine):
        findings.extend(part)
    order = {k: i for i, k in enumerate(keys)}
    findings.sort(key=lambda f: order[f.key])
    seconds = time.perf_counter() - start
    notes = dequantized_notes(a, b) + untied
    nbytes = sum(sizes)
    return Report(str(a.path), str(b.path), len(common), nbytes, findings, tolerance, seconds, notes, untied)


def _side(side: Side, key: str) -> dict[str, Any] | None:
    if key not in side.shapes:
        return None
    shape, dtype = side.shapes[key]
    return describe(shape, dtype)


def _nbytes(side: Side, key: str) -> int:
    shape, dtype = side.shapes[key]
    return math.prod(shape) * dtype.itemsize


def verify(
    a: str, b: str, options: VerifyOptions = VerifyOptions(), *, world: World, ui: Ui
) -> Report:
    """Collective: compare checkpoint `a` with `b` (paths or hub repo ids) as `options` say. Rank 0
    downloads repo ids."""
    mapping = options.mapping
    path_a, path_b = locate(world, a, b, options)

    def prepare() -> tuple[Side, Side]:
        return open_sides(
            path_a,
            path_b,
            prefix=mapping.prefix,
            mapping=mapping.mapping,
            config=model_config(path_a, path_b, options),
            allow_unmapped=mapping.allow_unmapped,
            lora=options.lora,
            megatron_tp=options.megatron_tp,
        )

    side_a, side_b = everyone(world, prepare)
    try:
        return verify_sides(side_a, side_b, world, ui, tolerance_of(options))
    finally:
        side_a.close()
        side_b.close()


def locate(world: World, a: str, b: str, options: VerifyOptions) -> tuple[Path, Path]:
    """Collective: where A and B are (rank 0 downloads hub repo ids, `--revision` for those among them)."""

    def where(src: str) -> Path:
        return any_source(src, None if exists(Path(src)) or is_url(src) else options.revision)

    return for_all(world, lambda: (where(a), where(b)))


def model_config(path_a: Path, path_b: Path, options: VerifyOptions) -> dict[str, Any]:
    """The model config a mapping reads: `--config`, else the config.json beside A, else beside B."""
    config = options.mapping.config
    beside = ((p / "config.json", checkpoint_root(p)) for p in (path_a, path_b) if exists(p / "config.json"))
    found = (config, None) if config else next(beside, (None, None))
    return load_config(*found)


def tolerance_of(options: VerifyOptions) -> Tolerance | None:
    """The tolerance `options` give (None: bit for bit)."""
    return None if options.bit_for_bit else Tolerance(options.atol or 0.0, options.rtol or 0.0)


def check_output(source: Side, output: Side, world: World, ui: Ui) -> None:
    """Collective, for `--verify`: raise VerifyMismatch (exit 1) unless `output` holds `source`'s tensors."""
    try:
        report = verify_sides(source, output, world, ui)
    finally:
        source.close()
        output.close()
    if not report.match:
        first, more = report.findings[0], len(report.findings) - 1
        raise VerifyMismatch(
            f"--verify: the output differs from {source.path}: {first.line()}"
            + (f" (and {more} more)" if more else "")
            + "; nothing was written"
        )
    quantized = f" ({len(source.dequantized)} FP8 weights as the source's block-FP8 round trip)"
    ui.info(
        f"verified: {report.compared} tensors match the source bit for bit"
        + (quantized if source.dequantized else "")
        + "".join(f"; {note}" for note in report.untied)
    )
