"""A tied output head: with `tie_word_embeddings: true` a mapping's `tied` rule leaves the checkpoint's head
out of the release (HF reads it as the embedding). That loses nothing only when the head holds what the
embedding holds; a trained head that differs is refused (`refusal`) unless `--drop-untied-head` says to drop
it.

The comparison is bit for bit, in the checkpoint's dtypes (with `--lora merge`, each side's LoRA merged in),
of the head as its rule would write it untied and the embedding as it is written, a slab of rows at a time:
it never holds either tensor whole. Collective.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp_pieces import RowPiece
from ckptconv.formats.dcp_reader import DcpReader
from ckptconv.job.world import World, everyone
from ckptconv.plan.types import HfSavePlan, OutTensor, TiedHead
from ckptconv.stream.unshard import RowsFn, assemble, check_read_pieces, direct_rows

SLAB_BYTES = 32 * 2**20  # rows of each side compared at a time
FLAG = "--drop-untied-head"


def checked(world: World, ckpt: DcpCheckpoint, plan: HfSavePlan, drop: bool) -> HfSavePlan:
    """Collective, dcp-to-hf before writing: refuse a head the plan leaves out that differs from its
    embedding, or with `drop` (--drop-untied-head) say that it is left out (a warning of the plan's)."""
    outs = {t.hf_key: t for f in plan.files for t in f.tensors}
    different = differing(world, ckpt, plan.tied, outs)
    if different and not drop:
        raise CkptconvError(refusal(different[0], outs), agreed=world.distributed)
    return dataclasses.replace(plan, warnings=plan.warnings + tuple(dropped(h, outs) for h in different))


def differing(
    world: World, ckpt: DcpCheckpoint, heads: Sequence[TiedHead], outs: dict[str, OutTensor]
) -> list[TiedHead]:
    """Collective: the heads that do not hold what the output tensor they are tied to (in `outs`) holds, the
    same list on every rank; each rank compares its share of them."""
    if not heads:
        return []
    share = [i for i in range(len(heads)) if i % world.size == world.rank]
    found, pieces = everyone(world, _compare, ckpt, heads, share, outs)
    check_read_pieces(world, ckpt, pieces)  # the chunks read in slabs, against their CRC-32
    different = sorted({i for part in world.all_gather_object(found) for i in part})
    return [heads[i] for i in different]


def _compare(
    ckpt: DcpCheckpoint, heads: Sequence[TiedHead], share: list[int], outs: dict[str, OutTensor]
) -> tuple[list[int], list[RowPiece]]:
    found = []
    with DcpReader(ckpt) as reader:
        rows = direct_rows(reader)
        for i in share:
            head, embedding = heads[i].head, outs.get(heads[i].embedding)
            if head is None or embedding is None or not _same(head, embedding, rows, reader):
                found.append(i)
        pieces = reader.pieces()
    return found, pieces


def _same(a: OutTensor, b: OutTensor, rows: RowsFn, reader: DcpReader) -> bool:
    """Whether `a` and `b`, assembled in their stored dtypes, hold the same bits (read in slabs of rows)."""
    a, b = _as_stored(a), _as_stored(b)
    if a.shape != b.shape or a.dtype != b.dtype or (a.layout or a.shape) != (b.layout or b.shape):
        return False
    if not a.shape:
        return torch.equal(_bits(assemble(a, rows, reader)), _bits(assemble(b, rows, reader)))
    laid = a.layout or a.shape
    step = max(1, SLAB_BYTES // max(1, math.prod(laid[1:]) * a.work_dtype.itemsize))
    for lo in range(0, laid[0], step):
        window = (lo, min(lo + step, laid[0]))
        x, y = assemble(a, rows, reader, window), assemble(b, rows, reader, window)
        if not torch.equal(_bits(x), _bits(y)):
            return False
    return True


def _as_stored(t: OutTensor) -> OutTensor:
    """`t` in the dtype the checkpoint stores it in, not quantized: what the trainer saved."""
    return dataclasses.replace(t, dtype=t.src.dtype, quant=None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def live_differing(
    world: World, heads: Sequence[TiedHead], outs: dict[str, OutTensor], tensors: dict[str, torch.Tensor]
) -> list[TiedHead]:
    """Collective, `save_hf`: the heads of a live state dict (`tensors`) that differ from the tensor they are
    tied to. A head that is its embedding's own tensor (weights tied in the model) is equal; otherwise each
    rank compares its local blocks of the two (DTensors placed alike, or plain tensors), and the ranks agree.
    A head its rule does not write whole, or placed otherwise than its embedding, counts as differing."""
    mine = [_live_same(h, outs.get(h.embedding), tensors) for h in heads]
    verdicts = world.all_gather_object(mine)
    return [h for i, h in enumerate(heads) if not all(v[i] for v in verdicts)]


def _live_same(head: TiedHead, embedding: OutTensor | None, tensors: dict[str, torch.Tensor]) -> bool:
    a = head.head
    if a is None or embedding is None or a.shape != embedding.shape or a.src.dtype != embedding.src.dtype:
        return False
    if not all(len(t.parts) == 1 and t.parts[0].whole and t.layout is None for t in (a, embedding)):
        return False
    x, y = tensors[a.src.fqn], tensors[embedding.src.fqn]
    if x is y:
        return True
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor) != isinstance(y, DTensor):
        return False
    if isinstance(x, DTensor) and isinstance(y, DTensor):
        if x.placements != y.placements or x.device_mesh != y.device_mesh:
            return False
        x, y = x.to_local(), y.to_local()
    return x.shape == y.shape and bool(torch.equal(x, y))


def refusal(head: TiedHead, outs: dict[str, OutTensor], flag: str = FLAG, config: str = "--config") -> str:
    """The one-line error for a head that differs from its embedding, without `flag` (--drop-untied-head)."""
    return (
        f"config.json's tie_word_embeddings is true, but {_name(head)} differs from {_tied_to(head, outs)}: "
        f"the release would lose the trained head; pass {flag} to drop it anyway, or give a config.json "
        f"whose tie_word_embeddings is false ({config}) to write it"
    )


def dropped(head: TiedHead, outs: dict[str, OutTensor]) -> str:
    """What is said of a head `--drop-untied-head` dropped."""
    return (
        f"{FLAG}: left out {_name(head)}, which differs from {_tied_to(head, outs)} "
        "(tie_word_embeddings: the release's head is the embedding)"
    )


def _name(head: TiedHead) -> str:
    if head.head is None:
        return f"{head.source!r} (which its rule cannot map)"
    return _both(head.head.src.fqn, head.head.hf_key)


def _tied_to(head: TiedHead, outs: dict[str, OutTensor]) -> str:
    embedding = outs.get(head.embedding)
    if embedding is None:
        return f"{head.embedding!r}, which the release does not hold"
    return _both(embedding.src.fqn, head.embedding)


def _both(fqn: str, hf_key: str) -> str:
    """A checkpoint key, and the HF key it maps to when that is another name."""
    return repr(fqn) if fqn == hf_key else f"{fqn!r} (HF {hf_key!r})"
