"""DCP records stored through torch's stream transforms (`FileSystemWriter(_extensions=[ZStandard()])`).

torch's writer passes every record of a save (each tensor chunk's torch.save zip, each non-tensor item)
through the same extensions and lists their descriptors, outermost first, in each `_StorageInfo`; its reader
undoes them in that order. torch registers one such extension, ZStandard (`stream.zstd/1`: one zstd frame
per record, no content size, no checksum), made and read with the `zstandard` module. ckptconv reads that
one, once (`layers`): any other descriptor (another version, another extension) is refused by name, and so
are records wrapped in more than one frame, which only a writer given ZStandard twice makes.

A compressed record cannot be read by byte offset: it is decompressed whole, a slab at a time, into one
buffer (`record`) that grows as the frame's output arrives (never allocated at the size `.metadata` claims:
a small record claiming a huge chunk costs what it holds), and the chunk's bytes are taken from the
torch.save zip it holds. What decompression may make is bounded while it runs, never after: each record by
its chunk's bytes plus `RECORD_SLACK` (a non-tensor item by the read limit on bytes inflated), each step's
input small enough that even zstd's densest block (`MAX_RATIO`) cannot go more than a step past it. A frame
cut short, bytes after it, or anything zstd itself finds wrong is refused naming the file.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ckptconv.errors import CkptconvError

ZSTD = "stream.zstd"  # torch's `ZStandard.registry_name()`
ZSTD_VERSION = "1"  # the major version torch's `ZStandard.from_descriptor` reads
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # the first bytes of every zstd frame
# the most one byte of a frame decompresses to: a block holds at most 128 KiB, and an RLE block of 128 KiB
# takes 4 bytes (a 3-byte block header and the repeated byte)
MAX_RATIO = 32768
# what a torch.save record of a tensor holds beyond the tensor's bytes: data.pkl (which torch_record caps
# at MAX_RECORD_PICKLE, 1 MiB; not imported: this module is read before torch is), the small entries
# (byteorder, version, serialization id), zip headers and each entry's 64-byte alignment, the directory
RECORD_SLACK = (1 << 20) + (64 << 10)
READ_BYTES = 1 << 20  # compressed bytes read from the file at a time
_MIN_STEP = 256  # input bytes fed to zstd at a time, at least (at most 8 MiB of output past a limit)

Reader = Callable[[int, int], bytes]  # (offset, length) within the record's stored bytes -> those bytes


def layers(descriptors: tuple[str, ...], where: object) -> int:
    """How many zstd frames wrap each record: 0 or 1 (torch's writer with `_extensions=[ZStandard()]`), or a
    CkptconvError naming the first descriptor ckptconv does not read, or the descriptors of more frames."""
    for descriptor in descriptors:
        name, _, version = descriptor.partition("/")
        if name != ZSTD or version.partition(".")[0] != ZSTD_VERSION:
            raise CkptconvError(
                f"{where}: stored with the DCP extension {descriptor!r}, which ckptconv does not read (of "
                f"torch's stream transforms it reads ZStandard, '{ZSTD}/{ZSTD_VERSION}'); re-save the "
                "checkpoint without it, or with ZStandard"
            )
    if len(descriptors) > 1:  # each frame would multiply what a stored byte may make by MAX_RATIO
        shown = ", ".join(map(repr, descriptors[:4])) + (", ..." if len(descriptors) > 4 else "")
        raise CkptconvError(
            f"{where}: its records are stored through {len(descriptors)} DCP extensions ({shown}), each a "
            f"zstd frame around the next; ckptconv reads one ZStandard layer, '{ZSTD}/{ZSTD_VERSION}'; "
            "re-save the checkpoint with _extensions=[ZStandard()]"
        )
    return len(descriptors)


def record(read: Reader, length: int, limit: int, where: object) -> memoryview:
    """The bytes of a record stored as `length` bytes in one zstd frame (`read` gives the stored bytes),
    decompressed into one buffer grown as they arrive, at most `limit` bytes; more, a frame cut short or
    anything else wrong with the frame is a CkptconvError naming `where`."""
    pieces = (read(at, min(READ_BYTES, length - at)) for at in range(0, length, READ_BYTES))
    # grown by appending, so memory follows what the frame makes: CPython over-allocates a bytearray an
    # eighth at a time (pages never written stay out of RSS) and glibc's realloc moves a large block by
    # remapping its pages, not copying them; the tensor is then a view of this buffer (torch.frombuffer),
    # as when it was allocated whole (measured on 256 MiB records: the same peak, or less)
    buf = bytearray()
    for out in _frame(pieces, limit, where):  # each piece is checked against the limit before it is kept
        buf += out
    return memoryview(buf)


def _frame(pieces: Iterable[Any], limit: int, where: object) -> Iterator[bytes]:
    """The output of the one zstd frame `pieces` hold, a step at a time, never more than `limit` bytes in
    all (each step's input is small enough that its output cannot pass the limit by more than a step)."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor().decompressobj()
    total = 0
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                if decompressor.eof:
                    raise _trailing(where)
                step = max(_MIN_STEP, (limit - total) // MAX_RATIO)
                out = decompressor.decompress(view[:step])
                view = view[step:]
                total += len(out)
                if total > limit:
                    raise CkptconvError(
                        f"{where}: its zstd frame decompresses to more than the {limit} bytes the record can "
                        "hold (a decompression bomb, or corrupt metadata); refusing to read on"
                    )
                if out:
                    yield out
    except zstandard.ZstdError as e:
        raise CkptconvError(
            f"{where}: not a readable zstd frame ({str(e)[:200]}); the checkpoint is corrupt, re-save or "
            "re-copy it"
        ) from None
    if not decompressor.eof:
        raise CkptconvError(
            f"{where}: its zstd frame is truncated ({total} bytes decompressed when the stored bytes end); "
            "the checkpoint is corrupt, re-save or re-copy it"
        )
    if decompressor.unused_data:
        raise _trailing(where)


def _trailing(where: object) -> CkptconvError:
    return CkptconvError(
        f"{where}: bytes after the end of its zstd frame; the checkpoint is corrupt, re-save or re-copy it"
    )


class BufferFile(io.RawIOBase):
    """A read-only, seekable file over `data` (a decompressed record), without copying it."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.data)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self.data) - self.pos))
        memoryview(buffer).cast("B")[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n
