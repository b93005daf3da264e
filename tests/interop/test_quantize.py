"""dcp-to-hf --quantize fp8 (issue #17 points 1, 3 and 4): block-FP8 releases out, config.json following them.

The reference is DeepSeek-V3's block quantization written out here block by block (`ref_quantize`, no
ckptconv code): scale = amax / 448 per 128x128 block (edge blocks as they are, 1.0 for an all-zero block),
values divided, clamped and cast. torch's own `QuantizedHuggingFaceStorageReader` reads the release back, and
transformers loads it (dequantizing on CPU) where its loader can (dims of 128 or less, or multiples of 128).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT, SUPPORT, ckptconv, tree_sha256
from families import tiny
from pinned import install_pinned
from safetensors.torch import load_file
from test_bad_input import assert_one_line, run

from ckptconv.cli.app import main

FP8 = torch.float8_e4m3fn
ACCELERATE = SUPPORT / "accelerate-requirements.txt"


def ref_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block FP8, one 128x128 block at a time."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128))
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            block = w[i : i + 128, j : j + 128].float()
            amax = block.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            q[i : i + 128, j : j + 128] = (block / scale).clamp(-448.0, 448.0).to(FP8)
            s[i // 128, j // 128] = scale
    return q, s


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def llama(path: Path, hidden: int, inter: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny fp32 Llama from transformers (config.json beside) and its weights saved as a DCP checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[:128, :128] = 0  # an all-zero block: scale 1.0
    model.save_pretrained(path / "hf")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": weights}, checkpoint_id=str(path / "dcp"), no_dist=True)
    return path, weights


QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Dims that are not multiples of 128 (edge blocks): hidden 200, intermediate 328."""
    return llama(tmp_path_factory.mktemp("odd"), 200, 328)


def test_fp8_release_is_deepseeks_block_quantization(
    odd: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, weights = odd
    out = tmp_path / "fp8"
    code, err = run(
        capsys, "dcp-to-hf", str(root / "dcp"), str(out), "--quantize", "fp8", "--copy-from", str(root / "hf")
    )
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    quantized = {k for k in weights if any(f".{m}." in k for m in QUANTIZED)}
    assert len(quantized) == 14
    for key, w in weights.items():
        if key in quantized:
            q, s = ref_quantize(w)
            assert same_bytes(got[key], q), key
            assert same_bytes(got[key + "_scale_inv"], s), key
        else:  # embeddings, norms, lm_head: --dtype (bf16), no scale
            assert same_bytes(got[key], w.to(torch.bfloat16)), key
            assert key + "_scale_inv" not in got
    assert len(got) == len(weights) + len(quantized)
    assert got["model.layers.0.mlp.up_proj.weight_scale_inv"][0, 0] == 1.0  # the all-zero block
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    assert "config.json: dtype: 'float32' -> 'bfloat16'" in err
    assert "config.json: quantization_config: added (fp8)" in err
    gen = "generation_config.json"
    assert (out / gen).read_bytes() == (root / "hf" / gen).read_bytes()  # other copied files untouched


def test_torchs_quantized_reader_reads_the_release(
    odd: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    root, weights = odd
    out = tmp_path / "fp8"
    flags = ("--quantize", "fp8", "--max-shard-size", "300KB")  # torch's reader needs the index
    assert run(capsys, "dcp-to-hf", str(root / "dcp"), str(out), *flags)[0] == 0
    assert (out / "model.safetensors.index.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for key, file in index.items():  # a weight and its scale always share a file
        if key.endswith("_scale_inv"):
            assert index[key.removesuffix("_scale_inv")] == file
    state = {k: torch.empty(w.shape, dtype=torch.float32) for k, w in weights.items()}
    reader = QuantizedHuggingFaceStorageReader(str(out), target_dtype=torch.float32)
    dcp.load(state, storage_reader=reader, no_dist=True)
    for key, w in weights.items():
        if key.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight")):
            continue
        q, s = ref_quantize(w)
        grid = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        assert torch.equal(state[key], q.float() * grid), key
        # within FP8 rounding of the source: e4m3 keeps 3 mantissa bits (half an ulp: 2**-4 relative)
        assert ((state[key] - w).abs() <= w.abs() * 2**-4 + grid * 2**-9).all(), key


@pytest.mark.slow
def test_transformers_loads_an_aligned_release(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, weights = llama(tmp_path, 256, 384)
    out = tmp_path / "fp8"
    flags = ("--quantize", "fp8", "--copy-from", str(root / "hf"))
    assert run(capsys, "dcp-to-hf", str(root / "dcp"), str(out), *flags)[0] == 0
    loaded = _load(out)
    assert not any(loaded["info"].values()), loaded["info"]
    for key, w in weights.items():
        got = loaded["state"][key]
        assert got.dtype == torch.bfloat16
        if any(f".{m}." in key for m in QUANTIZED):
            q, s = ref_quantize(w)
            grid = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
            assert torch.equal(got, (q.float() * grid).to(torch.bfloat16)), key
        else:
            assert torch.equal(got, w.to(torch.bfloat16)), key


def _load(directory: Path) -> dict[str, Any]:
    """transformers' from_pretrained of an FP8 release on CPU, in a subprocess with accelerate (which
    transformers' FP8 loader needs) on its path: {"info": loading info, "state": state dict}."""
    import subprocess
    import sys

    accelerate = install_pinned(ROOT / ".cache" / "accelerate-1.15.0", ACCELERATE)
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, FineGrainedFP8Config\n"
        "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True,\n"
        "    quantization_config=FineGrainedFP8Config(dequantize=True))\n"
        "info = {k: sorted(map(str, v)) for k, v in info.items()}\n"
        "torch.save({'info': info, 'state': m.state_dict()}, sys.argv[2])\n"
    )
    result = directory.parent / "loaded.pt"
    env = {**__import__("os").environ, "PYTHONPATH": str(accelerate)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(directory), str(result)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(result, weights_only=True)


def test_fp32_and_quantize_skip_win_and_requantizing_is_stable(
    odd: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptconv.quant import fp8

    root, weights = odd
    out = tmp_path / "fp8"
    flags = ("--quantize", "fp8", "--fp32", r"layers\.0\.self_attn\.q_proj", "--quantize-skip", r"down_proj")
    code, err = run(capsys, "dcp-to-hf", str(root / "dcp"), str(out), *flags, "--copy-from", str(root / "hf"))
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert got["model.layers.1.self_attn.q_proj.weight"].dtype == FP8
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    not_converted = json.loads((out / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    assert (
        "model.layers.0.self_attn.q_proj" in not_converted and "model.layers.1.mlp.down_proj" in not_converted
    )
    # quantizing the dequantized weights again gives the same bytes (bf16 -> fp8 -> bf16 -> fp8)
    for key in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        w = weights[key].to(torch.bfloat16)
        q, s = fp8.quantize(w)
        again, s2 = fp8.quantize(fp8.dequantize(q, s, torch.bfloat16))
        assert same_bytes(again, q) and torch.equal(s2, s), key


def test_bad_quantize_flags_are_one_line_errors(
    odd: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(odd[0] / "dcp")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "a"), "--quantize", "int3")
    assert_one_line(code, err, "--quantize 'int3' is not one of fp8")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "b"), "--quantize-skip", "x")
    assert_one_line(code, err, "--quantize-skip applies with --quantize fp8")
    code, err = run(
        capsys, "dcp-to-hf", src, str(tmp_path / "c"), "--quantize", "fp8", "--quantize-skip", "("
    )
    assert_one_line(code, err, "--quantize-skip '(' is not a valid regular expression")
    assert not any((tmp_path / n).exists() for n in "abc")


def test_config_follows_an_unquantized_export(
    odd: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Copied from an FP8 release's directory (nested dtypes, torch_dtype), a bf16 export says bf16 and
    loses the quantization section; the JSON report lists the edits."""
    root, _ = odd
    donor = tmp_path / "donor"
    donor.mkdir()
    config = json.loads((root / "hf" / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    config["text_config"] = {"dtype": "float32", "hidden_size": 200}
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (donor / "config.json").write_text(json.dumps(config))
    (donor / "tokenizer.json").write_text('{"x": 1}')
    out = tmp_path / "out"
    try:
        main(["dcp-to-hf", str(root / "dcp"), str(out), "--copy-from", str(donor), "--json"])
    except SystemExit as e:
        assert not e.code
    report = json.loads(capsys.readouterr().out)
    assert report["config_edits"] == [
        "torch_dtype: 'float32' -> 'bfloat16'",
        "text_config.dtype: 'float32' -> 'bfloat16'",
        "quantization_config: removed (fp8; the weights written are not quantized)",
    ]
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written["text_config"]["dtype"] == "bfloat16"
    assert "quantization_config" not in written and "dtype" not in written
    assert (out / "tokenizer.json").read_text() == '{"x": 1}'
    # nothing to change: the copied config.json keeps its bytes
    keep = tmp_path / "keep"
    code, err = run(
        capsys, "dcp-to-hf", str(root / "dcp"), str(keep), "--dtype", "keep", "--copy-from", str(root / "hf")
    )
    assert code == 0 and "config.json:" not in err
    assert (keep / "config.json").read_bytes() == (root / "hf" / "config.json").read_bytes()


@pytest.mark.slow
def test_same_bytes_at_any_rank_count(odd: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    root, _ = odd
    digests = []
    for nproc, read in ((0, "direct"), (2, "direct"), (2, "gather")):
        out = tmp_path / f"fp8-{nproc}-{read}"
        flags = ("--quantize", "fp8", "--max-shard-size", "300KB", "--read", read)
        proc = ckptconv("dcp-to-hf", str(root / "dcp"), str(out), *flags, nproc=nproc)
        assert proc.returncode == 0, proc.stderr
        digests.append(tree_sha256(out))
    assert digests[0] == digests[1] == digests[2]


@pytest.mark.slow
def test_torchtitan_deepseek_v3_to_an_fp8_release_with_mtp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torchtitan DeepSeek-V3 DCP (MoE, shared expert, MTP layer) straight to an FP8 release that
    transformers loads: routed and shared experts per expert and the MTP projections quantized, the router
    and its bias, norms, embeddings and head not."""
    hf = tiny("deepseek_v3", tmp_path / "hf", mtp=1)
    source = load_file(hf / "model.safetensors")
    preset = ("--mapping", "torchtitan-deepseek-v3")
    assert run(capsys, "hf-to-dcp", str(hf), str(tmp_path / "dcp"), *preset)[0] == 0
    out = tmp_path / "fp8"
    flags = (*preset, "--quantize", "fp8", "--copy-from", str(hf), "--dtype", "keep")
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "dcp"), str(out), *flags)
    assert code == 0, err
    got = load_file(out / "model.safetensors")
    quantized = {k for k, v in got.items() if v.dtype == FP8}
    assert any(".mlp.experts.0." in k for k in quantized) and any("shared_experts" in k for k in quantized)
    assert any(k.startswith("model.layers.2.") and "eh_proj" in k for k in quantized)  # the MTP layer
    for key in quantized:
        q, s = ref_quantize(source[key])
        assert same_bytes(got[key], q) and same_bytes(got[key + "_scale_inv"], s), key
    for key in got:
        if key.endswith((".mlp.gate.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight")):
            assert got[key].dtype == torch.float32 and torch.equal(got[key], source[key]), key
    loaded = _load(out)
    assert not loaded["info"]["missing_keys"], loaded["info"]
    shutil.rmtree(tmp_path / "dcp")


def test_verify_checks_the_fp8_bytes_and_scales(
    odd: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--verify compares the output with the source's block-FP8 round trip: exact when the bytes are
    DeepSeek's, a mismatch (exit 1, nothing published) when the writer rounds otherwise (here: scales
    rounded to bf16 first, as transformers' bf16 dequant helper does)."""
    import types

    from ckptconv.quant import fp8
    from ckptconv.stream import hf_write

    src = str(odd[0] / "dcp")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "ok"), "--quantize", "fp8", "--verify")
    assert code == 0, err
    assert "verified: 21 tensors match the source bit for bit (14 FP8 weights" in err

    def bf16_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = fp8.quantize_whole(w)[1].to(torch.bfloat16).float()
        grid = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        return (w.float() / grid).clamp(-448.0, 448.0).to(FP8), scale

    monkeypatch.setattr(hf_write, "fp8", types.SimpleNamespace(quantize_whole=bf16_scales))
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "bad"), "--quantize", "fp8", "--verify")
    assert code == 1 and "--verify: the output differs from" in err, err
    assert not (tmp_path / "bad").exists()


def test_requantizing_a_dequantized_release_gives_its_bytes(
    odd: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FP8 release -> hf-to-dcp (dequantized, bf16) -> dcp-to-hf --quantize fp8: the same FP8 weight bytes;
    the scales move only by the bf16 rounding of each block's max (the source was fp32)."""
    root, _ = odd
    first, back, again = tmp_path / "fp8", tmp_path / "dcp", tmp_path / "again"
    assert run(capsys, "dcp-to-hf", str(root / "dcp"), str(first), "--quantize", "fp8")[0] == 0
    code, err = run(capsys, "hf-to-dcp", str(first), str(back))
    assert code == 0 and "dequantized 14 block-FP8 weights" in err, err
    assert run(capsys, "dcp-to-hf", str(back), str(again), "--quantize", "fp8")[0] == 0
    a, b = load_file(first / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        if a[key].dtype == FP8:
            assert same_bytes(a[key], b[key]), key
        elif key.endswith("_scale_inv"):
            assert ((a[key] - b[key]).abs() <= a[key] * 2**-8).all(), key
        else:
            assert same_bytes(a[key], b[key]), key
