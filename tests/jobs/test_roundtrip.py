"""Property-based round trips: random shapes, dtypes and placements saved by real DCP jobs at 2 and 4 ranks.

DCP -> HF is byte-identical for 1, 2 and 3 converting ranks and both read paths, values are the saved ones
bit for bit (dtypes kept), HF -> DCP -> HF gives the same files again, and `dcp.load` of the DCP made from HF
gives the saved values. CI runs a few seeds; `CKPTCONV_ROUNDTRIP_SEEDS=20` runs more.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain

SEEDS = [(seed, 2 + 2 * (seed % 2)) for seed in range(int(os.environ.get("CKPTCONV_ROUNDTRIP_SEEDS", "2")))]


@pytest.mark.parametrize(("seed", "saved_on"), SEEDS)
def test_random_round_trip(tmp_path: Path, seed: int, saved_on: int) -> None:
    ckpt = tmp_path / "ckpt"
    torchrun(saved_on, str(WORKERS / "random_dcp.py"), str(ckpt), str(seed))
    ref = torch.load(str(ckpt) + ".ref.pt", weights_only=True)
    hashes = []
    for nproc, read in ((0, "direct"), (2, "direct"), (3, "gather")):
        out = tmp_path / f"hf-{nproc}-{read}"
        proc = ckptconv(
            "dcp-to-hf",
            str(ckpt),
            str(out),
            "--dtype",
            "keep",
            "--max-shard-size",
            "600",
            "--read",
            read,
            nproc=nproc,
        )
        assert proc.returncode == 0, proc.stderr
        hashes.append(tree_sha256(out))
    assert hashes[0] == hashes[1] == hashes[2]
    hf = tmp_path / "hf-0-direct"
    got = load_dir(hf)
    assert set(got) == set(ref)
    for key, value in ref.items():
        assert got[key].dtype == value.dtype and same_bits(got[key], value), key
    # the default --dtype bf16 casts floating tensors with Tensor.to and leaves int, bool and fp8 bit for bit
    bf16 = tmp_path / "bf16"
    proc = ckptconv("dcp-to-hf", str(ckpt), str(bf16), "--fp32", "A_log$", nproc=2)
    assert proc.returncode == 0, proc.stderr
    for key, got in load_dir(bf16).items():
        value = ref[key]
        if value.dtype in (torch.float32, torch.float16, torch.bfloat16):
            want = value.to(torch.float32 if key.endswith("A_log") else torch.bfloat16)
        else:
            want = value  # int8, int64, bool, fp8: never through a float path
        assert same_bits(got, want), key
    back = tmp_path / "back"
    proc = ckptconv("hf-to-dcp", str(hf), str(back), "--prefix", "model.", nproc=2)
    assert proc.returncode == 0, proc.stderr
    state = load_plain(back)
    for key, value in ref.items():
        assert same_bits(state[f"model.{key}"], value), key  # type: ignore[arg-type]
    again = tmp_path / "again"
    proc = ckptconv("dcp-to-hf", str(back), str(again), "--dtype", "keep", "--max-shard-size", "600")
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(again) == hashes[0]
