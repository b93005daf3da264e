"""CRC-32 checks of DCP chunks read in pieces (some rows at a time, on any number of ranks)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ckptconv.core.crc32 import whole_crc
from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError


class RowPiece(NamedTuple):
    """A part of a stored chunk that was read on its own, with its CRC-32 and the whole chunk's."""

    file: str
    where: int  # file offset of the chunk's bytes
    fqn: str
    byte_offset: int  # of the chunk's record, for the error message
    expected: int  # CRC-32 of the whole chunk, from its zip entry
    nbytes: int  # of the whole chunk
    start: int  # of this piece, from the chunk's first byte
    length: int
    crc: int


def check_pieces(ckpt: DcpCheckpoint, pieces: Iterable[RowPiece]) -> None:
    """Check every chunk whose pieces (from any number of ranks) cover it exactly against its stored
    CRC-32. A chunk not wholly read (only some experts mapped) is not checked."""
    by_chunk: dict[tuple[str, int], list[RowPiece]] = {}
    for piece in pieces:
        by_chunk.setdefault((piece.file, piece.where), []).append(piece)
    for (file, _), parts in sorted(by_chunk.items()):
        first = parts[0]
        crc = whole_crc(((p.start, p.length, p.crc) for p in parts), first.nbytes)
        if crc is not None and crc != first.expected:
            raise crc_error(ckpt, file, first.fqn, first.byte_offset)


def crc_error(ckpt: DcpCheckpoint, file: str, fqn: str, byte_offset: int) -> CkptconvError:
    return CkptconvError(
        f"{ckpt.path / file}: the chunk of {fqn!r} at byte {byte_offset} fails its CRC-32 check; "
        "the checkpoint is corrupt, re-copy or re-save it"
    )
