"""save_hf / load_hf on CUDA with nccl: FSDP2 over every visible GPU, and plain CUDA tensors in one process.

The oracle is the CPU job of test_live.py (gloo, 2 ranks): the same seeded model on GPUs must give the same
bytes, and files saved on the CPU must load onto GPUs bit for bit. Two process groups a training job uses:
nccl alone (the usual `init_process_group("nccl")`: ckptconv's object collectives then run on the GPU) and
`cpu:gloo,cuda:nccl` (torchtitan's). CI has no GPU, so the module is skipped there, saying why; on a GPU
machine `python -m pytest tests/jobs/test_gpu.py` runs it (docs/development.md), and the README records the
run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import WORKERS, ckptconv, torchrun, tree_sha256

import ckptconv as lib

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    GPUS == 0 or not dist.is_nccl_available(),
    reason="needs a CUDA GPU and nccl (CI has none; run on a GPU machine: docs/development.md)",
)
BACKENDS = ("nccl", "cpu:gloo,cuda:nccl")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The seeded Tiny model saved by save_hf (and dcp.save) from a gloo job on 2 CPU ranks and from FSDP2
    on every GPU under each backend."""
    root = tmp_path_factory.mktemp("gpu")
    out = {"gloo": root / "gloo"}
    out["gloo"].mkdir()
    torchrun(2, str(WORKERS / "live.py"), "save", str(out["gloo"]), "fsdp2")
    for i, backend in enumerate(BACKENDS):
        out[backend] = root / f"backend{i}"
        out[backend].mkdir()
        torchrun(GPUS, str(WORKERS / "live.py"), "save", str(out[backend]), "fsdp2", backend)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_hf_on_gpus_writes_the_bytes_of_the_cpu_job(saved: dict[str, Path], backend: str) -> None:
    for release in ("live", "live_fp8"):  # bf16 with fp32 A_log, and the block-FP8 release
        files = tree_sha256(saved[backend] / release)
        assert any(n.endswith(".safetensors") for n in files), files
        assert files == tree_sha256(saved["gloo"] / release), (backend, release)
    report = json.loads((saved[backend] / "report.json").read_text())
    assert report["rounds"] > 2 and report["max_round_bytes"] <= 512, report  # the 512-byte budget held
    # FSDP2 on one GPU shards nothing (a 1-rank mesh): no collective runs, the local data goes to the host
    assert (report["collectives"] > 0) == (GPUS > 1), report


def test_dcp_saved_on_gpus_converts_to_the_same_bytes(saved: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "release"
    flags = ("--fp32", "A_log$", "--max-shard-size", "300")
    proc = ckptconv("dcp-to-hf", str(saved["nccl"] / "dcp"), str(out), *flags)
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(out) == tree_sha256(saved["gloo"] / "live")


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_hf_into_an_fsdp2_model_on_gpus(saved: dict[str, Path], backend: str) -> None:
    """Files written by the CPU job load into a differently seeded bf16 model sharded over the GPUs."""
    proc = torchrun(GPUS, str(WORKERS / "live.py"), "load", str(saved["gloo"]), "fsdp2", backend)
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["loaded"] == 16 and not doc["missing"] and not doc["unexpected"]
    assert all(same for _, same in doc["same"].values()), doc["same"]  # bit for bit against the saved values
    assert doc["replaced"] == ["layers.0.A_log", "layers.1.A_log"]  # fp32 kept, as a new DTensor
    assert doc["same"]["layers.0.A_log"][0] == "float32" and doc["same"]["embed.weight"][0] == "bfloat16"
    assert doc["devices"] == ["cuda:0"], doc["devices"]  # replaced tensors too stay on the rank's GPU


def test_plain_cuda_tensors_in_one_process(tmp_path: Path) -> None:
    """No process group: a state dict of CUDA tensors saves as the same tensors on the CPU do, and loads back
    in place on the GPU."""
    g = torch.Generator().manual_seed(5)
    cpu = {
        "w": torch.randn(64, 33, generator=g),
        "A_log": torch.randn(7, generator=g),
        "ids": torch.arange(9),
        "mask": torch.tensor([True, False, True]),
    }
    lib.save_hf(cpu, tmp_path / "cpu", fp32=("A_log$",))
    lib.save_hf({k: v.cuda() for k, v in cpu.items()}, tmp_path / "gpu", fp32=("A_log$",))
    assert tree_sha256(tmp_path / "gpu") == tree_sha256(tmp_path / "cpu")
    target = {
        "w": torch.zeros(64, 33, dtype=torch.bfloat16, device="cuda"),
        "A_log": torch.zeros(7, device="cuda"),
        "ids": torch.zeros(9, dtype=torch.int64, device="cuda"),
        "mask": torch.zeros(3, dtype=torch.bool, device="cuda"),
    }
    before = {k: v.data_ptr() for k, v in target.items()}
    report = lib.load_hf(target, tmp_path / "gpu")
    assert sorted(report.loaded) == sorted(cpu) and not report.replaced
    assert {k: v.data_ptr() for k, v in target.items()} == before  # filled in place, on the GPU
    assert torch.equal(target["w"].cpu(), cpu["w"].to(torch.bfloat16))
    assert torch.equal(target["A_log"].cpu(), cpu["A_log"])
    assert torch.equal(target["ids"].cpu(), cpu["ids"]) and torch.equal(target["mask"].cpu(), cpu["mask"])
