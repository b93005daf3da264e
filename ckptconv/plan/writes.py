"""Pure: which rank writes which bytes of the output files (dcp-to-hf and save_hf).

Every file's header and size are fixed by the plan, so a file can be written by any number of ranks at once,
each `pwrite`-ing its ranges in place. Two granularities:

- "tensor" (default): the files' data, in file order, is one stream of bytes cut into `world_size`
  contiguous ranges of equal size; each tensor goes to the rank whose range holds it, and a tensor that a cut
  falls inside is split there into row slabs (rows of its laid-out dim 0), one per rank. Every rank is busy
  whatever the number of files, and writes one contiguous run (at most a few files).
- "file": each file is written whole by one rank (`OutFile.owner`), for storage that does not take
  concurrent writes to one file.
- "parts" (an OUT in object storage, not a user's choice): "tensor", then every rank's run of a file that is
  not the file's last and holds under `MIN_PIECE` bytes goes to the rank after it, so that each run can be
  uploaded as parts of one multipart upload (S3 refuses a part under 5 MiB but the last).

A quantized weight (written with its scale) and a tensor of one row are never split. Which rank writes what
never changes what a file holds: the bytes are the same for any number of ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from ckptconv.plan.types import Granularity, OutFile, OutTensor, Write, rows_of

MIN_PIECE = 5 << 20  # "parts": S3's smallest part but an object's last


def stored_nbytes(t: OutTensor, scales: dict[str, int]) -> int:
    """Bytes a write of the whole `t` puts in its file: a quantized weight's scales come with it."""
    return t.nbytes + (scales.get(t.hf_key, 0) if t.quant else 0)


def plan_writes(files: Sequence[OutFile], world_size: int, granularity: Granularity) -> tuple[Write, ...]:
    """Every byte range of every file's data, with the rank that writes it, in file order (a rank's writes
    in this order are its write order)."""
    scales = _scales(files)
    units = [(f, t) for f in files for t in f.tensors if t.scale_of is None]
    if granularity == "file" or world_size == 1:
        return _headed([Write(f, t, 0, rows_of(t), f.owner) for f, t in units])
    writes = _tensor_writes(units, scales, world_size)
    return _headed(_no_small_runs(writes, scales) if granularity == "parts" else writes)


def _tensor_writes(
    units: list[tuple[OutFile, OutTensor]], scales: dict[str, int], world_size: int
) -> list[Write]:
    """The "tensor" granularity's writes: the stream of all files' data cut into equal shares."""
    total = sum(stored_nbytes(t, scales) for _, t in units)
    writes: list[Write] = []
    at = 0  # bytes of the stream before the current tensor
    for f, t in units:
        n = stored_nbytes(t, scales)
        rows = rows_of(t)
        if t.quant or rows < 2 or not n:
            writes.append(Write(f, t, 0, rows, _rank_at(at + n // 2, total, world_size)))
        else:
            for lo, hi in _cut(at, n, rows, total, world_size):
                middle = at + (lo + hi) * n // (2 * rows)
                writes.append(Write(f, t, lo, hi, _rank_at(middle, total, world_size)))
        at += n
    return writes


def _no_small_runs(writes: list[Write], scales: dict[str, int]) -> list[Write]:
    """Each run of one rank's writes in a file that is not the file's last and holds under MIN_PIECE
    bytes, given to the rank of the run after it (every rank's writes stay one contiguous run)."""
    out = list(writes)
    for _, group in itertools.groupby(range(len(out)), key=lambda i: out[i].file.name):
        runs = [(rank, list(g)) for rank, g in itertools.groupby(group, key=lambda i: out[i].rank)]
        pending: list[int] = []
        for k, (rank, run) in enumerate(runs):
            pending += run
            size = sum(_stored(out[i], scales) for i in pending)
            if size >= MIN_PIECE or k == len(runs) - 1:
                for i in pending:
                    out[i] = replace(out[i], rank=rank)
                pending = []
    return out


def _headed(writes: list[Write]) -> tuple[Write, ...]:
    """`writes` with the first of each file marked as the one that writes its header."""
    seen: set[str] = set()
    out = []
    for w in writes:
        out.append(replace(w, header=True) if w.file.name not in seen else w)
        seen.add(w.file.name)
    return tuple(out)


def _scales(files: Sequence[OutFile]) -> dict[str, int]:
    """{quantized weight's key: bytes of its scales}."""
    out: dict[str, int] = {}
    for f in files:
        for t in f.tensors:
            if t.scale_of is not None:
                out[t.scale_of] = out.get(t.scale_of, 0) + t.nbytes
    return out


def _rank_at(position: int, total: int, world_size: int) -> int:
    """The rank whose share of the stream holds byte `position`."""
    return min(world_size - 1, position * world_size // total) if total else 0


def _cut(at: int, n: int, rows: int, total: int, world_size: int) -> list[tuple[int, int]]:
    """The tensor at bytes [at, at + n) of the stream as row ranges, cut at the rows nearest to the rank
    boundaries (k * total / world_size) that fall inside it."""
    first = _rank_at(at, total, world_size) + 1
    cuts = [0]
    for k in range(first, world_size):
        boundary = math.ceil(k * total / world_size)
        if boundary >= at + n:
            break
        row = round((boundary - at) * rows / n)
        if cuts[-1] < row < rows:
            cuts.append(row)
    cuts.append(rows)
    return list(itertools.pairwise(cuts))


def bytes_per_rank(writes: Sequence[Write], world_size: int) -> list[int]:
    """The data bytes each rank writes (a quantized weight's scale included)."""
    scales = _scales(list({w.file.name: w.file for w in writes}.values()))
    out = [0] * world_size
    for w in writes:
        out[w.rank] += _stored(w, scales)
    return out


def _stored(w: Write, scales: dict[str, int]) -> int:
    """Bytes `w` puts in its file: a quantized weight's scales come with it."""
    return w.nbytes + (scales.get(w.tensor.hf_key, 0) if w.tensor.quant else 0)
