"""`--resume`'s records, read and written: one JSON file per file a rank finished, in
STAGING/.ckptconv-resume/, read back as inputs (bounded in count and size, every field type-checked: a
malformed record is not trusted, so its file is written again)."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, replace
from pathlib import Path

from ckptconv.core.crc32 import crc32
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import write_failed

RECORDS = ".ckptconv-resume"  # inside the staging directory; removed before it is published
RECORD_BYTES = 16 << 20  # one record (a DCP data file's lists its items); a larger one is not trusted
TOTAL_BYTES = 1 << 30  # of all the records read by one run; more is refused (they are not ours)
MAX_RECORDS = 200_000  # records in the directory; more is refused (it is not one of ours)
MAX_RANGES = 1024  # ranges in one record
MAX_ITEMS = 1 << 20  # a DCP data file's items in one record
READ_BYTES = 8 << 20  # read back at once to compute a CRC-32
NAME = re.compile(r"[^/\x00]{1,255}\.r[0-9]{1,6}-[0-9]{1,6}\.json")
KINDS = ("source", "options", "plan")  # the fingerprint's parts, in the order a mismatch is named

# a DCP data file's item: (fqn, its chunk's offsets, MetadataIndex.index, where it starts in the file, length)
Item = tuple[str, tuple[int, ...], "int | None", int, int]


@dataclass(frozen=True)
class Record:
    """What one rank wrote of one file, as its record says."""

    fingerprint: tuple[str, str, str]
    """The fingerprint's parts (`KINDS`) of the run that wrote it."""
    file: str
    """The file's name in the staging directory."""
    size: int
    """The file's planned size (a DCP data file's: its size when written)."""
    ranges: tuple[tuple[int, int, int], ...]
    """(lo, hi, CRC-32 of bytes [lo, hi)) of each range written."""
    items: tuple[Item, ...] = ()
    """A DCP data file's items, each where it lies in the file (what `.metadata` says of them)."""
    world_size: int = 0
    """The number of ranks of the run that wrote it (its name says)."""


def parse_record(raw: bytes) -> Record | None:
    """A record from its bytes, or None when it is not one (too large, not JSON, a field of the wrong type
    or out of range)."""
    if len(raw) > RECORD_BYTES:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or type(doc.get("version")) is not int or doc["version"] != 1:
        return None
    fp, name, size, ranges = doc.get("fingerprint"), doc.get("file"), doc.get("size"), doc.get("ranges")
    if not (isinstance(fp, dict) and all(isinstance(fp.get(k), str) and len(fp[k]) <= 128 for k in KINDS)):
        return None
    if not (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and name not in (".", "..")):
        return None
    if not (type(size) is int and _count(size) and isinstance(ranges, list) and len(ranges) <= MAX_RANGES):
        return None
    out = []
    for r in ranges:
        if not (isinstance(r, list) and len(r) == 3 and all(_count(x) for x in r)):
            return None
        lo, hi, crc = r
        if not (lo < hi <= size and crc < 2**32):
            return None
        out.append((lo, hi, crc))
    items = _items(doc.get("items", []), size)
    if items is None:
        return None
    return Record((fp["source"], fp["options"], fp["plan"]), name, size, tuple(out), items)


def _items(raw: object, size: int) -> tuple[Item, ...] | None:
    """A record's DCP items, checked: each [fqn, [offsets], index or null, start, length] within the file."""
    if not (isinstance(raw, list) and len(raw) <= MAX_ITEMS):
        return None
    out: list[Item] = []
    for x in raw:
        if not (isinstance(x, list) and len(x) == 5):
            return None
        fqn, offsets, index, at, length = x
        if not (isinstance(fqn, str) and len(fqn) <= 4096):
            return None
        if not (isinstance(offsets, list) and len(offsets) <= 64):
            return None
        if not (all(_count(o) for o in offsets) and (index is None or _count(index))):
            return None
        if not (_count(at) and _count(length) and at + length <= size):
            return None
        out.append((fqn, tuple(offsets), index, at, length))
    return tuple(out)


def _count(x: object) -> bool:
    """A non-negative int (not a bool) below 2**63."""
    return type(x) is int and 0 <= x < 2**63


def record_bytes(
    fingerprint: tuple[str, str, str],
    file: str,
    size: int,
    ranges: list[list[int]],
    items: list[Item] | None = None,
) -> bytes:
    """A record's JSON."""
    doc: dict[str, object] = {
        "version": 1,
        "fingerprint": dict(zip(KINDS, fingerprint, strict=True)),
        "file": file,
        "size": size,
        "ranges": ranges,
    }
    if items is not None:
        doc["items"] = [[fqn, list(offsets), index, at, n] for fqn, offsets, index, at, n in items]
    return json.dumps(doc, separators=(",", ":")).encode()


def range_crc(fd: int, lo: int, hi: int) -> int | None:
    """The CRC-32 of bytes [lo, hi) of the open file `fd`; None where the file ends before `hi`."""
    crc, at = 0, lo
    while at < hi:
        data = os.pread(fd, min(READ_BYTES, hi - at), at)
        if not data:
            return None
        crc = crc32(data, crc)
        at += len(data)
    return crc


def write_record(
    staging: Path,
    fingerprint: tuple[str, str, str],
    name: str,
    size: int,
    ranges: list[list[int]],
    rank: int,
    world_size: int,
    items: list[Item] | None = None,
) -> None:
    """Write one record (through a temporary name: a record is whole or absent)."""
    folder = staging / RECORDS
    path = folder / f"{name}.r{rank}-{world_size}.json"
    tmp = path.with_name(path.name + ".tmp")
    try:
        folder.mkdir(exist_ok=True)
        tmp.write_bytes(record_bytes(fingerprint, name, size, ranges, items))
        os.replace(tmp, path)
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None


def read_records(staging: Path, wanted: frozenset[str] | None = None) -> list[Record]:
    """The records in `staging` (of the files `wanted`, when given) that parse (a malformed one is left out:
    its file is not trusted); more than MAX_RECORDS entries or TOTAL_BYTES of records: one line, exit 2."""
    folder = staging / RECORDS
    try:
        if not folder.is_dir() or folder.is_symlink():
            return []
        names = []
        with os.scandir(folder) as entries:
            for entry in entries:
                names.append(entry.name)
                if len(names) > MAX_RECORDS:
                    raise CkptconvError(
                        f"{folder}: more than {MAX_RECORDS} entries, not a ckptconv resume record directory; "
                        "rerun without --resume to start over"
                    )
    except OSError as e:
        raise CkptconvError(f"{folder}: cannot read ({e.strerror}); rerun without --resume") from None
    out, total = [], 0
    for name in sorted(names):
        if NAME.fullmatch(name) and (wanted is None or name.rsplit(".r", 1)[0] in wanted):
            raw = _read_small(folder / name)
            total += len(raw)
            if total > TOTAL_BYTES:
                raise CkptconvError(
                    f"{folder}: more than {TOTAL_BYTES >> 20} MiB of records, not a ckptconv resume record "
                    "directory; rerun without --resume to start over"
                )
            record = parse_record(raw)
            if record is not None and name.startswith(record.file + ".r"):
                out.append(replace(record, world_size=int(name[:-5].rsplit("-", 1)[1])))
    return out


def _read_small(path: Path) -> bytes:
    """A regular file's first RECORD_BYTES + 1 bytes (no more: a larger one is refused by its size); b""
    where it is not one or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        chunks, left = [], RECORD_BYTES + 1
        while left:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)
