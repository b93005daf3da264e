"""`--resume`: per-file records of what a rank wrote into the staging directory, and the check that lets a
later run keep the files an interrupted one finished.

Each rank, once its writes to a file are on the device (after the fsync; closed, with --no-fsync), writes a
record into STAGING/.ckptconv-resume/: the run's fingerprint, the file's name and planned size, and the byte
ranges it wrote with their CRC-32 (read back from the file). The fingerprint is three digests: the source's
identity (file stamps, headers), the options that change what is written, and the plan of the files' bytes.
A run with `--resume` (rank 0, holding OUT's lock) reads the records as inputs (a bounded count and size,
JSON with checked types; a malformed record is not trusted), refuses records made for another fingerprint,
and keeps a file only when the records of it cover every byte and the bytes still have their CRC-32s; every
other entry is removed and written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from ckptconv.core.crc32 import crc32
from ckptconv.errors import CkptconvError
from ckptconv.formats import durable
from ckptconv.formats.files import write_failed
from ckptconv.plan.coverage import Range, covers

RECORDS = ".ckptconv-resume"  # inside the staging directory; removed before it is published
RECORD_BYTES = 64 << 10  # one record; a larger one is not trusted
MAX_RECORDS = 200_000  # records in the directory; more is refused (it is not one of ours)
MAX_RANGES = 1024  # ranges in one record
READ_BYTES = 8 << 20  # read back at once to compute a CRC-32
_NAME = re.compile(r"[^/\x00]{1,255}\.r[0-9]{1,6}-[0-9]{1,6}\.json")
KINDS = ("source", "options", "plan")  # the fingerprint's parts, in the order a mismatch is named


def digest(*parts: object) -> str:
    """A SHA-256 over the `repr`s of `parts` (str, bytes, numbers, tuples, dicts of them: stable reprs)."""
    h = hashlib.sha256()
    for part in parts:
        text = part if isinstance(part, bytes) else repr(part).encode()
        h.update(f"{len(text)}:".encode())
        h.update(text)
    return h.hexdigest()


def options_digest(options: object, skip: Iterable[str]) -> str:
    """A digest of a dataclass of options, less the fields in `skip` (those that change how, not what, is
    written: fsync, verify, resume, bucket sizes, ...)."""
    left_out = set(skip)
    values = [(f.name, repr(getattr(options, f.name))) for f in fields(options) if f.repr]  # type: ignore[arg-type]
    return digest(type(options).__name__, [v for v in values if v[0] not in left_out])


def stamps_digest(stamps: Mapping[str, object], *more: object) -> str:
    """The source's identity: each file's stamp (device, inode, size, mtime), and `more`."""
    return digest(sorted((str(k), repr(v)) for k, v in stamps.items()), *more)


def file_stamp(path: Path) -> tuple[int, int, int, int] | None:
    """A local file's stamp (device, inode, size, mtime), or None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Record:
    """What one rank wrote of one file, as its record says."""

    fingerprint: tuple[str, str, str]
    """The fingerprint's parts (`KINDS`) of the run that wrote it."""
    file: str
    """The file's name in the staging directory."""
    size: int
    """The file's planned size."""
    ranges: tuple[tuple[int, int, int], ...]
    """(lo, hi, CRC-32 of bytes [lo, hi)) of each range written."""


def parse_record(raw: bytes) -> Record | None:
    """A record from its bytes, or None when it is not one (too large, not JSON, a field of the wrong type
    or out of range)."""
    if len(raw) > RECORD_BYTES:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("version") != 1:
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
    return Record((fp["source"], fp["options"], fp["plan"]), name, size, tuple(out))


def _count(x: object) -> bool:
    """A non-negative int (not a bool) below 2**63."""
    return type(x) is int and 0 <= x < 2**63


def record_bytes(fingerprint: tuple[str, str, str], file: str, size: int, ranges: list[list[int]]) -> bytes:
    """A record's JSON."""
    doc = {
        "version": 1,
        "fingerprint": dict(zip(KINDS, fingerprint, strict=True)),
        "file": file,
        "size": size,
        "ranges": ranges,
    }
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


class Resume:
    """A run's resume state: the fingerprint its records carry, the files it plans ({name: size}), whether
    `--resume` was asked, and (`kept`, set on every rank by `outdir.atomically`) the files kept from an
    earlier run, which no rank writes nor reads for again."""

    def __init__(
        self,
        fingerprint: tuple[str, str, str],
        sizes: Mapping[str, int],
        asked: bool,
        *,
        info: Callable[[str], None] = lambda line: None,
        warn: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.fingerprint, self.sizes, self.asked = fingerprint, dict(sizes), asked
        self.info, self.warn = info, warn
        self.kept: frozenset[str] = frozenset()

    def recorder(
        self, staging: Path, rank: int, world_size: int, ranges: Mapping[str, list[Range]]
    ) -> Recorder:
        """What records this rank's files as they are finished (`Recorder.done`)."""
        return Recorder(self, staging, rank, world_size, ranges)

    def keep(self, staging: Path, fsync: bool) -> frozenset[str]:
        """Rank 0, holding the lock, with --resume: the complete files of the earlier run's `staging` (every
        other entry removed), or nothing when there is no staging directory to resume (a note says so).
        Records made for another fingerprint: one line, exit 2."""
        if not staging.is_dir():
            self.info(f"--resume: no staging directory {staging} from an earlier run; writing every file")
            return frozenset()
        by_file: dict[str, list[Record]] = {}
        for record in read_records(staging):
            self._same(staging, record)
            if self.sizes.get(record.file) == record.size:
                by_file.setdefault(record.file, []).append(record)
        kept = frozenset(name for name, records in by_file.items() if _trusted(staging / name, records))
        _clear(staging, kept)
        if fsync:  # an earlier run with --no-fsync may have left them in the page cache only
            for name in sorted(kept):
                durable.sync_file(staging / name)
        self.info(f"--resume: {len(kept)} of {len(self.sizes)} files kept from {staging}; writing the rest")
        return kept

    def _same(self, staging: Path, record: Record) -> None:
        """Refuse a record made for another plan, naming what changed."""
        for kind, ours, theirs in zip(KINDS, self.fingerprint, record.fingerprint, strict=True):
            if ours != theirs:
                what = {"source": "the source", "options": "the options", "plan": "the plan"}[kind]
                raise CkptconvError(
                    f"{staging}: --resume: {what} changed since this staging directory was written; rerun "
                    "without --resume to start over (it removes the staging directory)"
                )

    def complete(self, staging: Path) -> int:
        """After an interrupt: how many files the records in `staging` say are complete (not re-checked:
        a resume does that)."""
        try:
            records = read_records(staging)
        except CkptconvError:
            return 0
        by_file: dict[str, list[Range]] = {}
        for r in records:
            if r.fingerprint == self.fingerprint and self.sizes.get(r.file) == r.size:
                by_file.setdefault(r.file, []).extend((lo, hi) for lo, hi, _ in r.ranges)
        return sum(covers(ranges, self.sizes[name]) for name, ranges in by_file.items())


class Recorder:
    """Writes a rank's record of each file it finished (`done(path)`, after the file's fsync)."""

    def __init__(
        self, resume: Resume, staging: Path, rank: int, world_size: int, ranges: Mapping[str, list[Range]]
    ) -> None:
        self.resume, self.staging, self.rank, self.world_size = resume, staging, rank, world_size
        self.ranges = ranges

    def done(self, path: object) -> None:
        """Record the file `path` (in the staging directory): the ranges this rank wrote, with their CRC-32s
        read back from it."""
        name = Path(str(path)).name
        size = self.resume.sizes.get(name)
        if size is None:
            return
        try:
            fd = os.open(Path(str(path)), os.O_RDONLY)
            try:
                crcs = [(lo, hi, range_crc(fd, lo, hi)) for lo, hi in self.ranges.get(name, [])]
            finally:
                os.close(fd)
        except OSError as e:
            raise write_failed(path, OSError(e.errno, e.strerror)) from None
        ranges = [[lo, hi, crc] for lo, hi, crc in crcs if crc is not None]
        if len(ranges) < len(crcs):
            return  # shorter than written: not recorded, so written again by a resume
        write_record(self.staging, self.resume.fingerprint, name, size, ranges, self.rank, self.world_size)


def write_record(
    staging: Path,
    fingerprint: tuple[str, str, str],
    name: str,
    size: int,
    ranges: list[list[int]],
    rank: int,
    world_size: int,
) -> None:
    """Write one record (through a temporary name: a record is whole or absent)."""
    folder = staging / RECORDS
    path = folder / f"{name}.r{rank}-{world_size}.json"
    tmp = path.with_name(path.name + ".tmp")
    try:
        folder.mkdir(exist_ok=True)
        tmp.write_bytes(record_bytes(fingerprint, name, size, ranges))
        os.replace(tmp, path)
    except OSError as e:
        raise write_failed(path, OSError(e.errno, e.strerror)) from None


def read_records(staging: Path) -> list[Record]:
    """The records in `staging` that parse (a malformed one is left out: its file is not trusted); more than
    MAX_RECORDS entries: one line, exit 2."""
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
    out = []
    for name in sorted(names):
        if _NAME.fullmatch(name):
            record = parse_record(_read_small(folder / name))
            if record is not None and name.startswith(record.file + ".r"):
                out.append(record)
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
        return os.read(fd, RECORD_BYTES + 1)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _trusted(path: Path, records: list[Record]) -> bool:
    """Whether the file `path` is what `records` say: a regular file of the planned size, every byte of it
    covered by a record, every recorded range with its CRC-32."""
    size = records[0].size
    if not covers(((lo, hi) for r in records for lo, hi, _ in r.ranges), size):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        return all(range_crc(fd, lo, hi) == crc for r in records for lo, hi, crc in r.ranges)
    except OSError:
        return False
    finally:
        os.close(fd)


def _clear(staging: Path, kept: frozenset[str]) -> None:
    """Remove every entry of `staging` but the `kept` files and their records."""
    try:
        for entry in list(staging.iterdir()):
            if entry.name in kept or entry.name == RECORDS:
                continue
            _remove(entry)
        folder = staging / RECORDS
        if folder.is_symlink() or not folder.is_dir():
            _remove(folder)
            return
        for entry in list(folder.iterdir()):
            record = entry.name.rsplit(".r", 1)[0]
            if record not in kept or not _NAME.fullmatch(entry.name):
                _remove(entry)
    except OSError as e:
        raise CkptconvError(
            f"{e.filename or staging}: cannot clean up for --resume ({e.strerror}); check permissions, or "
            f"remove {staging} and rerun without --resume"
        ) from None


def _remove(path: Path) -> None:
    """Remove a file, link or directory tree (nothing, where there is nothing)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def drop_records(staging: Path) -> None:
    """Remove the records (before the staging directory is published: OUT holds none)."""
    shutil.rmtree(staging / RECORDS, ignore_errors=True)
