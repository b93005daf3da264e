"""verify's two sides: each checkpoint (DCP directory, HF directory or file, hub repo id) seen as HF-named
tensors with a way to read one whole tensor. A DCP side goes through the same selection and key mapping as
dcp-to-hf, dtypes kept, so a conversion's output is compared with exactly what it was made from."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.core.specs import DcpCheckpoint, HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import is_dcp_dir, open_dcp
from ckptconv.formats.dcp_reader import DcpReader
from ckptconv.formats.hf import open_hf
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.job.world import World
from ckptconv.lora.select import LoraRequest
from ckptconv.mapping import VARIANTS
from ckptconv.mapping.family import mapping_for
from ckptconv.plan.megatron_tp import saved_tp, with_tp
from ckptconv.plan.outs import mapped_tensors
from ckptconv.plan.types import OutTensor, TiedHead
from ckptconv.quant import fp8
from ckptconv.quant.policy import QuantPolicy, encode
from ckptconv.stream import tied
from ckptconv.stream.unshard import assemble, check_read_pieces, direct_rows, expect_rows


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
    # a DCP side's weights seen as they are stored quantized (`encoded`): what verify says of them
    encoded_note: str = ""


def hf_side(
    label: str,
    path: Path,
    keys: set[str] | None = None,
    like: Side | None = None,
    hf: HfCheckpoint | None = None,
    raw: bool = False,
) -> Side:
    """An HF directory or file (or the checkpoint `hf` read from it already: hf-to-dcp's, with an adapter's
    tensors); only `keys` of it if given. A quantized weight (`formats.hf_quant`) is read dequantized, in
    the dtype `shapes` gives it (config.json's, or the other side's after `follow`); with `raw`, every stored
    tensor as it is stored (a quantized weight's values and scales are keys of their own)."""
    hf = hf or open_hf(path, dequantize=not raw)
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
        f"{s.label}: {len(s.dequantized)} quantized weights compared as their dequantized values (as the "
        "format's own dequantizer computes them, in the other side's dtype: docs/quantized.md)"
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
    encoded: Mapping[str, tuple[str, torch.dtype]] | None = None,
) -> Side:
    """A DCP directory seen as dcp-to-hf would write it, dtypes kept. With a mapping and no `variant`, in the
    expert form (per expert or fused) that shares the most keys with the HF side `like`. The `quantized` keys
    (`dcp-to-hf --quantize fp8 --verify`) read as their block-FP8 round trip, dequantize(quantize(w)) in w's
    dtype: what the FP8 output holds, read in this side's dtype, iff its bytes and scales are right. An
    output head tie_word_embeddings leaves out is a key of this side when it differs from its embedding
    (`tied`), unless `drop_untied_head` (then a note says it was left out). `megatron_tp`: the TP size a
    Megatron checkpoint was saved at, where its args do not say (`--megatron-tp`). The `encoded` keys
    (`dcp-to-hf --quantize fp8-block / nvfp4 --verify`: key -> (scheme, the dtype it is quantized in)) are
    seen as the tensors the scheme stores, each quantized from the source as the writer quantizes it: the
    output, read raw (`hf_side(raw=True)`), matches them iff its bytes are the ones intended."""
    ckpt = open_dcp(path)
    config = with_tp(config, saved_tp(ckpt), megatron_tp)  # a Megatron checkpoint's TP size at save
    like_keys = None if like is None else like.shapes.keys()
    outs, heads = dcp_outs(ckpt, prefix, mapping, config, allow_unmapped, variant, like_keys, lora)
    reader = DcpReader(ckpt)
    rows = direct_rows(reader)

    shapes = {k: (t.shape, t.dtype) for k, t in outs.items()}
    parts: dict[str, tuple[str, int]] = {}  # a stored tensor of an encoded weight: (the weight, its index)
    for key, (scheme, dtype) in (encoded or {}).items():
        for i, spec in enumerate(QuantPolicy(scheme).stored(key, outs[key].shape, dtype)):
            parts[spec.key] = (key, i)
            shapes[spec.key] = (spec.shape, spec.dtype)
    last: dict[str, tuple[torch.Tensor, ...]] = {}  # the parts of the weight encoded last (one at a time)

    def read(key: str) -> torch.Tensor:
        if key in parts:
            weight, i = parts[key]
            if weight not in last:
                scheme, dtype = (encoded or {})[weight]
                last.clear()
                last[weight] = encode(scheme, assemble(outs[weight], rows, reader), dtype)
            return last[weight][i]
        tensor = assemble(outs[key], rows, reader)
        if key in quantized:
            q, scale = fp8.quantize_whole(tensor)
            return fp8.dequantize(q, scale, tensor.dtype)
        return tensor

    side = Side(
        label,
        path,
        shapes,
        read,
        reader.close,
        lambda world: check_read_pieces(world, ckpt, reader.pieces()),
        quantized,
        lambda key: expect_rows(reader, outs[parts[key][0] if key in parts else key]),
    )
    if encoded:
        scheme = next(iter(encoded.values()))[0]
        side.encoded_note = f" ({len(encoded)} {scheme} weights as their stored bytes and scales)"

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
