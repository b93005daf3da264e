"""Pure: the byte ranges of the output files each rank writes, whether ranges cover a file, and the digest of
the world-size independent part of a dcp-to-hf plan (each file's name, header and size), for `--resume`."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from ckptconv.plan.types import HfSavePlan, OutFile

Range = tuple[int, int]  # [lo, hi) bytes of a file


def file_header(f: OutFile) -> bytes:
    """The header `SafetensorsWriter` writes at the start of `f` (its 8-byte length too)."""
    from ckptconv.formats.safetensors_io import Entry, header_bytes  # torch: not for a plan made before it

    return header_bytes([Entry(t.hf_key, t.dtype, t.file_shape) for t in f.tensors])


def file_size(f: OutFile) -> int:
    """The size of `f` once written: its header and its data."""
    return len(file_header(f)) + f.nbytes


def merged(ranges: Iterable[Range]) -> list[Range]:
    """`ranges` sorted, with those that touch or overlap made one; empty ranges dropped."""
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def covers(ranges: Iterable[Range], size: int) -> bool:
    """Whether `ranges` together hold every byte of a file of `size` bytes (and none past its end)."""
    whole = merged(ranges)
    if size == 0:
        return not whole
    return whole == [(0, size)]


def rank_ranges(plan: HfSavePlan, rank: int) -> dict[str, list[Range]]:
    """{file name: the byte ranges `rank` writes in it, merged}: its header where its write carries it, each
    write's rows of its tensor, and a quantized weight's scales (written with it)."""
    out: dict[str, list[Range]] = {}
    layouts: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {}
    for w in plan.writes_of(rank):
        name = w.file.name
        if name not in layouts:
            layouts[name] = _layout(w.file)
        head, at = layouts[name]
        mine = out.setdefault(name, [])
        if w.header:
            mine.append((0, head))
        start, _ = at[w.tensor.hf_key]
        mine.append((start + w.start, start + w.start + w.nbytes))
        if w.tensor.quant:
            mine += [at[t.hf_key] for t in w.file.tensors if t.scale_of == w.tensor.hf_key]
    return {name: merged(ranges) for name, ranges in out.items()}


def _layout(f: OutFile) -> tuple[int, dict[str, tuple[int, int]]]:
    """The header's length and {key: [start, end) of its data in the file}."""
    head = len(file_header(f))
    at, offset = {}, head
    for t in f.tensors:
        at[t.hf_key] = (offset, offset + t.nbytes)
        offset += t.nbytes
    return head, at


def plan_digest(files: Sequence[OutFile]) -> str:
    """A digest of what the files will hold, the same at any number of ranks: names, headers and sizes."""
    h = hashlib.sha256()
    for f in files:
        head = file_header(f)
        h.update(f"{len(f.name)}:{f.name}:{len(head) + f.nbytes}:".encode())
        h.update(hashlib.sha256(head).digest())
    return h.hexdigest()
