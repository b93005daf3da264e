"""Where a run keeps its checkpoint one level down (accelerate's pytorch_model_fsdp_0/, Megatron's
iter_0000100/, torchtitan's step-N/): dcp-to-hf takes the one checkpoint inside, and names them when there
are several."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from test_bad_input import assert_one_line, run


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
