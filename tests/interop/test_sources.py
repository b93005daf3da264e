"""Where a run keeps its checkpoint one level down (accelerate's pytorch_model_fsdp_0/, Megatron's
iter_0000100/, torchtitan's step-N/): dcp-to-hf takes the one checkpoint inside, and names them when there
are several. accelerate's layout is written by accelerate 1.15.0's own FSDP writers (pinned in
support/accelerate-requirements.txt, installed --no-deps --target into .cache like support/megatron.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT, SUPPORT, WORKERS
from pinned import install_pinned
from safetensors.torch import load_file
from test_bad_input import assert_one_line, run

ACCELERATE = SUPPORT / "accelerate-requirements.txt"


def save(path: Path, value: float) -> None:
    dcp.save({"model": {"w": torch.full((2, 3), value)}}, checkpoint_id=str(path), no_dist=True)


def test_one_checkpoint_inside_is_taken_several_are_named(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    save(run_dir / "step-10", 1.0)
    (run_dir / "notes.txt").parent.mkdir(exist_ok=True)
    (run_dir / "notes.txt").write_text("not a checkpoint")
    code, err = run(capsys, "dcp-to-hf", str(run_dir), str(tmp_path / "hf"))
    assert code == 0, err
    assert f"{run_dir}: holds one checkpoint, {run_dir / 'step-10'}; converting it" in err
    save(run_dir / "step-2", 2.0)
    code, err = run(capsys, "dcp-to-hf", str(run_dir), str(tmp_path / "hf2"))
    assert_one_line(code, err, "holds 2 DCP checkpoints (step-2/, step-10/); point at one of them")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = run(capsys, "dcp-to-hf", str(empty), str(tmp_path / "hf3"))
    assert_one_line(code, err, "not a DCP checkpoint (no .metadata inside)")


@pytest.mark.slow
def test_accelerate_save_state_directory_converts_its_model(tmp_path: Path, capsys) -> None:
    target = install_pinned(ROOT / ".cache" / "accelerate-1.15.0", ACCELERATE)
    out = tmp_path / "save_state"
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(WORKERS / "accelerate_save.py"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    code, err = run(capsys, "dcp-to-hf", str(out), str(tmp_path / "hf"), "--dtype", "keep")
    assert code == 0, err
    assert f"holds one checkpoint, {out / 'pytorch_model_fsdp_0'}; converting it" in err
    want = torch.load(tmp_path / "expected.pt", weights_only=True)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
