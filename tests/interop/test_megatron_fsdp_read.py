"""Megatron-FSDP `fsdp_dtensor` checkpoints read (issue #37 point 1) and Megatron-Core 0.19's `common_state`.

The checkpoints are saved by torch's own `dcp.save` from the dict Megatron-LM's `save_checkpoint` hands it
(support/workers/megatron_fsdp_save.py): alone with plain tensors (fast), and on 2 gloo ranks with every
model and optimizer tensor a DTensor in uneven row blocks (slow). `args` is an argparse.Namespace holding a
torch dtype and an enum of the trainer's own, read without running it; `iteration` and `checkpoint_version`
are plain numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import pickle
import shutil
import struct
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS, ckptconv, torchrun
from megatron import megatron_dir
from safetensors.torch import load_file
from test_bad_input import assert_one_line, run

from ckptconv.cli.app import main
from ckptconv.formats.stash import read_stash


def _worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megatron_fsdp_save", WORKERS / "megatron_fsdp_save.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its enum pickles by the module's name
    spec.loader.exec_module(module)
    return module


SAVE = _worker()
LINE = "Megatron-FSDP fsdp_dtensor checkpoint, iteration 7, TP at save 2"


def save(path: Path, vpp: bool = False, tp: int | None = 2) -> Path:
    with pytest.warns(UserWarning):  # no process group: dcp.save says it saves in one process
        dcp.save(SAVE.state(vpp, tp), checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    return {
        "plain": save(root / "plain"),
        "vpp": save(root / "vpp", vpp=True),
        "notp": save(root / "notp", tp=None),
    }


def _stash(out: Path) -> dict[str, Any]:
    return {i.key: i for i in read_stash(out)}


def _inspect_json(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, Any]:
    try:
        main(["inspect", str(path), "--json"])
    except SystemExit as e:
        assert not e.code
    return json.loads(capsys.readouterr().out)


def _no_trainer_bytes(out: Path) -> None:
    """No optimizer value anywhere in OUT: every one of them is OPT_VALUE, whose float32 bytes a model
    tensor never holds four times in a row."""
    needle = struct.pack("<f", SAVE.OPT_VALUE) * 4
    for path in out.rglob("*"):
        if path.is_file():
            assert needle not in path.read_bytes(), path


def _released(out: Path, vpp: bool) -> None:
    got = load_file(out / "model.safetensors")
    expected = SAVE.expected(vpp)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected.items())
    _no_trainer_bytes(out)


# -- recognised, inspected ----------------------------------------------------------------------------------


def test_inspect_says_what_it_is(made: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(capsys, "inspect", str(made["plain"]))
    assert code == 0
    try:
        main(["inspect", str(made["plain"])])
    except SystemExit as e:
        assert not e.code
    assert LINE in capsys.readouterr().out
    info = _inspect_json(capsys, made["plain"])
    assert info["writer"] == "fsdp_dtensor"
    megatron = info["megatron"]
    assert megatron["format"] == "fsdp_dtensor" and megatron["iteration"] == 7
    assert megatron["checkpoint_version"] == 3.0 and megatron["tensor_model_parallel_size"] == 2
    assert megatron["pipeline_model_parallel_size"] == 1 and megatron["virtual_pipeline_chunks"] is None
    assert megatron["args"]["params_dtype"] == "bfloat16" and "attention_backend" not in megatron["args"]
    assert info["release"]["model"] == {k: f"model.module.{k}" for k in SAVE.expected(False)}
    assert sorted(info["release"]["stash"]) == ["args", "args.pt", "checkpoint_version", "iteration"]


def test_a_model_group_alone_is_not_megatron_fsdp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Keys under `model.module.` with no `args` / `iteration` / `checkpoint_version` beside: a plain DCP."""
    with pytest.warns(UserWarning):
        dcp.save(
            {"model": {"module.w": torch.ones(2)}, "step": 3}, checkpoint_id=str(tmp_path / "c"), no_dist=True
        )
    info = _inspect_json(capsys, tmp_path / "c")
    assert "writer" not in info and "megatron" not in info
    assert info["release"]["model"] == {"module.w": "model.module.w"}


def test_megatron_module_names_without_items_are_megatron_fsdp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Megatron-Bridge conversion saves no `args` / `iteration` / `checkpoint_version`: GPTModel's names
    under `model.module.` make it Megatron-FSDP's all the same, its iteration and TP unknown, nothing
    stashed."""
    w, e = torch.arange(6.0).reshape(3, 2), torch.ones(4, 2)
    model = {"module.decoder.layers.0.mlp.linear_fc2.weight": w, "module.embedding.word_embeddings.weight": e}
    with pytest.warns(UserWarning):
        dcp.save({"model": model}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    info = _inspect_json(capsys, tmp_path / "c")
    assert info["megatron"]["format"] == "fsdp_dtensor"
    assert info["megatron"]["iteration"] is None and info["megatron"]["tensor_model_parallel_size"] is None
    assert info["release"]["model"] == {k.removeprefix("module."): f"model.{k}" for k in model}
    assert info["release"]["stash"] == []
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "c"), str(out), "--allow-unmapped", "--dtype", "keep")
    assert code == 0, err
    assert "a Megatron checkpoint without --mapping keeps Megatron's names" in err  # and names the presets
    assert "megatron-gpt" in err and "megatron-qwen3_5" in err
    got = load_file(str(out / "model.safetensors"))
    assert torch.equal(got["decoder.layers.0.mlp.linear_fc2.weight"], w)
    assert torch.equal(got["embedding.word_embeddings.weight"], e)


def test_torch_dist_says_its_tp_when_its_args_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron-Core 0.19 keeps the common state in the DCP (`common_state/shard_0_1`, a torch.save of
    `[common]`), no common.pt: its values are read as 0.16's common.pt is."""
    args = argparse.Namespace(
        tensor_model_parallel_size=4, num_layers=2, attention_backend=SAVE.AttnBackend.auto
    )
    blob = io.BytesIO()
    torch.save([{"iteration": 5, "args": args, "checkpoint_version": 3.0}], blob)
    blob.seek(0)
    ckpt = tmp_path / "c"
    with pytest.warns(UserWarning):
        dcp.save(
            {"decoder.w": torch.arange(4.0), "common_state/shard_0_1": blob},
            checkpoint_id=str(ckpt),
            no_dist=True,
        )
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    try:
        main(["inspect", str(ckpt)])
    except SystemExit as e:
        assert not e.code
    assert "Megatron-Core torch_dist checkpoint, iteration 5, TP at save 4" in capsys.readouterr().out
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out), "--dtype", "keep")
    assert code == 0, err
    items = _stash(out)
    assert items["iteration"].value == 5 and items["checkpoint_version"].value == 3.0
    assert items["args"].value == {"tensor_model_parallel_size": 4, "num_layers": 2}
    raw = items["common_state/shard_0_1"]  # the item whole, as bytes: its enum is never run
    assert not raw.has_value and "left out args.attention_backend" in err
    assert load_file(out / "model.safetensors").keys() == {"decoder.w"}


# -- converted ----------------------------------------------------------------------------------------------


def test_dcp_to_hf_takes_the_model_and_stashes_the_progress(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(made["plain"]), str(out), "--dtype", "keep")
    assert code == 0, err
    _released(out, vpp=False)
    items = _stash(out)
    assert set(items) == {"args", "iteration", "checkpoint_version", "args.pt"}
    assert items["iteration"].value == 7 and items["checkpoint_version"].value == 3.0
    args = items["args"].value
    assert args["tensor_model_parallel_size"] == 2 and args["params_dtype"] == "bfloat16"
    assert "attention_backend" not in args and not items["args.pt"].has_value
    assert "left out args.attention_backend" in err and "'args.pt'" in err
    assert "not converting 'optimizer'" in err
    assert "'opt_param_scheduler' (2), 'rerun_state_machine' (1), 'rng_state' (" in err


def test_trainer_state_only_on_request(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(made["plain"]), str(out), "--keep-trainer-state")
    assert code == 0, err
    items = _stash(out)
    assert items["opt_param_scheduler.num_steps"].value == 7
    assert not any(k.startswith("optimizer") for k in items)
    _no_trainer_bytes(out)


def test_virtual_pipeline_chunks_are_joined(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = _inspect_json(capsys, made["vpp"])
    assert info["megatron"]["virtual_pipeline_chunks"] == 2
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(made["vpp"]), str(out), "--dtype", "keep")
    assert code == 0, err
    assert "'model0.module.', 'model1.module.'" in err
    _released(out, vpp=True)
    code, err = run(capsys, "verify", str(made["vpp"]), str(out))
    assert code == 0, err


def test_a_key_in_two_chunks_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = SAVE.state(True, 2)
    state["model1"]["module.embedding.word_embeddings.weight"] = torch.zeros(5, 4)
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "c"), str(tmp_path / "out"))
    assert_one_line(
        code,
        err,
        "'model0.module.embedding.word_embeddings.weight'",
        "'model1.module.embedding.word_embeddings.weight'",
    )
    assert not (tmp_path / "out").exists()


# -- the TP size at save, for rules that group by it --------------------------------------------------------

GROUPED = """
[mapping]
name = "tp-grouped"

[[rule]]
runtime = "decoder.layers.{layer}.self_attention.linear_qkv.weight"
hf = ["layers.{layer}.q", "layers.{layer}.k", "layers.{layer}.v"]
groups = "gdn_tensor_parallel_size"
sizes = ["2 / gdn_tensor_parallel_size", "2 / gdn_tensor_parallel_size", "2 / gdn_tensor_parallel_size"]
"""


def _grouped(tmp_path: Path) -> Path:
    path = tmp_path / "grouped.toml"
    path.write_text(GROUPED)
    return path


def test_the_tp_size_from_args_splits_grouped_rows(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--mapping", str(_grouped(tmp_path)), "--allow-unmapped", "--dtype", "keep"]
    code, err = run(capsys, "dcp-to-hf", str(made["plain"]), str(out), *argv)
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    w = SAVE.expected(False)["decoder.layers.0.self_attention.linear_qkv.weight"]  # 2 groups of [q k v] rows
    assert torch.equal(got["layers.0.q"], w[[0, 3]]) and torch.equal(got["layers.0.k"], w[[1, 4]])
    assert torch.equal(got["layers.0.v"], w[[2, 5]])
    code, err = run(
        capsys,
        "verify",
        str(made["plain"]),
        str(out),
        "--mapping",
        str(_grouped(tmp_path)),
        "--allow-unmapped",
    )
    assert code == 0, err


def test_a_missing_tp_size_is_refused_then_taken_from_the_flag(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--mapping", str(_grouped(tmp_path)), "--allow-unmapped", "--dtype", "keep"]
    code, err = run(capsys, "dcp-to-hf", str(made["notp"]), str(tmp_path / "out"), *argv)
    assert_one_line(
        code,
        err,
        "'decoder.layers.0.self_attention.linear_qkv.weight'",
        "pass --megatron-tp N (the TP size of the job that saved it)",
    )
    assert not (tmp_path / "out").exists()
    code, err = run(
        capsys, "dcp-to-hf", str(made["notp"]), str(tmp_path / "out"), *argv, "--megatron-tp", "2"
    )
    assert code == 0, err
    w = SAVE.expected(False)["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["layers.1.q"], w[[0, 3]])


def test_a_flag_contradicting_the_args_is_refused(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(capsys, "dcp-to-hf", str(made["plain"]), str(tmp_path / "out"), "--megatron-tp", "1")
    assert_one_line(
        code, err, "--megatron-tp 1: the checkpoint was saved at TP 2 (its args say); leave the flag out"
    )
    code, err = run(capsys, "dcp-to-hf", str(made["plain"]), str(tmp_path / "out"), "--megatron-tp", "0")
    assert_one_line(code, err, "--megatron-tp 0")
    assert not (tmp_path / "out").exists()


# -- hostile args -------------------------------------------------------------------------------------------


class _System:
    """Pickles into a call of os.system: loading it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _with_args(made: Path, tmp_path: Path, blob: bytes) -> Path:
    """A copy of `made` whose `args` item is `blob`, in a file of its own."""
    ckpt = Path(shutil.copytree(made, tmp_path / "ckpt"))
    (ckpt / "evil.distcp").write_bytes(blob)
    import torch.distributed.checkpoint  # noqa: F401 (torch's metadata classes, for pickle.loads)

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for index, info in metadata.storage_data.items():
        if index.fqn == "args":
            info.relative_path, info.offset, info.length = "evil.distcp", 0, len(blob)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return ckpt


def test_args_calling_os_system_is_never_run(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    blob = io.BytesIO()
    torch.save(argparse.Namespace(tensor_model_parallel_size=2, evil=_System(marker)), blob)
    ckpt = _with_args(made["plain"], tmp_path, blob.getvalue())
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out))
    assert code == 0, err
    assert not marker.exists()
    items = _stash(out)
    assert items["args"].value == {"tensor_model_parallel_size": 2}
    assert "left out args.evil (posix.system" in err and not items["args.pt"].has_value
    code, _ = run(capsys, "inspect", str(ckpt))
    assert code == 0 and not marker.exists()


def test_args_nested_past_the_depth_limit_is_refused(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    depth = 100_000
    blob = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."  # a list nested 100,000 deep, as opcodes
    ckpt = _with_args(made["plain"], tmp_path, blob)
    code, err = run(capsys, "inspect", str(ckpt))
    assert_one_line(code, err, "'args'", "CKPTCONV_READ_DEPTH")


def test_args_larger_than_any_common_state_is_refused_unread(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _with_args(made["plain"], tmp_path, b"")
    size = 65 * 2**20
    os.truncate(ckpt / "evil.distcp", size)  # sparse: nothing of it is ever read
    import torch.distributed.checkpoint  # noqa: F401

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for index, info in metadata.storage_data.items():
        if index.fqn == "args":
            info.length = size
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"))
    assert_one_line(code, err, "'args'", f"{size} bytes", "refusing to read it")
    assert not (tmp_path / "out").exists()


# -- 2 ranks, DTensors --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["plain", "vpp"])
def test_saved_on_two_ranks_converts_bit_exact_at_one_and_two(
    made: dict[str, Path], tmp_path: Path, layout: str
) -> None:
    """DTensors in Megatron-FSDP's uneven row blocks (megatron-core's own chunk metadata: a third of the rows
    on rank 0, none of a one-row tensor) from 2 gloo ranks: the release equals the one of the same state saved
    in one process, at 1 and at 2 converting ranks."""
    megatron_dir()  # the workers take megatron-core's uneven-DTensor code from it
    ckpt = tmp_path / "ckpt"
    torchrun(2, str(WORKERS / "megatron_fsdp_save.py"), str(ckpt), layout, "2")
    tensors = json.loads(ckptconv("inspect", str(ckpt), "--json").stdout)["tensors"]
    sharded = [t for t in tensors if t["key"].startswith(("model", "optimizer"))]
    assert sharded and all(len(t["chunks"]) == 2 for t in sharded)  # over both ranks
    # Megatron-FSDP's blocks, not torch's chunking: rank 0 a third of the rows
    assert all(t["chunks"][0]["sizes"][0] == t["shape"][0] // 3 for t in sharded)
    outs = []
    for nproc in (0, 2):
        out = tmp_path / f"out{nproc}"
        proc = ckptconv("dcp-to-hf", str(ckpt), str(out), "--dtype", "keep", nproc=nproc)
        assert proc.returncode == 0, proc.stderr
        assert LINE.split(",")[0] in ckptconv("inspect", str(ckpt)).stdout
        _released(out, vpp=layout == "vpp")
        outs.append(out)
    single = tmp_path / "single"
    assert ckptconv("dcp-to-hf", str(made[layout]), str(single), "--dtype", "keep").returncode == 0
    for out in outs:
        assert (out / "model.safetensors").read_bytes() == (single / "model.safetensors").read_bytes()
        assert _stash(out).keys() == _stash(single).keys()
        assert _stash(out)["args"].value == _stash(single)["args"].value
