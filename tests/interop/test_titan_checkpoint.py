"""What a release carries, for a checkpoint written by torchtitan 0.3.0's own CheckpointManager.

workers/titan_checkpoint.py trains a tiny torchtitan llama3 (sharded with torchtitan's FSDP2 setup over
2 gloo ranks) for one step with torchtitan's optimizer and LR-scheduler containers and dataloader, and saves
with `CheckpointManager.save`: OUT/checkpoint/step-1 holds the model's tensors at the top level (torchtitan
flattens the model state), and the `optimizer`, `lr_scheduler`, `dataloader` and `train_state` groups (the
Trainer's state_dict: step and ntokens_seen). OUT/tensor_step/... is the same save with the step as a 0-d
int32 tensor, as older torchtitan stored it. dcp-to-hf must write the model only, stash the progress, leave
the trainer state out unless asked, never the optimizer; hf-to-dcp must give the progress back to dcp.load
in torchtitan's layout. tests/interop/test_trainer_state.py does the same checks with torch's own writers.
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS
from families import tiny
from safetensors.torch import load_file, save_file
from test_bad_input import run
from test_dcp_to_hf import load_dir, same_bits
from titan import run_adapter, run_titan_job
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

from ckptconv.core.specs import StashedItem
from ckptconv.formats.stash import read_stash

WORKER = WORKERS / "titan_checkpoint.py"
STEP_DIR = "step-1"
TRAINER_GROUPS = ("dataloader", "lr_scheduler")


@dataclass(frozen=True)
class TitanRun:
    hf: Path  # the tiny transformers Llama whose config.json the torchtitan model was built from
    out: Path
    expected: dict[str, Any]

    def ckpt(self, variant: str = "int") -> Path:
        base = self.out if variant == "int" else self.out / "tensor_step"
        return base / "checkpoint" / STEP_DIR


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory: pytest.TempPathFactory) -> TitanRun:
    root = tmp_path_factory.mktemp("titan_ckpt")
    hf = tiny("llama", root / "hf")
    out = root / "out"
    run_titan_job(2, WORKER, str(hf / "config.json"), str(out))
    return TitanRun(hf, out, torch.load(out / "expected.pt", weights_only=True))


class Trainer(Stateful):
    """What torchtitan's CheckpointManager hands dcp.load as "train_state": the Trainer, whose
    state_dict()/load_state_dict() are {"step": ..., "ntokens_seen": ...} (torchtitan/trainer.py)."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def _stash(out: Path) -> dict[str, StashedItem]:
    return {i.key: i for i in read_stash(out)}


def _saved_keys(ckpt: Path) -> set[str]:
    return set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def _left_out_note(expected: dict[str, Any]) -> str:
    counts = {"dataloader": len(expected["dataloader"]), "lr_scheduler": len(expected["lr_scheduler"])}
    return "leaving out trainer state " + ", ".join(f"{g!r} ({counts[g]})" for g in TRAINER_GROUPS)


@pytest.mark.slow
def test_checkpoint_is_torchtitans_layout(titan_run: TitanRun) -> None:
    """The checkpoint holds what the other tests say ckptconv leaves out: their checks are not vacuous."""
    expected = titan_run.expected
    keys = _saved_keys(titan_run.ckpt())
    model = set(expected["model"])
    assert model <= keys  # flattened at the top level, torchtitan's names

    def under(group: str) -> set[str]:
        return {k for k in keys if k.startswith(group + ".")}

    assert under("optimizer") == {f"optimizer.{k}" for k in expected["optimizer"]}
    assert any(k.startswith("optimizer.state.") for k in keys)
    for group in TRAINER_GROUPS:
        assert under(group) == {f"{group}.{k}" for k in expected[group]}
    assert under("train_state") == {"train_state.step", "train_state.ntokens_seen"}
    groups = ("optimizer", *TRAINER_GROUPS, "train_state")
    assert keys == model.union(*(under(g) for g in groups))  # nothing else
    assert expected["train_state"] == {"step": 1, "ntokens_seen": 16}
    assert expected["lr_scheduler"] == {"last_epoch": 1}
    assert set(expected["dataloader"]) == {"dp_rank_0", "dp_rank_1", "world_size"}
    assert expected["dataloader"]["dp_rank_0"] != expected["dataloader"]["dp_rank_1"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["int", "tensor"])
def test_release_has_the_model_and_progress_only(
    titan_run: TitanRun, variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = titan_run.expected
    out = tmp_path / "hf"
    code, err = run(capsys, "dcp-to-hf", str(titan_run.ckpt(variant)), str(out), "--dtype", "keep")
    assert code == 0, err
    got = load_dir(out)
    assert set(got) == set(expected["model"])  # no optimizer, lr_scheduler, dataloader or train_state key
    assert all(same_bits(got[k], v) for k, v in expected["model"].items())
    assert sorted(p.name for p in out.iterdir()) == ["ckptconv_state.json", "model.safetensors"]
    items = _stash(out)
    assert set(items) == {"train_state.step", "train_state.ntokens_seen"}
    step, tokens = items["train_state.step"], items["train_state.ntokens_seen"]
    assert step.path == ("train_state", "step") and step.has_value
    assert step.value == expected["train_state"]["step"]
    assert step.tensor == ("int32" if variant == "tensor" else None)
    assert tokens.has_value and tokens.tensor is None
    assert tokens.value == expected["train_state"]["ntokens_seen"]
    assert _left_out_note(expected) in err and "--keep-trainer-state" in err
    assert "'optimizer'" in err


@pytest.mark.slow
def test_mapping_gives_what_torchtitans_adapter_gives(
    titan_run: TitanRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--mapping torchtitan-llama3: the HF names of the transformers model, the values of torchtitan's own
    Llama3StateDictAdapter.to_hf of the trained model, bit for bit."""
    config = json.loads((titan_run.hf / "config.json").read_text())
    runtime = tmp_path / "runtime.safetensors"
    save_file(titan_run.expected["model"], runtime)
    adapter_out = tmp_path / "adapter.safetensors"
    run_adapter("llama3", "to_hf", config, runtime, adapter_out)
    want = load_file(adapter_out)
    out = tmp_path / "hf"
    code, err = run(
        capsys,
        "dcp-to-hf",
        str(titan_run.ckpt()),
        str(out),
        "--mapping",
        "torchtitan-llama3",
        "--config",
        str(titan_run.hf / "config.json"),
        "--dtype",
        "keep",
    )
    assert code == 0, err
    got = load_dir(out)
    assert set(got) == set(load_file(titan_run.hf / "model.safetensors")) == set(want)
    assert all(same_bits(got[k], v) for k, v in want.items())
    assert set(_stash(out)) == {"train_state.step", "train_state.ntokens_seen"}
    assert _left_out_note(titan_run.expected) in err


@pytest.mark.slow
def test_run_directory_converts_its_one_checkpoint(
    titan_run: TitanRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = titan_run.ckpt().parent  # OUT/checkpoint, torchtitan's checkpoint.folder
    out = tmp_path / "hf"
    code, err = run(capsys, "dcp-to-hf", str(run_dir), str(out), "--dtype", "keep")
    assert code == 0, err
    assert "holds one checkpoint" in err and STEP_DIR in err
    got = load_dir(out)
    assert set(got) == set(titan_run.expected["model"])
    assert all(same_bits(got[k], v) for k, v in titan_run.expected["model"].items())
    items = _stash(out)
    assert {k: i.value for k, i in items.items()} == {
        f"train_state.{k}": v for k, v in titan_run.expected["train_state"].items()
    }


@pytest.mark.slow
def test_keep_trainer_state_stashes_scheduler_and_dataloader(
    titan_run: TitanRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = titan_run.expected
    out = tmp_path / "hf"
    code, err = run(capsys, "dcp-to-hf", str(titan_run.ckpt()), str(out), "--keep-trainer-state")
    assert code == 0, err
    items = _stash(out)
    assert set(items) == {
        f"{group}.{k}" for group in ("train_state", *TRAINER_GROUPS) for k in expected[group]
    }  # never the optimizer, not even with the flag
    assert {k: items[f"lr_scheduler.{k}"].value for k in expected["lr_scheduler"]} == expected["lr_scheduler"]
    assert items["dataloader.world_size"].value == expected["dataloader"]["world_size"] == 2
    for rank in (0, 1):
        loader = items[f"dataloader.dp_rank_{rank}"]
        want = expected["dataloader"][f"dp_rank_{rank}"]
        assert loader.path == ("dataloader", f"dp_rank_{rank}")
        assert not loader.has_value  # pickled bytes: kept as torch.save bytes, never as JSON
        assert torch.load(io.BytesIO(loader.raw), weights_only=True) == want
        assert pickle.loads(want)["dataset_state"]["sample_idx"] > 0  # the StatefulDataLoader's own state
    assert "leaving out" not in err
    assert load_dir(out).keys() == expected["model"].keys()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["int", "tensor"])
@pytest.mark.parametrize("mapping", [False, True])
def test_hf_to_dcp_gives_torchtitan_its_progress_back(
    titan_run: TitanRun, variant: str, mapping: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dcp-to-hf, then hf-to-dcp: dcp.load into the states torchtitan's CheckpointManager loads (the model's
    state dict flattened at the top level beside "train_state": the Trainer) restores the step and tokens.
    torchtitan's model keys have no prefix, so hf-to-dcp needs no --prefix."""
    expected = titan_run.expected
    config = str(titan_run.hf / "config.json")
    maps = ["--mapping", "torchtitan-llama3", "--config", config] if mapping else []
    hf, back = tmp_path / "hf", tmp_path / "back"
    code, err = run(capsys, "dcp-to-hf", str(titan_run.ckpt(variant)), str(hf), "--dtype", "keep", *maps)
    assert code == 0, err
    code, err = run(capsys, "hf-to-dcp", str(hf), str(back), *maps)
    assert code == 0, err
    tensor_step = variant == "tensor"
    trainer = Trainer(torch.tensor(0, dtype=torch.int32) if tensor_step else 0)
    states: dict[str, Any] = {k: torch.empty_like(v) for k, v in expected["model"].items()}
    states["train_state"] = trainer
    dcp.load(states, checkpoint_id=str(back), no_dist=True)
    if tensor_step:
        assert isinstance(trainer.step, torch.Tensor) and trainer.step.dtype == torch.int32
        assert trainer.step.dim() == 0
    else:
        assert type(trainer.step) is int
    assert int(trainer.step) == expected["train_state"]["step"]
    assert trainer.ntokens_seen == expected["train_state"]["ntokens_seen"]
    assert all(same_bits(states[k], v) for k, v in expected["model"].items())
    assert not any(k.split(".", 1)[0] in {"optimizer", *TRAINER_GROUPS} for k in _saved_keys(back))
