"""`--resume`'s pure parts: byte ranges and their coverage, fingerprint stability, and records read as inputs
(bounded, typed, a malformed one not trusted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptconv.errors import CkptconvError
from ckptconv.options import DcpToHfOptions, DtypeOptions, OutputOptions
from ckptconv.plan.coverage import covers, file_size, merged, plan_digest, rank_ranges
from ckptconv.plan.types import HfSavePlan, OutFile, OutTensor, SourcePart
from ckptconv.plan.writes import plan_writes
from ckptconv.publish.resume import (
    MAX_RANGES,
    RECORD_BYTES,
    RECORDS,
    Resume,
    options_digest,
    parse_record,
    read_records,
    record_bytes,
    write_record,
)
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
        b"[" * 100_000,
        b" " * (RECORD_BYTES + 1),
    ],
)
def test_a_malformed_record_is_not_trusted(raw: bytes) -> None:
    assert parse_record(raw) is None


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
