"""`--resume`'s pure parts: byte ranges and their coverage, fingerprint stability, and records read as inputs
(bounded, typed, a malformed one not trusted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptconv.errors import CkptconvError
from ckptconv.options import DcpToHfOptions, DtypeOptions, OutputOptions
from ckptconv.plan.coverage import covers, file_size, merged, plan_digest, range_crcs, rank_ranges
from ckptconv.plan.types import HfSavePlan, OutFile, OutTensor, SourcePart
from ckptconv.plan.writes import plan_writes
from ckptconv.publish.records import (
    MAX_RANGES,
    RECORD_BYTES,
    RECORDS,
    parse_record,
    read_records,
    record_bytes,
    write_record,
)
from ckptconv.publish.resume import Resume, options_digest
from ckptconv.run.hf_staging import OUTPUT_ONLY

FP = ("s" * 64, "o" * 64, "p" * 64)


def _plan(world_size: int, rows: int = 64) -> HfSavePlan:
    files = []
    for k in range(3):
        tensors = tuple(
            OutTensor(f"layers.{k}.w{i}", (rows, 16), torch.float32, (_part(rows),)) for i in range(2)
        )
        files.append(OutFile(f"model-0000{k + 1}-of-00003.safetensors", tensors, owner=k % world_size))
    writes = plan_writes(files, world_size, "tensor")
    return HfSavePlan(tuple(files), (), (), (), world_size, writes=writes)


def _part(rows: int) -> SourcePart:
    from ckptconv.core.specs import TensorSpec
    from ckptconv.mapping.parts import Part

    spec = TensorSpec("x", "float32", (rows, 16))
    return SourcePart(spec, Part("x", (0, 0), (rows, 16), (0, 0), (rows, 16)))


def test_merged_and_covers() -> None:
    assert merged([(5, 9), (0, 5), (9, 9), (20, 30), (25, 26)]) == [(0, 9), (20, 30)]
    assert covers([(0, 4), (4, 10)], 10) and not covers([(0, 4), (5, 10)], 10)
    assert not covers([(0, 11)], 10) and not covers([], 10) and covers([], 0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_every_rank_together_covers_every_file_once(world_size: int) -> None:
    plan = _plan(world_size)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for rank in range(world_size):
        for name, ranges in rank_ranges(plan, rank).items():
            by_file.setdefault(name, []).extend(ranges)
    for f in plan.files:
        ranges = sorted(by_file[f.name])
        assert covers(ranges, file_size(f))
        assert sum(hi - lo for lo, hi in ranges) == file_size(f)  # no byte written twice


def test_plan_digest_is_the_same_at_any_world_size_and_changes_with_the_plan() -> None:
    assert plan_digest(_plan(1).files) == plan_digest(_plan(4).files)
    assert plan_digest(_plan(1).files) != plan_digest(_plan(1, rows=65).files)


def test_options_digest_ignores_output_only_options() -> None:
    base = DcpToHfOptions()
    same = DcpToHfOptions(output=OutputOptions(fsync=False, resume=True, verify=True), bucket_size="8MB")
    other = DcpToHfOptions(dtype=DtypeOptions(dtype="fp16"))
    assert options_digest(base, OUTPUT_ONLY) == options_digest(same, OUTPUT_ONLY)
    assert options_digest(base, OUTPUT_ONLY) != options_digest(other, OUTPUT_ONLY)


def _doc(**changes: object) -> bytes:
    doc = json.loads(record_bytes(FP, "a.safetensors", 100, [[0, 100, 7]]))
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        _doc(version=2),
        _doc(version=True),  # a bool is not the version 1
        _doc(version=1.0),
        _doc(file="../x"),
        _doc(file=""),
        _doc(size=-1),
        _doc(size=True),
        _doc(size=1.5),
        _doc(ranges=[[0, 101, 7]]),  # past the planned size
        _doc(ranges=[[5, 5, 7]]),  # empty
        _doc(ranges=[[0, 10, 2**32]]),
        _doc(ranges=[[0, 10]]),
        _doc(ranges=[[0, "10", 1]]),
        _doc(ranges=[[0, 1, 0]] * (MAX_RANGES + 1)),
        _doc(fingerprint={"source": "s"}),
        _doc(fingerprint={"source": 1, "options": "o", "plan": "p"}),
        _doc(items={"a": 1}),  # a DCP data file's items: a list of [fqn, offsets, index, start, length]
        _doc(items=[["w", [0, 0], None, 0]]),
        _doc(items=[["w", [0, -1], None, 0, 10]]),
        _doc(items=[[7, [0], None, 0, 10]]),
        _doc(items=[["w", [0], "0", 0, 10]]),
        _doc(items=[["w", [0], None, 95, 10]]),  # past the file's size
        b"[" * 100_000,
        b" " * (RECORD_BYTES + 1),
    ],
)
def test_a_malformed_record_is_not_trusted(raw: bytes) -> None:
    assert parse_record(raw) is None


def test_a_dcp_records_items_round_trip_and_another_world_size_is_refused(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "__1_0.distcp").write_bytes(b"y" * 30)
    import zlib

    items = [("a.w", (0, 0), None, 0, 10), ("b", (), 3, 10, 20)]
    write_record(staging, FP, "__1_0.distcp", 30, [[0, 30, zlib.crc32(b"y" * 30)]], 1, 2, items)
    [record] = read_records(staging)
    assert record.items == tuple(items) and record.world_size == 2
    with pytest.raises(CkptconvError, match=r"written by 2 rank\(s\) and this run has 3"):
        Resume(FP, {"__1_0.distcp": None}, True, ranks=3).keep(staging, fsync=False)
    resume = Resume(FP, {"__1_0.distcp": None}, True, ranks=2)
    resume.kept = resume.keep(staging, fsync=False)
    assert resume.kept == {"__1_0.distcp"} and resume.items(staging, ["__1_0.distcp"]) == {
        "__1_0.distcp": tuple(items)
    }


def test_records_round_trip_and_a_changed_fingerprint_is_refused(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    data = bytes(range(256)) * 4
    (staging / "a.safetensors").write_bytes(data)
    import zlib

    write_record(staging, FP, "a.safetensors", len(data), [[0, len(data), zlib.crc32(data)]], 0, 1)
    (staging / RECORDS / "junk.json").write_text("{}")  # not a record's name: ignored
    (staging / RECORDS / "b.safetensors.r0-1.json").write_bytes(b"\x00" * 10)  # malformed: ignored
    assert [r.file for r in read_records(staging)] == ["a.safetensors"]

    kept = Resume(FP, {"a.safetensors": len(data), "b.safetensors": 9}, True).keep(staging, fsync=False)
    assert kept == {"a.safetensors"}
    assert sorted(p.name for p in staging.iterdir()) == [RECORDS, "a.safetensors"]

    changed = (FP[0], "x" * 64, FP[2])
    with pytest.raises(CkptconvError, match="the options changed since"):
        Resume(changed, {"a.safetensors": len(data)}, True).keep(staging, fsync=False)


def test_a_file_that_fails_its_crc_is_not_kept(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    data = b"x" * 1000
    (staging / "a.safetensors").write_bytes(data)
    import zlib

    write_record(staging, FP, "a.safetensors", 1000, [[0, 600, zlib.crc32(data[:600])]], 0, 2)
    write_record(staging, FP, "a.safetensors", 1000, [[600, 1000, zlib.crc32(data[600:]) ^ 1]], 1, 2)
    assert Resume(FP, {"a.safetensors": 1000}, True).keep(staging, fsync=False) == frozenset()
    assert not (staging / "a.safetensors").exists()


def test_the_writers_crcs_from_memory_are_the_files_ranges_crcs(tmp_path: Path) -> None:
    """Writes out of order (the first tensor in two slabs, the second between them): the CRC-32 of each merged
    range, made from the pieces the writer computed in memory, is zlib's of the file's bytes."""
    import zlib

    from ckptconv.formats.safetensors_io import Entry, SafetensorsWriter

    a, b = torch.arange(48, dtype=torch.float32).reshape(12, 4), torch.arange(8, dtype=torch.int16)
    writer = SafetensorsWriter(
        tmp_path / "f", [Entry("a", a.dtype, (12, 4)), Entry("b", b.dtype, (8,))], crc=True
    )
    writer.write("a", a[:6])
    writer.write("b", b)
    writer.write("a", a[6:], 6 * 16)
    writer.close()
    data = (tmp_path / "f").read_bytes()
    assert writer.crcs is not None and len(writer.crcs) == 3  # header + a's first slab ran on as one piece
    assert range_crcs([(0, len(data))], writer.crcs) == [[0, len(data), zlib.crc32(data)]]
    head = len(data) - a.nbytes - b.nbytes
    split = [(0, head + 96), (head + 96, len(data))]
    assert range_crcs(split, writer.crcs) == [[lo, hi, zlib.crc32(data[lo:hi])] for lo, hi in split]
    assert range_crcs([(0, len(data) - 1)], writer.crcs) is None  # a piece past the range
    assert range_crcs([(0, len(data)), (len(data), len(data) + 4)], writer.crcs) is None  # a gap
    assert range_crcs([(0, 8)], [(0, 4, 1), (2, 6, 2)]) is None  # an overlap


def _one_file(tmp_path: Path, data: bytes = b"x" * 1000) -> tuple[Path, bytes]:
    """A staging directory holding `a.safetensors` and its record (one range, the whole file)."""
    import zlib

    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    (staging / "a.safetensors").write_bytes(data)
    write_record(staging, FP, "a.safetensors", len(data), [[0, len(data), zlib.crc32(data)]], 0, 1)
    return staging, data


@pytest.mark.parametrize("what", ["symlink", "file", "uid", "group", "others"])
def test_a_staging_path_this_user_did_not_make_is_refused_and_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """--resume lstat()s the staging path before it reads, keeps or removes anything: a symlink, a file, a
    directory of another user or writable by group or others: one line, nothing inside or outside touched."""
    import os

    import ckptconv.publish.resume as resume_module

    real, data = _one_file(tmp_path)
    (real / "stray").write_text("s")
    staging, why = real, {"group": "writable by others", "others": "writable by others"}.get(what, "")
    if what == "symlink":
        staging, why = tmp_path / "link", "a symlink"
        staging.symlink_to(real)
    elif what == "file":
        staging, why = tmp_path / "file", "not a directory"
        staging.write_text("f")
    elif what == "uid":
        monkeypatch.setattr(resume_module.os, "geteuid", lambda: os.getuid() + 1)
        why = f"owned by uid {os.getuid()}"
    else:
        real.chmod(0o775 if what == "group" else 0o757)
    before = sorted(p.name for p in real.iterdir())
    with pytest.raises(CkptconvError, match=rf"not a directory this user made \({why}\); remove it, or"):
        Resume(FP, {"a.safetensors": len(data)}, True).keep(staging, fsync=False)
    assert sorted(p.name for p in real.iterdir()) == before and (real / "stray").exists()


def test_a_kept_file_that_is_a_hard_link_is_not_trusted(tmp_path: Path) -> None:
    """A kept file with another name (st_nlink 2): that name could change the release; written again."""
    import os

    staging, data = _one_file(tmp_path)
    os.link(staging / "a.safetensors", tmp_path / "outside")
    assert Resume(FP, {"a.safetensors": len(data)}, True).keep(staging, fsync=False) == frozenset()
    assert not (staging / "a.safetensors").exists() and (tmp_path / "outside").read_bytes() == data


def test_overlapping_ranges_are_not_trusted(tmp_path: Path) -> None:
    """Records whose ranges overlap (across records or within one) are not a writer's: the file is written
    again (so the CRC work of a resume is at most the file's size)."""
    import zlib

    staging, data = _one_file(tmp_path)
    crc = zlib.crc32
    write_record(staging, FP, "a.safetensors", 1000, [[500, 1000, crc(data[500:])]], 1, 2)
    assert Resume(FP, {"a.safetensors": 1000}, True).keep(staging, fsync=False) == frozenset()
    staging, data = _one_file(tmp_path)
    within = [[0, 600, crc(data[:600])], [500, 1000, crc(data[500:])]]
    write_record(staging, FP, "a.safetensors", 1000, within, 0, 1)
    assert Resume(FP, {"a.safetensors": 1000}, True).keep(staging, fsync=False) == frozenset()


def test_prepare_removes_a_symlinked_or_file_staging_path_itself(tmp_path: Path) -> None:
    """Without --resume a stale staging path is removed: a symlink itself (never its target), a file; the new
    staging directory is 0700 while it is written."""
    import os
    import stat

    from ckptconv.publish.outdir import prepare, staging_dir

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x").write_text("mine")
    out = tmp_path / "out"
    staging_dir(out).symlink_to(victim)
    staging = prepare(out)
    assert staging.is_dir() and not staging.is_symlink() and list(staging.iterdir()) == []
    assert stat.S_IMODE(os.lstat(staging).st_mode) == 0o700 and (victim / "x").read_text() == "mine"
    staging.rmdir()
    staging.write_text("f")
    assert prepare(out).is_dir()


def test_options_digest_changes_with_what_the_option_files_hold(tmp_path: Path) -> None:
    """A file a Path-valued option names (--config, --lora-config, a --copy-from directory's config.json) or a
    mapping TOML, rewritten with its size and mtime set back: another options digest."""
    import os

    from ckptconv.lora.select import LoraRequest
    from ckptconv.options import MappingOptions

    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "sub").mkdir()
    files = [tmp_path / n for n in ("map.toml", "config.json", "lora.json", "copy/config.json", "copy/sub/t")]
    for f in files:
        f.write_text("abc")
    options = DcpToHfOptions(
        mapping=MappingOptions(mapping=str(files[0]), config=files[1]),
        lora=LoraRequest(mode="adapter", config=files[2]),
        copy_from=tmp_path / "copy",
    )
    seen = {options_digest(options, OUTPUT_ONLY)}
    for f in files:
        st = f.stat()
        f.write_text("abd")
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        seen.add(options_digest(options, OUTPUT_ONLY))
    assert len(seen) == len(files) + 1
