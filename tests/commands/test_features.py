"""dcp-to-hf flags (--prefix, --copy-from, --dry-run, group selection), stash, inspect."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run

from ckptconv.formats.stash import read_stash


def save_single(path: Path, state: dict) -> Path:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_prefix_keeps_and_strips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = torch.randn(4, 3), torch.randn(2)
    ckpt = save_single(tmp_path / "c", {"student": {"w": a, "v": b}, "teacher": {"w": torch.zeros(1)}})
    code, err = run(
        capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--prefix", "student", "--dtype", "keep"
    )
    assert code == 0, err
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"w", "v"} and torch.equal(got["w"], a) and torch.equal(got["v"], b)
    assert "1 outside it skipped" in err


def test_flat_checkpoint_without_groups_keeps_dotted_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an HF-named state dict saved flat: "model.layers..." is a key, not a nested group
    sd = {"model.embed_tokens.weight": torch.randn(5, 2), "lm_head.weight": torch.randn(5, 2)}
    ckpt = save_single(tmp_path / "c", sd)
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--dtype", "keep")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(sd)


def test_optimizer_groups_never_land(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # torchtitan-style: model keys at top level, optimizer nested beside them
    ckpt = save_single(
        tmp_path / "c",
        {
            "tok.weight": torch.ones(3),
            "optimizer": {"state": {"tok.weight": {"exp_avg": torch.ones(3)}}},
            "step": 9,
        },
    )
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"))
    assert code == 0, err
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == {"tok.weight"}
    assert "'optimizer'" in err
    assert {i.key: i.value for i in read_stash(tmp_path / "out")} == {"step": 9}


def test_trust_pickle_loads_what_the_allowlists_refuse_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle

    ckpt = save_single(tmp_path / "c", {"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)})
    # a non-standard planner's data in .metadata: a custom object (here an argparse.Namespace)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    metadata.planner_data = {**metadata.planner_data, "__custom__": argparse.Namespace(note="mine")}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"))
    assert code == 2 and "argparse.Namespace" in err and "--trust-pickle" in err
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--trust-pickle")
    assert code == 0, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("warning: --trust-pickle loaded with a full unpickler: argparse.Namespace, args (")
    items = {i.key: i for i in read_stash(tmp_path / "out")}
    assert not items["args"].has_value and items["args"].note is None  # loaded, kept as its bytes
    doc = json.loads((tmp_path / "out" / "ckptconv_state.json").read_text())
    assert doc["items"][0]["type"] == "Namespace"
    for command in (["inspect", str(ckpt)], ["verify", str(ckpt), str(tmp_path / "out")]):
        assert run(capsys, *command)[0] == 2
        code, err = run(capsys, *command, "--trust-pickle")
        assert code == 0 and "--trust-pickle loaded with a full unpickler: argparse.Namespace" in err, err


def test_non_allowlisted_item_is_kept_as_bytes_not_loaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = save_single(
        tmp_path / "c",
        {"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1), "iteration": 5, "shape": (2, 3)},
    )
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"))
    assert code == 0, err
    assert "'args'" in err and "argparse.Namespace" in err and "not loaded" in err
    items = {i.key: i for i in read_stash(tmp_path / "out")}
    assert items["iteration"].has_value and items["iteration"].value == 5
    assert not items["args"].has_value and items["args"].raw.startswith(b"PK")
    assert items["args"].readable == {"lr": 0.1}  # its fields, read without running the Namespace
    assert not items["shape"].has_value
    assert torch.load(__import__("io").BytesIO(items["shape"].raw), weights_only=True) == (2, 3)
    doc = json.loads((tmp_path / "out" / "ckptconv_state.json").read_text())
    assert doc["format"] == "ckptconv-stash" and doc["version"] == 1
    assert {"key": "args", "path": ["args"], "readable": {"lr": 0.1}}.items() <= doc["items"][0].items()


def test_copy_from_takes_config_not_weights(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "tokenizer.json").write_text("{}")
    save_file({"old": torch.zeros(1)}, hf / "model-00001-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text("{}")
    out = tmp_path / "out"
    # --copy-from holding weights is also the reference (issue #36): a broken index is refused, and weights
    # not the checkpoint's are a layout change, written only when allowed
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--copy-from", str(hf), "--quiet")
    assert_one_line(code, err, f"--copy-from {hf}: ", "not a valid safetensors index")
    index = {"metadata": {}, "weight_map": {"old": "model-00001-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--copy-from", str(hf), "--quiet")
    assert_one_line(code, err, f"OUT would not match the reference {hf}", "missing 'old'")
    assert not out.exists()
    flags = ("--copy-from", str(hf), "--allow-layout-change", "--quiet")
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), *flags)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "ckptconv_state.json",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


def test_dry_run_writes_nothing_and_shows_owners(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptconv.cli.app import main

    out = tmp_path / "out"
    main(
        [
            "dcp-to-hf",
            str(fsdp2_ckpt),
            str(out),
            "--dry-run",
            "--max-shard-size",
            "700",
            "--fp32",
            "A_log$",
            "--fp32",
            "nothing_like_this",
        ]
    )
    captured = capsys.readouterr()
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert "model-00001-of-" in captured.out and "rank 0" in captured.out
    assert "float32 -> bfloat16" in captured.out and "layers.0.A_log" in captured.out
    assert "warning: --fp32 'nothing_like_this' matched no floating-point tensor" in captured.err
    assert "taking the 'model' group" in captured.err and "'optim'" in captured.err


def test_dry_run_json(fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptconv.cli.app import main

    main(
        [
            "dcp-to-hf",
            str(fsdp2_ckpt),
            str(tmp_path / "out"),
            "--dry-run",
            "--json",
            "--max-shard-size",
            "700",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"] and doc["world_size"] == 1 and len(doc["files"]) > 1
    assert sum(f["nbytes"] for f in doc["files"]) == doc["total_size"]
    assert not (tmp_path / "out").exists()


def test_inspect_every_format(fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptconv.cli.app import main

    main(["inspect", str(fsdp2_ckpt), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "dcp" and info["serialization"] == ["torch_save"]
    assert "step" in info["non_tensor_items"] and "args.lr" in info["non_tensor_items"]
    up = next(t for t in info["tensors"] if t["key"] == "model.layers.0.up.weight")
    assert up["shape"] == [10, 6] and len(up["chunks"]) == 2 and up["dtype"] == "float32"
    assert info["dtypes"]["int64"] == 1 and info["dtypes"]["bool"] == 1
    out = tmp_path / "out"
    assert run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--max-shard-size", "700", "--quiet")[0] == 0
    for target in (out, next(out.glob("*.safetensors"))):
        main(["inspect", str(target), "--json"])
        info = json.loads(capsys.readouterr().out)
        assert info["format"] == "safetensors" and info["num_tensors"] >= 1
    main(["inspect", str(fsdp2_ckpt)])
    text = capsys.readouterr().out
    assert "model.layers.0.up.weight" in text and "[10, 6]" in text


NO_TORCH = (
    "import sys; sys.modules['torch'] = None; sys.argv[0] = 'ckptconv'; from ckptconv.cli import run; run()"
)


def test_inspect_runs_without_torch(
    fsdp2_ckpt: Path, mesh2d_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect` reads metadata and headers only, so it must not pay for importing torch: with torch
    unimportable it prints what it prints with torch, for both DCP serializations, HF files and a mapping
    view; a bad path is still a one-line error with exit 2."""
    import subprocess
    import sys

    from conftest import _env

    from ckptconv.cli.app import main

    out = tmp_path / "hf"
    assert run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--max-shard-size", "700", "--quiet")[0] == 0
    cases = [
        [str(fsdp2_ckpt)],
        [str(mesh2d_ckpt)],
        [str(out)],
        [str(next(out.glob("*.safetensors")))],
        [str(fsdp2_ckpt), "--mapping", "torchtitan-llama3", "--allow-unmapped"],
    ]
    for args in cases:
        main(["inspect", *args, "--json"])
        with_torch = json.loads(capsys.readouterr().out)
        proc = subprocess.run(
            [sys.executable, "-c", NO_TORCH, "inspect", *args, "--json"],
            capture_output=True,
            text=True,
            env=_env(),
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == with_torch, args
    assert with_torch["mapped"] and with_torch["tensors"]
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "inspect", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "missing" in proc.stderr


def test_two_nodes_through_c10d_rendezvous(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """Two torchrun "nodes" on one machine (c10d rendezvous on 127.0.0.1): both directions and both read paths
    give the bytes one process gives."""
    from conftest import ckptconv, tree_sha256, two_nodes

    single = tmp_path / "single"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(single), "--max-shard-size", "300").returncode == 0
    for read in ("direct", "gather"):
        out = tmp_path / read
        procs = two_nodes("dcp-to-hf", str(fsdp2_ckpt), str(out), "--max-shard-size", "300", "--read", read)
        assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
        assert "on 2 rank(s)" in procs[0].stderr + procs[1].stderr
        assert tree_sha256(out) == tree_sha256(single)
    procs = two_nodes("hf-to-dcp", str(single), str(tmp_path / "dcp"), "--verify")
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
    again = ckptconv("verify", str(tmp_path / "dcp"), str(single))
    assert again.returncode == 0, again.stdout + again.stderr
