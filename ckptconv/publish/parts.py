"""Pure: the output files of dcp-to-hf / save_hf in S3, written by every rank at once as multipart uploads.

Under the "parts" write granularity (writes.py) a rank's bytes of a file are one contiguous run, its
*piece*, and every piece but a file's last holds at least 5 MiB. One multipart upload per file takes the
pieces of all ranks: a piece is cut into parts of PART_BYTES (its last part takes the remainder: between
PART_BYTES and twice that, or the whole piece when smaller), numbered after the parts of the pieces before it,
so that the parts in number order are the file:

    file    [ header | t0 ................ | t1 ........ | t2 ............................ ]
    pieces  [ rank 0 ......................... )[ rank 1 ................................... ]
    parts   [ 1               | 2             ][ 3                | 4                      ]

Rank 0 starts the uploads, completes each once every rank has sent its parts' ETags, and aborts them on
failure. What a file holds does not depend on the ranks: the same bytes, cut differently.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from ckptconv.errors import CkptconvError
from ckptconv.plan.writes import MIN_PIECE

if TYPE_CHECKING:
    from ckptconv.plan.types import OutFile, Write

PART_BYTES = 16 << 20  # 10,000 parts (S3's limit per object) hold 156 GiB, far above a shard
MAX_PARTS = 10_000


class Piece(NamedTuple):
    """Bytes [start, end) of `file`, written by `rank`, as parts numbered from `first_part`."""

    file: str
    rank: int
    start: int
    end: int
    first_part: int

    def part_sizes(self) -> list[int]:
        """The sizes of this piece's parts, in order: PART_BYTES each, the last taking the remainder."""
        n = max(1, (self.end - self.start) // PART_BYTES)
        return [PART_BYTES] * (n - 1) + [self.end - self.start - (n - 1) * PART_BYTES]

    def part_at(self, offset: int) -> tuple[int, int, int]:
        """The part holding byte `offset` of the file: (part number, its first byte, its size)."""
        sizes = self.part_sizes()
        index = min(len(sizes) - 1, (offset - self.start) // PART_BYTES)
        return self.first_part + index, self.start + index * PART_BYTES, sizes[index]


def plan_pieces(files: Sequence[OutFile], writes: Sequence[Write]) -> list[Piece]:
    """Every file's pieces, in file order: the runs of bytes one rank writes (its header included), with
    the number of each run's first part."""
    from ckptconv.formats.safetensors_io import Entry, header_bytes

    by_file: dict[str, list[Write]] = {}
    for w in writes:
        by_file.setdefault(w.file.name, []).append(w)
    pieces: list[Piece] = []
    scales: dict[str, list[str]] = {}  # a quantized weight's key: its scales' keys
    for f in files:
        for t in f.tensors:
            if t.scale_of is not None:
                scales.setdefault(t.scale_of, []).append(t.hf_key)
    for f in files:
        head = len(header_bytes([Entry(t.hf_key, t.dtype, t.file_shape) for t in f.tensors]))
        starts = itertools.accumulate((t.nbytes for t in f.tensors), initial=head)
        at = {t.hf_key: (start, start + t.nbytes) for t, start in zip(f.tensors, starts, strict=False)}
        spans = []
        for w in by_file.get(f.name, []):
            if w.header:
                spans.append((0, head, w.rank))
            first = at[w.tensor.hf_key][0] + w.start
            spans.append((first, first + w.nbytes, w.rank))
            for scale in scales.get(w.tensor.hf_key, []):  # its scales, written with it
                spans.append((*at[scale], w.rank))
        pieces += _pieces(f.name, sorted(spans), head + f.nbytes)
    return pieces


def _pieces(name: str, spans: list[tuple[int, int, int]], size: int) -> list[Piece]:
    """The spans of one file merged into one piece per rank, checked to tile [0, size) with no piece but
    the last under MIN_PIECE; numbered."""
    runs: list[list[int]] = []
    for start, end, rank in spans:
        if end == start:
            continue
        if runs and runs[-1][2] == rank and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end, rank])
    tiled = runs and runs[0][0] == 0 and runs[-1][1] == size
    if not tiled or any(a[1] != b[0] for a, b in itertools.pairwise(runs)):
        raise CkptconvError(f"{name}: the planned writes do not cover the file once (internal error)")
    if len({rank for _, _, rank in runs}) != len(runs) or any(e - s < MIN_PIECE for s, e, _ in runs[:-1]):
        raise CkptconvError(f"{name}: a rank's writes are not one piece of at least 5 MiB (internal error)")
    pieces, part = [], 1
    for start, end, rank in runs:
        pieces.append(Piece(name, rank, start, end, part))
        part += len(pieces[-1].part_sizes())
    if part - 1 > MAX_PARTS:
        raise CkptconvError(
            f"{name}: {size} bytes need {part - 1} parts, above S3's {MAX_PARTS}; "
            "pass a smaller --max-shard-size"
        )
    return pieces
