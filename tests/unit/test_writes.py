"""Tensor-level parallel writing: which rank writes which bytes (`writes.plan_writes`), and that a row slab of
any mapped tensor assembles to exactly those rows of the whole tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ckptconv, tree_sha256
from families import tiny
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pure import fake_ckpt

from ckptconv.core.dtypes import DtypePolicy
from ckptconv.formats.dcp import open_dcp
from ckptconv.formats.dcp_reader import DcpReader
from ckptconv.formats.safetensors_io import Entry, header_bytes
from ckptconv.mapping import load_config, load_mapping
from ckptconv.plan.to_hf import plan_dcp_to_hf
from ckptconv.plan.types import rows_of
from ckptconv.plan.writes import MIN_PIECE, bytes_per_rank, plan_writes
from ckptconv.publish.parts import PART_BYTES, plan_pieces
from ckptconv.stream.unshard import assemble, direct_rows

shapes = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 6), st.sampled_from([torch.float32, torch.bfloat16])),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(1, 9), st.integers(200, 3000), st.sampled_from(["tensor", "file"]))
def test_writes_cover_every_byte_once_and_balance(spec, world, shard, granularity) -> None:
    ckpt = fake_ckpt({f"model.t{i}": ((r, c) if r else (c,), d) for i, (r, c, d) in enumerate(spec)})
    plan = plan_dcp_to_hf(
        ckpt, DtypePolicy(None), max_shard_size=shard, world_size=world, write_granularity=granularity
    )
    assert plan_writes(plan.files, world, granularity) == plan.writes  # pure: the same on every rank
    for f in plan.files:
        entries = [Entry(t.hf_key, t.dtype, t.shape) for t in f.tensors]
        offsets, at = {}, 0
        for e in entries:
            offsets[e.key], at = at, at + e.nbytes
        ranges = sorted(
            (offsets[w.tensor.hf_key] + w.start, w.nbytes) for w in plan.writes if w.file.name == f.name
        )
        position = 0
        for start, n in ranges:  # the file's data, tiled exactly
            assert start == position
            position += n
        assert position == f.nbytes
        headers = [w for w in plan.writes if w.file.name == f.name and w.header]
        assert len(headers) == 1 and headers[0] is next(w for w in plan.writes if w.file.name == f.name)
        assert len(header_bytes(entries)) > 8
    loads = bytes_per_rank(plan.writes, world)
    assert sum(loads) == plan.total_size
    if granularity == "file" or world == 1:
        assert all(w.whole and w.rank == w.file.owner for w in plan.writes)
        return
    ranks = [w.rank for w in plan.writes]
    assert ranks == sorted(ranks)  # each rank writes one contiguous run of the stream
    unit = max(
        (t.nbytes if rows_of(t) < 2 else t.nbytes // rows_of(t)) for f in plan.files for t in f.tensors
    )
    share = -(-plan.total_size // world)
    assert max(loads) <= share + unit, (loads, unit)


def test_every_rank_busy_with_fewer_files_than_ranks() -> None:
    """Two files of 8 MiB on 8 ranks: file ownership would keep 6 ranks idle; tensor writes give each rank
    its eighth, cutting tensors into row slabs."""
    ckpt = fake_ckpt({f"model.w{i}": ((1024, 1024), torch.float32) for i in range(4)})
    plan = plan_dcp_to_hf(ckpt, DtypePolicy(None), max_shard_size=9 * 2**20, world_size=8)
    assert len(plan.files) == 2
    assert bytes_per_rank(plan.writes, 8) == [2**21] * 8
    assert sum(not w.whole for w in plan.writes) == 8
    by_file = plan_dcp_to_hf(
        ckpt, DtypePolicy(None), max_shard_size=9 * 2**20, world_size=8, write_granularity="file"
    )
    assert sorted(bytes_per_rank(by_file.writes, 8)) == [0] * 6 + [2**23] * 2


big_shapes = st.lists(
    st.tuples(st.integers(0, 3000), st.integers(1, 3000), st.sampled_from([torch.float32, torch.bfloat16])),
    min_size=1,
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(big_shapes, st.integers(1, 9), st.integers(1, 80))
def test_parts_of_one_object_from_many_ranks(spec, world, shard_mib) -> None:
    """An OUT in S3 ("parts"): every rank writes one piece of each file it touches, each piece but a file's
    last at least 5 MiB (S3's smallest part), the pieces tile the file, and their parts are numbered in file
    order from 1, each part but the file's last at least 5 MiB, none above twice PART_BYTES."""
    ckpt = fake_ckpt({f"model.t{i}": ((r, c) if r else (c,), d) for i, (r, c, d) in enumerate(spec)})
    shard = shard_mib << 20
    plan = plan_dcp_to_hf(
        ckpt, DtypePolicy(None), max_shard_size=shard, world_size=world, write_granularity="parts"
    )
    ranks = [w.rank for w in plan.writes]
    assert ranks == sorted(ranks)  # still one contiguous run of the stream per rank
    pieces = plan_pieces(plan.files, plan.writes)  # raises unless they tile each file, one per rank
    assert [p.file for p in pieces] == sorted(
        (p.file for p in pieces), key=[f.name for f in plan.files].index
    )
    for f in plan.files:
        mine = [p for p in pieces if p.file == f.name]
        sizes = [s for p in mine for s in p.part_sizes()]
        assert [p.first_part for p in mine] == [
            1 + sum(len(q.part_sizes()) for q in mine[:i]) for i in range(len(mine))
        ]
        assert all(p.end - p.start >= MIN_PIECE for p in mine[:-1])
        assert all(MIN_PIECE <= s < 2 * PART_BYTES for s in sizes[:-1]) and 0 < sizes[-1] < 2 * PART_BYTES
        assert sum(sizes) == mine[-1].end and mine[0].start == 0
        for p in mine:
            for offset in (p.start, p.end - 1):
                number, first, size = p.part_at(offset)
                assert first <= offset < first + size and p.first_part <= number < p.first_part + len(
                    p.part_sizes()
                )
    assert sum(bytes_per_rank(plan.writes, world)) == plan.total_size


CASES = {  # family, options, preset: permuted q/k (llama), stacked experts (qwen3 moe), interleaved (gpt-oss)
    "llama": ("llama", {}, "torchtitan-llama3"),
    "qwen3-moe": ("qwen3", {"moe": True, "experts": 3}, "torchtitan-qwen3"),
    "gpt-oss": ("gpt_oss", {}, "torchtitan-gpt-oss"),
}


@pytest.mark.parametrize("name", CASES)
def test_slabs_of_mapped_tensors_equal_rows_of_the_whole(name: str, tmp_path: Path) -> None:
    """Every write of a plan at 2..7 ranks, assembled on its own (a row slab through the mapping's parts),
    equals those rows of the tensor assembled whole; the DCP is saved by 2 ranks (chunks cut by rows)."""
    family, options, preset = CASES[name]
    hf = tiny(family, tmp_path / "hf", **options)
    dcp = tmp_path / "dcp"
    proc = ckptconv("hf-to-dcp", str(hf), str(dcp), "--mapping", preset, nproc=2)
    assert proc.returncode == 0, proc.stderr
    ckpt = open_dcp(dcp)
    mapping, config = load_mapping(preset), load_config(dcp / "config.json")
    slabs = 0
    with DcpReader(ckpt) as reader:
        rows = direct_rows(reader)
        whole = {}
        for world in range(2, 8):
            policy = DtypePolicy(None)
            plan = plan_dcp_to_hf(
                ckpt, policy, max_shard_size=2**40, world_size=world, mapping=mapping, config=config
            )
            for w in plan.writes:
                if w.whole:
                    continue
                slabs += 1
                t = w.tensor
                if t.hf_key not in whole:
                    whole[t.hf_key] = assemble(t, rows, reader).view(t.layout or t.shape)
                got = assemble(t, rows, reader, w.window)
                assert torch.equal(got, whole[t.hf_key][w.lo : w.hi]), (t.hf_key, w.lo, w.hi, t.op)
    assert slabs > 10
    ops = {w.tensor.op for w in plan.writes}
    assert len(ops) > 1, ops


def test_cli_ranks_report_and_granularities_agree(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """Under torchrun, --json's `ranks` says what each rank read and wrote; tensor and file granularity
    write the same bytes."""
    shas = {}
    for granularity in ("tensor", "file"):
        out = tmp_path / granularity
        args = ["--max-shard-size", "5GB", "--write-granularity", granularity, "--json"]
        proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), *args, nproc=3)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        ranks = report["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2]
        size = (out / "model.safetensors").stat().st_size
        assert sum(r["bytes_written"] for r in ranks) == size
        assert report["files"][0]["ranks"] == ([0, 1, 2] if granularity == "tensor" else [0])
        if granularity == "tensor":
            assert all(r["bytes_written"] > 0 and r["bytes_read"] > 0 for r in ranks)
        else:
            assert [r["bytes_written"] > 0 for r in ranks] == [True, False, False]
        shas[granularity] = tree_sha256(out)
    assert shas["tensor"] == shas["file"]
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(tmp_path / "x"), "--write-granularity", "rows")
    assert proc.returncode == 2 and "--write-granularity 'rows'" in proc.stderr
