"""What a release carries (issue #16 points 1 and 4): the model's tensors and the training progress, never the
optimizer; the dataloader, LR-scheduler, RNG and module extra state only with --keep-trainer-state.

Checkpoints come from torch's own DCP writer with torch's own optimizer / scheduler state dicts, and from
megatron-core 0.16.1's `dist_checkpointing.save` (support/megatron.py), whose `.metadata` carries torch's
save-plan records and whose `common.pt` pickles an argparse.Namespace: both read without --trust-pickle.
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron import saved
from safetensors.torch import load_file
from test_bad_input import run
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ckptconv.cli.app import main
from ckptconv.formats.stash import read_stash


class Backend(enum.Enum):  # a class of the trainer's own, as Megatron-LM's args hold (AttnBackend, ...)
    auto = 5


def _stash(out: Path) -> dict[str, Any]:
    return {i.key: i for i in read_stash(out)}


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A training job's checkpoint as torchtitan lays it out, from torch's own writers and state dicts."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    state = {
        "model": model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, opt),
        "lr_scheduler": sched.state_dict(),
        "dataloader": {"dp_rank_0": pickle.dumps({"sample": 12})},
        "train_state": {"step": torch.tensor(7, dtype=torch.int32), "ntokens_seen": 4096},
        "rng": {"cpu": torch.get_rng_state()},
    }
    path = tmp_path_factory.mktemp("titanlike") / "ckpt"
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_release_has_model_and_progress_only(
    torch_ckpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, weights = torch_ckpt
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out), "--dtype", "keep")
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    assert set(got) == set(weights) and all(torch.equal(got[k], v) for k, v in weights.items())
    items = _stash(out)
    assert set(items) == {"train_state.step", "train_state.ntokens_seen"}
    step = items["train_state.step"]
    assert (step.value, step.tensor, step.path) == (7, "int32", ("train_state", "step"))
    assert "leaving out trainer state 'dataloader' (1), 'lr_scheduler'" in err
    assert "--keep-trainer-state" in err
    doc = json.loads((out / "ckptconv_state.json").read_text())
    entry = {"key": "train_state.step", "path": ["train_state", "step"], "value": 7, "tensor": "int32"}
    assert entry in doc["items"]


def test_step_tensor_comes_back_as_a_tensor(
    torch_ckpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, weights = torch_ckpt
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert run(capsys, "dcp-to-hf", str(ckpt), str(hf), "--dtype", "keep")[0] == 0
    code, err = run(capsys, "hf-to-dcp", str(hf), str(back), "--prefix", "model.")
    assert code == 0, err
    state: dict[str, Any] = {
        "model": {k: torch.empty_like(v) for k, v in weights.items()},
        "train_state": {"step": torch.tensor(0, dtype=torch.int32), "ntokens_seen": 0},
    }
    dcp.load(state, checkpoint_id=str(back), no_dist=True)
    assert state["train_state"]["step"].dtype == torch.int32 and int(state["train_state"]["step"]) == 7
    assert state["train_state"]["ntokens_seen"] == 4096
    assert all(torch.equal(state["model"][k], v) for k, v in weights.items())


def test_keep_trainer_state_stashes_scheduler_and_dataloader(
    torch_ckpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _ = torch_ckpt
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out), "--keep-trainer-state")
    assert code == 0, err
    items = _stash(out)
    assert items["lr_scheduler.last_epoch"].value == 1 and items["lr_scheduler.base_lrs"].value == [0.1]
    loader = items["dataloader.dp_rank_0"]
    assert not loader.has_value and torch.load(io.BytesIO(loader.raw), weights_only=True) == pickle.dumps(
        {"sample": 12}
    )
    assert not any(k.startswith("optimizer") for k in items)  # never, not even with the flag
    assert "leaving out" not in err


# --- Megatron-Core torch_dist, written by megatron-core itself ---------------------------------------------


@pytest.fixture(scope="module")
def megatron_ckpt() -> Path:
    return saved("gpt")  # DistributedOptimizer (dp_reshardable), rng_state, TP=2; shared with other tests


@pytest.mark.slow
def test_megatron_checkpoint_is_read_without_trust_pickle(
    megatron_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = torch.load(megatron_ckpt.parent / "expected.pt", weights_only=True)
    code, err = run(capsys, "inspect", str(megatron_ckpt), "--json")
    assert code == 0, err
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(megatron_ckpt), str(out), "--dtype", "keep")
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    model_keys = {k for k in expected["tensors"] if not k.startswith("optimizer.")}
    assert set(got) == model_keys  # the flat optimizer buffers never land, with no nesting record to say so
    assert all(torch.equal(got[k], expected["tensors"][k]) for k in model_keys)
    items = _stash(out)
    common = expected["common"]
    progress = {"iteration", "args", "checkpoint_version", "num_floating_point_operations_so_far"}
    assert set(items) == progress | {"content_metadata"}
    assert items["iteration"].value == common["iteration"] == 1
    assert items["args"].value == common["args"]  # the Namespace's fields, read from the pickle's opcodes
    assert items["content_metadata"].value == common["content_metadata"]
    assert "'optimizer' state" in err
    assert "'_extra_state' (8), 'opt_param_scheduler' (1), 'rng_state' (2)" in err


@pytest.mark.slow
def test_megatron_trainer_state_kept_on_request(
    megatron_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(megatron_ckpt), str(out), "--keep-trainer-state")
    assert code == 0, err
    items = _stash(out)
    assert items["opt_param_scheduler"].value == {"max_lr": 1e-3, "num_steps": 16, "decay_style": "cosine"}
    rng = [k for k in items if k.startswith("rng_state/")]
    assert len(rng) == 2 and all(not items[k].has_value for k in rng)  # numpy's state: bytes, never run
    assert "'rng_state/shard_0.0_1.2' holds numpy" in err
    assert len([k for k in items if "._extra_state/" in k]) == 8
    assert not any(k.startswith("optimizer") for k in items)


@pytest.mark.slow
def test_megatron_classes_in_args_are_left_out_with_a_warning(
    megatron_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(megatron_ckpt, ckpt)
    # Megatron-LM's args also hold torch dtypes and megatron's own enums
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, attention_backend=Backend.auto)
    torch.save({"iteration": 40, "args": args, "checkpoint_version": 3.0}, ckpt / "common.pt")
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out))
    assert code == 0, err
    items = _stash(out)
    assert items["iteration"].value == 40
    assert items["args"].value == {"num_layers": 2, "params_dtype": "bfloat16"}
    assert (
        f"left out args.attention_backend ({__name__}.Backend" in err
    )  # (.auto, pickled as getattr on 3.11.2)
    raw = items["common.pt"]
    assert not raw.has_value and raw.raw == (ckpt / "common.pt").read_bytes()


@pytest.mark.slow
def test_megatron_run_directory_converts_its_one_iteration(
    megatron_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(megatron_ckpt, run_dir / "iter_0000001")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("1")
    code, err = run(capsys, "dcp-to-hf", str(run_dir), str(tmp_path / "out"))
    assert code == 0, err
    assert "holds one checkpoint" in err and "iter_0000001" in err
    shutil.copytree(megatron_ckpt, run_dir / "iter_0000002")
    code, err = run(capsys, "dcp-to-hf", str(run_dir), str(tmp_path / "out2"))
    assert code == 2 and "iter_0000001" in err and "iter_0000002" in err


@pytest.mark.slow
def test_inspect_and_verify_say_what_a_megatron_release_takes(
    megatron_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = torch.load(megatron_ckpt.parent / "expected.pt", weights_only=True)
    try:
        main(["inspect", str(megatron_ckpt), "--json"])
    except SystemExit as e:
        assert not e.code
    info = json.loads(capsys.readouterr().out)
    assert info["writer"] == "megatron" and info["common"]["iteration"] == 1
    model_keys = {k for k in expected["tensors"] if not k.startswith("optimizer.")}
    assert info["release"]["model"] == {k: k for k in model_keys}
    assert "iteration" in info["release"]["stash"] and "args" in info["release"]["stash"]
    assert any("'rng_state' (2)" in note for note in info["release"]["notes"])
    out = tmp_path / "out"
    assert run(capsys, "dcp-to-hf", str(megatron_ckpt), str(out), "--dtype", "keep")[0] == 0
    code, err = run(capsys, "verify", str(megatron_ckpt), str(out))
    assert code == 0, err


def test_a_stashed_step_tensor_is_not_called_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {
        "w": torch.ones(2),
        "optimizer": {"w": {"exp_avg": torch.ones(2)}},
        "train_state": {"step": torch.tensor(3, dtype=torch.int32)},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "c"), str(tmp_path / "o"))
    assert code == 0, err
    assert "not converting the 'optimizer' state" in err and "train_state" not in err
    assert _stash(tmp_path / "o")["train_state.step"].value == 3


@pytest.mark.slow
def test_megatron_hand_built_sharded_state_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sharded state dict of megatron ShardedTensors built by hand (TP split, prepended layer axis, replica
    ids, fp32 and bf16) with a per-rank ShardedObject, saved by megatron's dist_checkpointing.save."""
    ckpt = saved("sharded")
    expected = torch.load(ckpt.parent / "expected.pt", weights_only=True)
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out), "--dtype", "keep")
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    assert got.keys() == expected["tensors"].keys()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected["tensors"].items())
    items = _stash(out)
    assert items["iteration"].value == expected["common"]["iteration"]
    assert items["args"].value == expected["common"]["args"]
    assert "'rng_state' (2)" in err and not any(k.startswith("rng_state") for k in items)


class _ByGetattr:
    """Pickles as `builtins.getattr(Backend, "auto")`, as some Python 3.11 releases pickle enum members."""

    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        return getattr, (Backend, "auto")


def test_an_enum_pickled_through_getattr_is_named_never_looked_up() -> None:
    from ckptconv.formats.megatron import load_opaque, readable

    raw = pickle.dumps({"args": argparse.Namespace(lr=0.1, backend=_ByGetattr())}, protocol=2)
    assert b"getattr" in raw
    left_out: list[str] = []
    assert readable(load_opaque(raw), "common", left_out) == {"args": {"lr": 0.1}}
    assert left_out == [f"common.args.backend ({__name__}.Backend.auto)"]
