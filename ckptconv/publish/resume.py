"""`--resume`: per-file records of what a rank wrote into the staging directory, and the check that lets a
later run keep the files an interrupted one finished.

Each rank, once its writes to a file are on the device (after the fsync; closed, with --no-fsync), writes a
record into STAGING/.ckptconv-resume/: the run's fingerprint, the file's name and planned size, and the byte
ranges it wrote with their CRC-32 (computed from the bytes as they were written, not read back). The
fingerprint is three digests: the source's identity (file stamps, headers), the options that change what is
written, and the plan of the files' bytes. A DCP data file (hf-to-dcp) is written whole by one rank: its
record says too where each item lies in it, what `.metadata` needs when the file is not written again.
A run with `--resume` (rank 0, holding OUT's lock) reads the records as inputs (a bounded count and size,
JSON with checked types; a malformed record is not trusted), refuses records made for another fingerprint,
and keeps a file only when the records of it cover every byte and the bytes still have their CRC-32s; every
other entry is removed and written again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from itertools import pairwise
from pathlib import Path

from ckptconv.errors import CkptconvError
from ckptconv.formats import durable
from ckptconv.formats.files import write_failed
from ckptconv.plan.coverage import Range, covers, range_crcs
from ckptconv.publish.records import (
    KINDS,
    NAME,
    RECORDS,
    Item,
    Record,
    range_crc,
    read_records,
    write_record,
)
from ckptconv.remote.files import RemoteFiles
from ckptconv.remote.urls import UrlPath


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
    written: fsync, verify, resume, bucket sizes, ...), and of what the files they name hold
    (`inputs_digest`)."""
    left_out = set(skip)
    values = [(f.name, repr(getattr(options, f.name))) for f in fields(options) if f.repr]  # type: ignore[arg-type]
    return digest(type(options).__name__, [v for v in values if v[0] not in left_out], inputs_digest(options))


def stamps_digest(stamps: Mapping[str, object], *more: object) -> str:
    """The source's identity: each file's stamp (device, inode, size, mtime), and `more`."""
    return digest(sorted((str(k), repr(v)) for k, v in stamps.items()), *more)


def object_stamps(root: UrlPath) -> dict[str, tuple[str, ...]]:
    """{name under root: its size and version (ETag, version id, last modified: what the listing gives)} of
    the objects under `root`, from the listing the source was opened with (no second one): an object
    rewritten with the same size gets a new stamp."""
    return RemoteFiles(root).versions()


def file_stamp(path: Path) -> tuple[int, int, int, int, int] | None:
    """A local file's stamp (device, inode, size, mtime, ctime: a write changes the ctime, which no user can
    set back), or None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def local_stamps(root: Path, names: Iterable[str]) -> dict[str, object]:
    """{name: its `file_stamp`} of the files `names` under a local `root` (nothing for one in object storage:
    `object_stamps` gives those)."""
    if isinstance(root, UrlPath):
        return {}
    return {name: file_stamp(root / name) for name in names}


MAX_TREE = 10_000  # entries of a directory an option names that are stamped (sorted: the first ones)
# str-valued options that may name a local file or directory (a mapping's TOML, a LoRA adapter)
_PATH_STRS = frozenset({"mapping", "lora_adapter"})


def inputs_digest(options: object) -> str:
    """A digest of what the options' files hold: the `file_stamp` of every local file a Path-valued option
    (or `--mapping`, `--lora-adapter`) names, and of a directory's regular files (recursively, the first
    MAX_TREE entries, sorted): an edited --config, mapping TOML, --lora-config or --copy-from changes it."""
    return digest(sorted(_option_paths(options, "")))


def _option_paths(value: object, name: str) -> list[tuple[str, object]]:
    """(option, stamps) of each local path the dataclass `value` names, recursively."""
    if is_dataclass(value) and not isinstance(value, type):
        return [x for f in fields(value) for x in _option_paths(getattr(value, f.name), f"{name}.{f.name}")]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _option_paths(v, name)]
    if isinstance(value, UrlPath):
        return []
    if isinstance(value, Path) or (isinstance(value, str) and name.rsplit(".", 1)[-1] in _PATH_STRS):
        path = Path(value)
        if path.is_dir():
            return [(name, _tree_stamps(path))]
        if os.path.lexists(path):
            return [(name, file_stamp(path))]
    return []


def _tree_stamps(root: Path) -> list[tuple[str, object]]:
    """(relative path, `file_stamp`) of a directory's files (a link's target's), recursively: the first
    MAX_TREE entries in sorted order."""
    out: list[tuple[str, object]] = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if len(out) >= MAX_TREE:
                return out
            path = Path(folder) / f
            out.append((str(path.relative_to(root)), file_stamp(path)))
    return out


class Resume:
    """A run's resume state: the fingerprint its records carry, the files it plans ({name: size}; a size of
    None: the one its record says, a DCP data file's), whether `--resume` was asked, and (`kept`, set on
    every rank by `outdir.atomically`) the files kept from an earlier run, which no rank writes nor reads for
    again. `ranks`: the number of ranks a resume must run at (hf-to-dcp's files depend on it), else None."""

    def __init__(
        self,
        fingerprint: tuple[str, str, str],
        sizes: Mapping[str, int | None],
        asked: bool,
        *,
        info: Callable[[str], None] = lambda line: None,
        warn: Callable[[str], None] = lambda line: None,
        ranks: int | None = None,
    ) -> None:
        self.fingerprint, self.sizes, self.asked = fingerprint, dict(sizes), asked
        self.info, self.warn, self.ranks = info, warn, ranks
        self.kept: frozenset[str] = frozenset()
        self.object_sizes: dict[str, int] = {}  # in object storage: {kept object: its size} (hf-to-dcp)

    def record_whole(
        self, staging: Path, rank: int, world_size: int, name: str, size: int, crc: int, items: list[Item]
    ) -> None:
        """Record a DCP data file `name`, written whole by this rank: its size, CRC-32 and `items`."""
        if name in self.sizes:
            ranges = [[0, size, crc]] if size else []
            write_record(staging, self.fingerprint, name, size, ranges, rank, world_size, items)

    def _fits(self, record: Record) -> bool:
        """Whether `record` is of a file this run plans, of its planned size."""
        return record.file in self.sizes and self.sizes[record.file] in (None, record.size)

    def recorder(
        self, staging: Path, rank: int, world_size: int, ranges: Mapping[str, list[Range]]
    ) -> Recorder:
        """What records this rank's files as they are finished (`Recorder.done`)."""
        return Recorder(self, staging, rank, world_size, ranges)

    def keep(self, staging: Path, fsync: bool) -> frozenset[str]:
        """Rank 0, holding the lock, with --resume: the complete files of the earlier run's `staging` (every
        other entry removed), or nothing when there is no staging directory to resume (a note says so).
        Records made for another fingerprint, or a staging path this user did not make: one line, exit 2."""
        if not check_staging(staging):
            self.info(f"--resume: no staging directory {staging} from an earlier run; writing every file")
            return frozenset()
        by_file: dict[str, list[Record]] = {}
        for record in read_records(staging):
            self._same(staging, record)
            if self._fits(record):
                by_file.setdefault(record.file, []).append(record)
        kept = frozenset(name for name, records in by_file.items() if _trusted(staging / name, records))
        _clear(staging, kept)
        if fsync:  # an earlier run with --no-fsync may have left them in the page cache only
            for name in sorted(kept):
                durable.sync_file(staging / name)
        of = f" of {len(self.sizes)}" if None not in self.sizes.values() else ""
        self.info(f"--resume: {len(kept)}{of} files kept from {staging}; writing the rest")
        return kept

    def items(self, staging: Path, names: Iterable[str]) -> dict[str, tuple[Item, ...]]:
        """{file: its record's DCP items} of the kept files `names` (rank 0 checked them)."""
        wanted = frozenset(names) & self.kept
        records = read_records(staging, wanted) if wanted else []
        return {r.file: r.items for r in records if r.fingerprint == self.fingerprint and self._fits(r)}

    def _same(self, staging: Path, record: Record) -> None:
        """Refuse a record made for another plan, naming what changed."""
        if self.ranks is not None and record.world_size != self.ranks:
            raise CkptconvError(
                f"{staging}: --resume: this staging directory was written by {record.world_size} rank(s) "
                f"and this run has {self.ranks}: its files depend on the number of ranks; rerun with "
                f"{record.world_size} rank(s), or without --resume to start over (it removes the staging "
                "directory)"
            )
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
        by_file: dict[tuple[str, int], list[Range]] = {}
        for r in records:
            if r.fingerprint == self.fingerprint and self._fits(r):
                by_file.setdefault((r.file, r.size), []).extend((lo, hi) for lo, hi, _ in r.ranges)
        return sum(covers(ranges, size) for (_, size), ranges in by_file.items())


class Recorder:
    """Writes a rank's record of each file it finished (`done(path)`, after the file's fsync)."""

    def __init__(
        self, resume: Resume, staging: Path, rank: int, world_size: int, ranges: Mapping[str, list[Range]]
    ) -> None:
        self.resume, self.staging, self.rank, self.world_size = resume, staging, rank, world_size
        self.ranges = ranges

    def done(self, path: object, pieces: Sequence[tuple[int, int, int]] | None = None) -> None:
        """Record the file `path` (in the staging directory): the ranges this rank wrote, with their CRC-32s
        made from `pieces` ((offset, length, CRC-32) of what the writer wrote, computed from the bytes in
        memory), or read back from the file where no pieces are given or they do not tile the ranges."""
        name = Path(str(path)).name
        size = self.resume.sizes.get(name)
        if size is None:
            return
        mine = self.ranges.get(name, [])
        ranges = range_crcs(mine, pieces) if pieces is not None else None
        if ranges is None:
            ranges = self._read_back(path, mine)
            if ranges is None:
                return  # shorter than written: not recorded, so written again by a resume
        write_record(self.staging, self.resume.fingerprint, name, size, ranges, self.rank, self.world_size)

    @staticmethod
    def _read_back(path: object, mine: Sequence[Range]) -> list[list[int]] | None:
        """[lo, hi, CRC-32] of each range, read back from the file; None where it ends before one's end."""
        try:
            fd = os.open(Path(str(path)), os.O_RDONLY)
            try:
                crcs = [(lo, hi, range_crc(fd, lo, hi)) for lo, hi in mine]
            finally:
                os.close(fd)
        except OSError as e:
            raise write_failed(path, OSError(e.errno, e.strerror)) from None
        ranges = [[lo, hi, crc] for lo, hi, crc in crcs if crc is not None]
        return ranges if len(ranges) == len(crcs) else None


def _trusted(path: Path, records: list[Record]) -> bool:
    """Whether the file `path` is what `records` say: a regular file of the planned size, every byte of it
    covered by a record, every recorded range with its CRC-32."""
    size = records[0].size
    ranges = sorted((lo, hi) for r in records for lo, hi, _ in r.ranges)
    if any(lo < prev_hi for (_, prev_hi), (lo, _) in pairwise(ranges)):
        return False  # overlapping ranges are not a writer's (and would cost more CRC work than the file)
    if not covers(ranges, size):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        if st.st_nlink != 1 or st.st_uid != os.geteuid():  # a hard link's other name could change it after
            return False
        return all(range_crc(fd, lo, hi) == crc for r in records for lo, hi, crc in r.ranges)
    except OSError:
        return False
    finally:
        os.close(fd)


def check_staging(staging: Path) -> bool:
    """Rank 0, before `--resume` reads, keeps or removes anything in `staging`: whether there is one (False:
    nothing there); a symlink, a non-directory, a directory owned by another user or writable by group or
    others (what this user's runs make: a directory of mode 0700) is refused, one line, exit 2."""
    try:
        st = os.lstat(staging)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise CkptconvError(f"{staging}: cannot read ({e.strerror}); rerun without --resume") from None
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        why = "not a directory"
    elif st.st_uid != os.geteuid():
        why = f"owned by uid {st.st_uid}"
    elif st.st_mode & 0o022:
        why = "writable by others"
    if why is not None:
        raise CkptconvError(
            f"{staging}: not a directory this user made ({why}); remove it, or rerun without --resume"
        )
    return True


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
            if record not in kept or not NAME.fullmatch(entry.name):
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
