"""hf-to-dcp on real transformers checkpoints: dcp.load at any world size, round trips, hub, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from hubcache import hub_cache
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import load_dir, same_bits

from ckptconv.formats.dcp import open_dcp

# the size of every tiny transformers model the tests build (GQA: 4 heads, 2 kv heads)
TINY = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
)


def tiny(kind: str, path: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    common = dict(TINY, tie_word_embeddings=False)
    if kind == "llama":
        config = LlamaConfig(intermediate_size=24, **common)
    else:
        config = Qwen3MoeConfig(
            intermediate_size=24, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, **common
        )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, max_shard_size="8KB")
    assert (path / "model.safetensors.index.json").exists()
    return path


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny("llama", tmp_path_factory.mktemp("llama") / "hf")


@pytest.fixture(scope="session")
def hf_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny("moe", tmp_path_factory.mktemp("moe") / "hf")


def load_plain(ckpt: Path) -> dict[str, object]:
    """dcp.load into a plain single-process state dict shaped from the checkpoint's own metadata."""
    spec = open_dcp(ckpt)
    state: dict[str, object] = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in spec.tensors.items()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def test_llama_loads_into_fsdp2_at_three_ranks(hf_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    proc = ckptconv("hf-to-dcp", str(hf_llama), str(out), "--json", nproc=2)
    assert proc.returncode == 0, proc.stderr
    ranks = json.loads(proc.stdout)["ranks"]  # each rank read about half the source, wrote its data file
    data = {r: sum(p.stat().st_size for p in out.glob(f"__{r}_*.distcp")) for r in (0, 1)}
    assert [(r["rank"], r["bytes_written"]) for r in ranks] == [(0, data[0]), (1, data[1])]
    source = sum(p.stat().st_size for p in hf_llama.glob("*.safetensors"))
    assert all(source / 3 < r["bytes_read"] < source for r in ranks), ranks
    loaded = torchrun(3, str(WORKERS / "load_fsdp2.py"), str(hf_llama), str(out))
    assert "loaded" in loaded.stdout
    state = load_plain(out)
    for key, value in load_dir(hf_llama).items():
        assert same_bits(state[key], value), key  # type: ignore[arg-type]


def test_hf_dcp_hf_round_trip_is_bit_identical(hf_moe: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    shas = []
    for nproc in (0, 2):
        mid, back = tmp_path / f"dcp{nproc}", tmp_path / f"back{nproc}"
        proc = ckptconv("hf-to-dcp", str(hf_moe), str(mid), nproc=nproc)
        assert proc.returncode == 0, proc.stderr
        proc = ckptconv(
            "dcp-to-hf", str(mid), str(back), "--dtype", "keep", "--copy-from", str(hf_moe), "--quiet"
        )
        assert proc.returncode == 0, proc.stderr
        shas.append(tree_sha256(back))
        want, got = load_dir(hf_moe), load_dir(back)
        assert set(got) == set(want) and all(same_bits(got[k], v) for k, v in want.items())
    assert shas[0] == shas[1]
    ids = torch.arange(12).reshape(2, 6) % 64
    a = AutoModelForCausalLM.from_pretrained(hf_moe).eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "back0").eval()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_mixed_dtypes_keep_and_fp32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = {
        "w": torch.randn(5, 3).bfloat16(),
        "A_log": torch.randn(4),
        "pos": torch.arange(3),
        "s": torch.tensor(2.5),
    }
    save_file(src, tmp_path / "model.safetensors")
    for flags, dtypes in [
        ([], {"w": torch.bfloat16, "A_log": torch.float32}),
        (
            ["--dtype", "bf16", "--fp32", "A_log$"],
            {"w": torch.bfloat16, "A_log": torch.float32, "s": torch.bfloat16},
        ),
        (["--dtype", "fp32"], {"w": torch.float32, "A_log": torch.float32}),
    ]:
        out = tmp_path / f"out{len(flags)}"
        code, err = run(capsys, "hf-to-dcp", str(tmp_path / "model.safetensors"), str(out), *flags)
        assert code == 0, err
        state = load_plain(out)
        for key, value in src.items():
            want = value.to(dtypes.get(key, value.dtype))
            assert same_bits(state[key], want), (flags, key)  # type: ignore[arg-type]


def test_stash_round_trip_restores_step_and_args(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    src = tmp_path / "src"
    dcp.save(
        {"model": {"w": torch.ones(3)}, "step": 7, "args": {"lr": 0.5, "cfg": argparse.Namespace(a=1)}},
        checkpoint_id=str(src),
        no_dist=True,
    )
    assert run(capsys, "dcp-to-hf", str(src), str(tmp_path / "hf"), "--quiet")[0] == 0
    assert (
        run(capsys, "hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "back"), "--prefix", "model.")[0] == 0
    )
    back = open_dcp(tmp_path / "back")
    assert set(back.tensors) == {"model.w"} and back.paths["model.w"] == ("model", "w")
    state: dict[str, object] = {"step": 0, "args": {"lr": 0.0}, "model": {"w": torch.zeros(3)}}
    dcp.load(state, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert (
        state["step"] == 7
        and state["args"] == {"lr": 0.5}
        and torch.equal(state["model"]["w"], torch.ones(3))
    )  # type: ignore[index]
    # the item only a full unpickler could read went through as its original bytes, never loaded
    from ckptconv.formats.dcp_reader import DcpReader

    with DcpReader(open_dcp(src)) as a, DcpReader(back) as b:
        assert a.load_item(open_dcp(src).items["args.cfg"])[0] == b.load_item(back.items["args.cfg"])[0]
    # and dcp-to-hf again gives the same HF directory
    assert run(capsys, "dcp-to-hf", str(tmp_path / "back"), str(tmp_path / "hf2"), "--quiet")[0] == 0
    assert tree_sha256(tmp_path / "hf") == tree_sha256(tmp_path / "hf2")


def test_hub_repo_id_offline(hf_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "hfhome"
    hub_cache(
        home, "tiny-org/tiny-llama", {p.name: p.read_bytes() for p in hf_llama.iterdir() if p.is_file()}
    )
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = ckptconv("hf-to-dcp", "tiny-org/tiny-llama", str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert set(open_dcp(tmp_path / "out").tensors) == set(load_dir(hf_llama))
    proc = ckptconv("inspect", "tiny-org/tiny-llama", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["num_tensors"] == len(load_dir(hf_llama))
    proc = ckptconv("verify", "tiny-org/tiny-llama", str(tmp_path / "out"))  # a repo id against a DCP dir
    assert proc.returncode == 0 and proc.stdout.startswith("match: "), proc.stdout + proc.stderr
    proc = ckptconv("verify", str(tmp_path / "out"), "tiny-org/not-cached")
    assert_one_line(proc.returncode, proc.stderr, "tiny-org/not-cached", "cache")
    proc = ckptconv("hf-to-dcp", "tiny-org/not-cached", str(tmp_path / "out2"))
    assert_one_line(proc.returncode, proc.stderr, "tiny-org/not-cached", "cache")
    assert not (tmp_path / "out2").exists()


def test_bad_hf_inputs(
    hf_llama: Path, fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")

    def case(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(hf_llama, d)
        return d

    empty = tmp_path / "nothing"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    checks: list[tuple[Path, list[str]]] = [(empty, ["no .safetensors"]), (fsdp2_ckpt, ["dcp-to-hf"])]
    garbage = case("garbage")
    next(garbage.glob("model-*.safetensors")).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    checks.append((garbage, ["not valid JSON"]))
    truncated = case("truncated")
    victim = next(truncated.glob("model-*.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-10])
    checks.append((truncated, [victim.name, "truncated"]))
    missing = case("missing")
    next(missing.glob("model-*.safetensors")).unlink()
    checks.append((missing, ["missing"]))
    stale = case("stale")
    index = json.loads((stale / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = next(iter(index["weight_map"].values()))
    (stale / "model.safetensors.index.json").write_text(json.dumps(index))
    checks.append((stale, ["model.extra.weight", "does not hold it"]))
    dup = case("dup")
    (dup / "model.safetensors.index.json").unlink()
    first = next(dup.glob("model-*.safetensors"))
    save_file(load_file(first), dup / "model-99999-of-99999.safetensors")
    checks.append((dup, ["is in both"]))
    for src, needles in checks:
        code, err = run(capsys, "hf-to-dcp", str(src), out)
        assert_one_line(code, err, *needles)
        assert not Path(out).exists() and not list(tmp_path.glob(".out*"))
    code, err = run(capsys, "hf-to-dcp", "no/such-dir-or-repo/x", out)
    assert_one_line(code, err, "no such file")


def test_dry_run_and_overwrite(hf_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptconv.cli.app import main

    out = tmp_path / "out"
    main(["hf-to-dcp", str(hf_llama), str(out), "--dry-run", "--dtype", "bf16", "--fp32", "norm"])
    text = capsys.readouterr().out
    assert not out.exists()
    assert "model.embed_tokens.weight" in text and "float32 -> bfloat16" in text and "0:64" in text
    out.mkdir()
    (out / ".metadata").write_text("stale")
    (out / "__7_0.distcp").write_text("stale")
    code, err = run(capsys, "hf-to-dcp", str(hf_llama), str(out))
    assert_one_line(code, err, "--overwrite")
    assert run(capsys, "hf-to-dcp", str(hf_llama), str(out), "--overwrite", "--quiet")[0] == 0
    assert not (out / "__7_0.distcp").exists() and set(load_plain(out)) == set(load_dir(hf_llama))
