"""save_hf / load_hf on live sharded models: FSDP2 at 2 and 3 ranks, FSDP2 x TP 2x2 (strided rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from safetensors.torch import save_file

import ckptconv as lib
from ckptconv.errors import CkptconvError


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same seeded model saved with save_hf by five jobs: FSDP2 on 1, 2 and 3 ranks, FSDP2 x TP on 2
    (a dp dim of one rank) and 4."""
    root = tmp_path_factory.mktemp("live")
    runs = {
        "fsdp2-2": (2, "fsdp2"),
        "fsdp2-1": (1, "fsdp2"),
        "fsdp2-3": (3, "fsdp2"),
        "mesh2d-2": (2, "mesh2d"),
        "mesh2d-4": (4, "mesh2d"),
    }
    out = {}
    for name, (nproc, layout) in runs.items():
        out[name] = root / name
        out[name].mkdir()
        torchrun(nproc, str(WORKERS / "live.py"), "save", str(out[name]), layout)
    return out


def test_save_hf_bytes_are_independent_of_world_size_and_layout(saved: dict[str, Path]) -> None:
    first = tree_sha256(saved["fsdp2-2"] / "live")
    assert len([n for n in first if n.endswith(".safetensors")]) == 4  # max_shard_size=300: numbered 1..4
    assert "model.safetensors.index.json" in first and "ckptconv_state.json" in first
    for name in ("fsdp2-1", "fsdp2-3", "mesh2d-2", "mesh2d-4"):
        assert tree_sha256(saved[name] / "live") == first, name


def test_save_hf_batches_all_gathers_within_the_budget(saved: dict[str, Path]) -> None:
    """save_hf's data moved by the unshard scheduler: several rounds under the 512-byte budget (counted on
    gathered bytes; the largest tensor, 264 bytes, fits), and fewer collectives than shard steps because the
    steps of one (process group, dtype) in a round share one foreach all-gather."""
    for name in ("fsdp2-2", "fsdp2-3", "mesh2d-4"):
        report = json.loads((saved[name] / "report.json").read_text())
        assert report["rounds"] > 2 and report["max_round_bytes"] <= 512, (name, report)
        assert 0 < report["collectives"] < report["steps"], (name, report)
        index = json.loads((saved[name] / "live" / "model.safetensors.index.json").read_text())
        assert report["files"] == sorted(set(index["weight_map"].values()))
        assert report["nbytes"] == index["metadata"]["total_size"]
    strided = json.loads((saved["mesh2d-4"] / "report.json").read_text())
    assert strided["steps"] > json.loads((saved["fsdp2-2"] / "report.json").read_text())["steps"]
    # a mesh dim of one rank shards nothing: no step, no collective, the local data written as it is
    alone = json.loads((saved["fsdp2-1"] / "report.json").read_text())
    assert alone["steps"] == alone["collectives"] == 0, alone
    tp_only = json.loads((saved["mesh2d-2"] / "report.json").read_text())  # dp of 1 x tp of 2: TP's steps
    assert 0 < tp_only["steps"] < strided["steps"] and tp_only["collectives"] > 0, tp_only


def test_save_hf_writes_what_dcp_to_hf_writes(saved: dict[str, Path], tmp_path: Path) -> None:
    for name in ("fsdp2-2", "mesh2d-4"):
        out = tmp_path / name
        proc = ckptconv(
            "dcp-to-hf", str(saved[name] / "dcp"), str(out), "--fp32", "A_log$", "--max-shard-size", "300"
        )
        assert proc.returncode == 0, proc.stderr
        assert tree_sha256(out) == tree_sha256(saved[name] / "live"), name
        fp8 = tmp_path / f"{name}-fp8"  # save_hf(quantize="fp8") is dcp-to-hf --quantize fp8
        flags = ("--fp32", "A_log$", "--max-shard-size", "300", "--quantize", "fp8")
        proc = ckptconv("dcp-to-hf", str(saved[name] / "dcp"), str(fp8), *flags)
        assert proc.returncode == 0, proc.stderr
        digest = tree_sha256(fp8)
        assert any(
            n.endswith("_scale_inv")
            for n in json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
        )
        assert digest == tree_sha256(saved[name] / "live_fp8"), name
    stash = json.loads((saved["fsdp2-2"] / "live" / "ckptconv_state.json").read_text())
    assert stash["items"] == [{"key": "step", "path": ["step"], "value": 7}]


@pytest.mark.parametrize(("nproc", "layout"), [(3, "fsdp2"), (4, "mesh2d")])
def test_load_hf_into_a_differently_sharded_bf16_model(
    saved: dict[str, Path], nproc: int, layout: str
) -> None:
    proc = torchrun(nproc, str(WORKERS / "live.py"), "load", str(saved["fsdp2-2"]), layout)
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["loaded"] == 16 and not doc["missing"] and not doc["unexpected"]
    assert all(same for _, same in doc["same"].values()), doc["same"]  # bit for bit against the saved values
    # the fp32 A_log of the checkpoint is not rounded into the bf16 model: the state dict gets an fp32 tensor
    assert doc["replaced"] == ["layers.0.A_log", "layers.1.A_log"]
    assert doc["same"]["layers.0.A_log"][0] == "float32" and doc["same"]["embed.weight"][0] == "bfloat16"
    assert doc["model"]["layers.0.A_log"] == "torch.bfloat16"  # the module's own parameter is not replaced


def _hf(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(5, 4, generator=g),
        "A_log": torch.randn(3, generator=g),
        "ids": torch.arange(6),
        "b": torch.randn(4, generator=g).to(torch.bfloat16),
    }
    directory = tmp_path / "hf"
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_load_hf_dtype_rules_in_one_process(tmp_path: Path) -> None:
    hf = _hf(tmp_path)
    sd = {
        "w": torch.zeros(5, 4, dtype=torch.bfloat16),
        "A_log": torch.zeros(3, dtype=torch.bfloat16),
        "ids": torch.zeros(6, dtype=torch.int64),
        "b": torch.zeros(4, dtype=torch.float32),  # wider target: filled in place
    }
    target_b = sd["b"]
    report = lib.load_hf(sd, hf)
    assert sorted(report.replaced) == ["A_log", "w"] and sd["w"].dtype == torch.float32
    assert sd["b"] is target_b and sd["b"].dtype == torch.float32
    assert torch.equal(sd["ids"], torch.arange(6))
    forced = {k: torch.zeros_like(v) for k, v in sd.items()} | {"w": torch.zeros(5, 4, dtype=torch.bfloat16)}
    forced["A_log"] = torch.zeros(3, dtype=torch.bfloat16)
    w_target = forced["w"]
    report = lib.load_hf(forced, hf, dtype="bf16", fp32=["A_log$"])
    assert sorted(report.replaced) == ["A_log", "b"]  # forced: A_log to fp32, the fp32 target b to bf16
    assert forced["A_log"].dtype == torch.float32 and forced["b"].dtype == torch.bfloat16
    assert forced["w"] is w_target and torch.equal(w_target, sd["w"].to(torch.bfloat16))  # rounded in place


def test_load_hf_strict_and_shapes(tmp_path: Path) -> None:
    hf = _hf(tmp_path)
    sd = {"w": torch.zeros(5, 4), "extra": torch.zeros(2)}
    with pytest.raises(CkptconvError, match="missing keys \\['extra'\\], unexpected keys"):
        lib.load_hf(sd, hf)
    report = lib.load_hf(sd, hf, strict=False)
    assert report.loaded == ["w"] and report.missing == ["extra"]
    assert sorted(report.unexpected) == ["A_log", "b", "ids"]
    with pytest.raises(CkptconvError, match="'w' is \\[5, 4\\]"):
        lib.load_hf({"w": torch.zeros(4, 5)}, hf, strict=False)


def test_save_hf_one_process_round_trip(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = dict(load_file(_hf(tmp_path) / "model.safetensors"))
    # {"model": ..., "step": ...}: the model group is taken and its prefix stripped, as dcp-to-hf does
    lib.save_hf({"model": sd, "step": 3}, tmp_path / "out", dtype="keep", fp32=())
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert set(back) == set(sd)
    for key, value in sd.items():
        assert torch.equal(back[key], value)
    with pytest.raises(CkptconvError, match="not empty"):
        lib.save_hf(sd, tmp_path / "out", overwrite=False)


def test_save_hf_with_a_mapping_experts_sharded_like_ep(tmp_path: Path) -> None:
    """torchtitan-named MoE DTensors (stacked experts sharded on dim 0 like EP, or on dim 1 as FSDP2 does
    once the expert dim is prepended; bf16 shards beside fp32 replicated norms) written by save_hf with the
    torchtitan-qwen3 mapping on 2 and 3 ranks (an empty expert shard on the third): the files dcp-to-hf
    writes from the same tensors saved with dcp.save."""
    from test_presets import runtime_spec, tiny_qwen3

    hf_dir = tiny_qwen3(tmp_path / "ref", moe=True, tied=False)
    spec = runtime_spec("torchtitan-qwen3", hf_dir)
    for i, (key, (shape, _, placement)) in enumerate(sorted(spec.items())):
        if len(shape) == 3:
            placement = "shard0" if i % 2 else "shard1"
        elif "norm" in key:
            placement = "replicate"
        spec[key] = [shape, "float32" if placement == "replicate" else "bfloat16", placement]
    assert {p for _, _, p in spec.values()} == {"shard0", "shard1", "replicate"}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    config = str(hf_dir / "config.json")
    outs = {}
    for nproc in (2, 3):
        ckpt, live = tmp_path / f"ckpt{nproc}", tmp_path / f"live{nproc}"
        torchrun(
            nproc,
            str(WORKERS / "save_runtime.py"),
            str(ckpt),
            str(tmp_path / "spec.json"),
            str(live),
            "torchtitan-qwen3",
            config,
        )
        outs[nproc] = tree_sha256(live)
    assert outs[2] == outs[3]
    proc = ckptconv(
        "dcp-to-hf",
        str(tmp_path / "ckpt3"),
        str(tmp_path / "cli"),
        "--mapping",
        "torchtitan-qwen3",
        "--dtype",
        "keep",
        "--max-shard-size",
        "8KB",
        "--config",
        config,
    )
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(tmp_path / "cli") == outs[2]
    names = sorted(n for n in outs[2] if n.endswith(".safetensors"))
    assert len(names) > 1 and names == [
        f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)
    ]
    proc = ckptconv(
        "verify",
        str(tmp_path / "ckpt2"),
        str(tmp_path / "live2"),
        "--mapping",
        "torchtitan-qwen3",
        "--config",
        config,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_load_spec_for_every_placement_kind() -> None:
    """Shard on dims 0/1/2 (uneven, zero-size blocks), Replicate, 2-D and 3-D meshes, plain tensors, and the
    _StridedShard rows of FSDP2 x TP: the block LoadSpec names is the rank's local data, and blocks tile."""
    proc = torchrun(4, str(WORKERS / "loadspec.py"))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(result.values()), {k: v for k, v in result.items() if not v}
    assert any("_StridedShard" in key for key in result), sorted(result)
    assert len(result) > 20


def test_load_hf_reads_only_a_ranks_block_on_any_shard_dims(tmp_path: Path) -> None:
    """RowReader.block (load_hf's read for a tensor stored as is) against safetensors' own slicing: column
    shards (TP rowwise, 2-D meshes) and 3-D blocks read exactly their bytes; short runs fall back to rows."""
    from safetensors import safe_open

    from ckptconv.formats.hf import open_hf
    from ckptconv.formats.safetensors_io import RowReader

    g = torch.Generator().manual_seed(4)
    tensors = {
        "wide": torch.randn(16, 4096, generator=g),
        "cube": torch.randn(4, 6, 1024, generator=g),
        "narrow": torch.randn(40, 8, generator=g).to(torch.bfloat16),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    stored = open_hf(tmp_path).tensors
    cases = [
        ("wide", (0, 1024), (16, 1024), True),  # Shard(1) of 4: one 4 KiB run a row
        ("wide", (4, 2048), (4, 2048), True),  # a 2-D block
        ("wide", (3, 0), (5, 4096), True),  # Shard(0): one run
        ("cube", (1, 2, 0), (2, 3, 1024), True),  # a grouped 3-D tensor sharded on dims 0 and 1
        ("cube", (0, 0, 512), (4, 6, 512), False),  # 2 KiB runs: rows, then cut
        ("narrow", (10, 4), (20, 4), False),  # 8-byte runs: whole rows read, then cut
    ]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        for key, offsets, sizes, exact in cases:
            reader = RowReader()
            got = reader.block(stored[key], offsets, sizes)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            assert torch.equal(got, f.get_slice(key)[index]), (key, offsets, sizes)
            if exact:
                assert reader.bytes_read == got.numel() * got.element_size(), (key, offsets, sizes)
            reader.close()


def test_load_specs_name_the_hf_keys_and_fused_dim_through_a_mapping(tmp_path: Path) -> None:
    """torchtitan-qwen3 runtime names: stacked experts hold one HF key per expert on dim 0, a renamed
    tensor its one key; the runtime state dict nested under "model" like a training checkpoint."""
    from test_presets import runtime_spec, tiny_qwen3

    hf_dir = tiny_qwen3(tmp_path / "ref", moe=True, tied=False)
    spec = runtime_spec("torchtitan-qwen3", hf_dir)
    sd = {"model": {k: torch.zeros(shape) for k, (shape, _, _) in spec.items()}, "step": 3}
    config = json.loads((hf_dir / "config.json").read_text())
    specs = lib.load_specs(sd, mapping="torchtitan-qwen3", config=config)
    experts = specs["model.layers.1.moe.routed_experts.inner_experts.w1_EFD"]
    assert experts.fused_dim == 0 and experts.shape[0] == 4
    assert experts.hf_keys == tuple(f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in range(4))
    assert experts.offsets == (0, 0, 0) and experts.sizes == experts.shape and experts.steps == ()
    q = specs["model.layers.0.attention.qkv_linear.wq.weight"]
    assert q.hf_keys == ("model.layers.0.self_attn.q_proj.weight",) and q.fused_dim is None
    assert set(specs) == {f"model.{k}" for k in spec}
