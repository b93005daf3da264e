"""hf-to-dcp with a `duplicate` rule: the HF copies a mapping drops (DeepSeek's per-MTP-layer embedding and
head) must hold the same bytes as the tensor they repeat; a copy that differs is a checkpoint the mapping
does not describe, so the conversion stops before anything is written. Collective."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckptconv.core.specs import HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.job.world import World, everyone

SLAB_BYTES = 32 * 2**20


def check_copies(world: World, hf: HfCheckpoint, same: Sequence[tuple[str, str]]) -> None:
    """Every rank compares its share of the (copy, primary) pairs, a slab of rows at a time; all agree."""
    everyone(world, _compare, hf, [pair for i, pair in enumerate(same) if i % world.size == world.rank])


def _compare(hf: HfCheckpoint, pairs: Sequence[tuple[str, str]]) -> None:
    reader = RowReader()
    for copy, primary in pairs:
        a, b = hf.tensors[copy], hf.tensors[primary]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise CkptconvError(
                f"{hf.path}: {copy!r} should repeat {primary!r} but differs in shape or dtype"
            )
        rows = a.shape[0] if a.shape else 1
        step = max(1, SLAB_BYTES // max(1, a.nbytes // max(rows, 1)))
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            if not torch.equal(_bytes(reader.rows(a, lo, hi)), _bytes(reader.rows(b, lo, hi))):
                raise CkptconvError(
                    f"{hf.path}: {copy!r} differs from {primary!r}, which the mapping says it repeats "
                    f"(rows from {lo}); fix the checkpoint or map the copy with its own rule"
                )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)
