"""dcp-to-hf --quantize fp8-block and nvfp4 (issue #38 point 2): the releases vLLM and sglang serve.

fp8-block is compressed-tensors' `float-quantized` block FP8 (llm-compressor's FP8_BLOCK scheme): the oracle
is compressed-tensors 0.20.0 itself, its `calculate_qparams` (from each block's min and max, what
llm-compressor's observer hands it) and `FloatQuantizationCompressor.compress`, and its config is what its
`ModelCompressor.update_config` writes for the same tiny transformers model; its `QuantizationConfig` and
`CompressedTensorsDequantizer` read the release back.

nvfp4 is ModelOpt's NVFP4: the oracle is nvidia-modelopt 0.47.0's own `NVFP4QTensor.quantize` and
`convert_hf_quant_config_format`, run in a subprocess from a pinned install (support/modelopt.py);
compressed-tensors' `ModelOptNvfp4Converter` and NVFP4 decompressor read the release back.

Both quantize the weights as the release's dtype holds them (bf16 here, from an fp32 DCP).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ckptconv, tree_sha256
from modelopt import modelopt_nvfp4
from safetensors.torch import load_file
from test_bad_input import assert_one_line, run
from test_quantize import QUANTIZED, llama

FP8 = torch.float8_e4m3fn
SCHEMES = ("fp8-block", "nvfp4")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (a 0-d scale too)."""
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny fp32 Llama (hidden 192, intermediate 320: edge blocks for 128x128, whole groups of 16; an
    all-zero 128x128 block), as a DCP, and its fp8-block and nvfp4 releases (--verify, --copy-from)."""
    root, weights = llama(tmp_path_factory.mktemp("v2"), 192, 320)
    found: dict[str, Any] = {"root": root, "weights": weights}
    for scheme in SCHEMES:
        out = root / scheme
        flags = ("--quantize", scheme, "--copy-from", str(root / "hf"), "--verify")
        proc = ckptconv("dcp-to-hf", str(root / "dcp"), str(out), *flags)
        assert proc.returncode == 0, proc.stderr
        found[scheme] = (out, proc.stderr)
    return found


def _quantized(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The linear weights --quantize selects, in the release's dtype (bf16)."""
    keys = [k for k in weights if any(f".{m}." in k for m in QUANTIZED)]
    assert len(keys) == 14
    return {k: weights[k].to(torch.bfloat16) for k in keys}


def _ct_compress(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' FP8_BLOCK of `w`: scales from each block's min and max by `calculate_qparams`,
    values by the float-quantized compressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8_BLOCK
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], **FP8_BLOCK)
    rows, cols = w.shape
    sr, sc = -(-rows // 128), -(-cols // 128)
    blocks = torch.nn.functional.pad(w, (0, sc * 128 - cols, 0, sr * 128 - rows)).view(sr, 128, sc, 128)
    scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), scheme.weights)
    compressed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return compressed["weight"], compressed["weight_scale"]


def _ct_config(hf: Path, tmp: Path) -> dict[str, Any]:
    """The quantization_config compressed-tensors writes for the model of `hf`, FP8_BLOCK on its Linear
    layers but lm_head (llm-compressor's recipe)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import FP8_BLOCK
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    group = QuantizationScheme(targets=["Linear"], **FP8_BLOCK)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"]))
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    assert compressor.quantization_config is not None
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED  # as compress_model
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    compressor.update_config(str(tmp))
    return json.loads((tmp / "config.json").read_text())["quantization_config"]


def test_fp8_block_release_is_compressed_tensors_own(released: dict[str, Any], tmp_path: Path) -> None:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import QuantizationConfig

    root, weights = released["root"], released["weights"]
    out, err = released["fp8-block"]
    got = load_file(out / "model.safetensors")
    quantized = _quantized(weights)
    for key, w in quantized.items():
        q, s = _ct_compress(w)
        assert same_bytes(got[key], q), key
        assert same_bytes(got[key + "_scale"], s), key  # bf16, as the model's
    for key, w in weights.items():
        if key not in quantized:
            assert same_bytes(got[key], w.to(torch.bfloat16)) and key + "_scale" not in got, key
    assert len(got) == len(weights) + len(quantized)
    # the all-zero block: compressed-tensors' eps of the scale's dtype
    assert got["model.layers.0.mlp.up_proj.weight_scale"][0, 0] == torch.finfo(torch.bfloat16).eps
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    expected = _ct_config(root / "hf", tmp_path / "ct")
    assert config["ignore"] == ["lm_head", "model.embed_tokens"]  # every 2-D weight left alone
    assert {**config, "ignore": ["lm_head"]} == expected
    QuantizationConfig.model_validate(config)
    # compressed-tensors' own dequantizer reads the release: every quantized weight, from its bytes
    dequantized = CompressedTensorsDequantizer(out).validate(dict(got))
    for key, w in quantized.items():
        scale = got[key + "_scale"]
        grid = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        assert torch.equal(dequantized[key], got[key].to(torch.bfloat16) * grid), key
    assert "verified: 35 tensors match the source bit for bit (14 fp8-block weights as their stored" in err
    assert "config.json: quantization_config: added (compressed-tensors)" in err


def test_nvfp4_release_is_modelopts_own(released: dict[str, Any], tmp_path: Path) -> None:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    weights = released["weights"]
    out, err = released["nvfp4"]
    got = load_file(out / "model.safetensors")
    quantized = _quantized(weights)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    oracle, modelopt_config = modelopt_nvfp4(quantized, config["ignore"], tmp_path / "modelopt")
    for key in quantized:
        for part in (key, key + "_scale", key + "_scale_2"):
            assert same_bytes(got[part], oracle[part]), part
        input_scale = got[key.removesuffix("weight") + "input_scale"]
        assert input_scale.dtype == torch.float32 and input_scale.shape == () and input_scale == 1.0
    assert got["model.layers.0.mlp.down_proj.weight"].shape == (192, 160)  # [O, I/2]
    assert got["model.layers.0.mlp.down_proj.weight_scale"].shape == (192, 20)  # [O, I/16]
    for key, w in weights.items():
        if key not in quantized:
            assert same_bytes(got[key], w.to(torch.bfloat16)), key
    assert len(got) == len(weights) + 3 * len(quantized)
    assert config["ignore"] == ["lm_head", "model.embed_tokens"]
    assert {k: v for k, v in config.items() if k != "group_size"} == modelopt_config
    assert config["group_size"] == 16
    # compressed-tensors reads it as ModelOpt NVFP4 (input_scale required) and decompresses every weight
    tensors = ModelOptNvfp4Converter(ignore=config["ignore"], targets=["Linear"]).validate(dict(got))
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    for key, w in quantized.items():
        module = key.removesuffix(".weight")
        names = ("weight_packed", "weight_scale", "weight_global_scale")
        state = {p: tensors[f"{module}.{p}"] for p in names}
        back = NVFP4PackedCompressor.decompress(state, scheme)["weight"].float()
        step = (got[key + "_scale"].float() * got[key + "_scale_2"]).repeat_interleave(16, 1)
        # within half the widest step (4 to 6) of its value, give or take the decompressor's rounding
        assert bool(((back - w.float()).abs() <= step * 1.1).all()), key
    assert "verified: 63 tensors match the source bit for bit (14 nvfp4 weights as their stored" in err
    assert "config.json: quantization_config: added (modelopt)" in err


def test_releases_read_back_as_their_formats_dequantize_them(
    released: dict[str, Any], tmp_path: Path
) -> None:
    """hf-to-dcp of each release (the readers of compressed-tensors and ModelOpt NVFP4) holds what the
    format's own dequantizer makes of it: compressed-tensors' decompress for fp8-block, ModelOpt's
    NVFP4QTensor.dequantize for nvfp4; the other weights as written, the input scales left out; and
    transformers' from_pretrained (compressed-tensors decompressing) of the fp8-block release the same."""
    from ct import oracle
    from test_hf_to_dcp import load_plain

    quantized = _quantized(released["weights"])
    references = {
        "fp8-block": oracle(released["fp8-block"][0], torch.bfloat16),
        "nvfp4": {
            k.removesuffix("_dequantized"): v
            for k, v in modelopt_nvfp4(quantized, [], tmp_path / "modelopt")[0].items()
            if k.endswith("_dequantized")
        },
    }
    for scheme in SCHEMES:
        release = released[scheme][0]
        proc = ckptconv("hf-to-dcp", str(release), str(tmp_path / scheme))
        assert proc.returncode == 0, proc.stderr
        got = load_plain(tmp_path / scheme)
        assert sorted(got) == sorted(released["weights"]), scheme
        assert sorted(references[scheme]) == sorted(quantized), scheme
        for key, value in got.items():
            want = references[scheme].get(key, released["weights"][key].to(torch.bfloat16))
            assert isinstance(value, torch.Tensor) and same_bytes(value, want), (scheme, key)
        if scheme == "fp8-block":  # transformers loads it too (transformers 5.24 has no NVFP4 dequantizer)
            from transformers import AutoModelForCausalLM, CompressedTensorsConfig

            config = CompressedTensorsConfig(run_compressed=False)
            model = AutoModelForCausalLM.from_pretrained(release, quantization_config=config)
            loaded = model.state_dict()
            assert all(same_bytes(loaded[k], v) for k, v in got.items() if isinstance(v, torch.Tensor))


def test_skip_fp32_and_bad_schemes(
    released: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(released["root"] / "dcp")
    hf = str(released["root"] / "hf")
    flags = ("--fp32", r"layers\.0\.self_attn\.q_proj", "--quantize-skip", r"down_proj", "--copy-from", hf)
    for scheme in SCHEMES:
        out = tmp_path / scheme
        code, err = run(capsys, "dcp-to-hf", src, str(out), "--quantize", scheme, *flags)
        assert code == 0, err
        got = load_file(out / "model.safetensors")
        assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
        assert got["model.layers.1.self_attn.q_proj.weight"].dtype in (FP8, torch.uint8)
        assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
        assert "model.layers.0.mlp.down_proj.weight_scale" not in got
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert "model.layers.0.self_attn.q_proj" in ignore and "model.layers.1.mlp.down_proj" in ignore
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "bad"), "--quantize", "nvfp5")
    assert_one_line(code, err, "--quantize 'nvfp5' is not one of fp8, fp8-block, nvfp4")
    assert not (tmp_path / "bad").exists()


def test_verify_checks_the_stored_bytes(
    released: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--verify compares each quantized tensor's bytes with the source quantized again: a writer that rounds
    one scale otherwise is a mismatch (exit 1, nothing published)."""
    from ckptconv.quant import policy
    from ckptconv.stream import hf_write

    def off_by_one(scheme: str, w: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        parts = list(policy.encode(scheme, w, dtype))
        parts[1] = parts[1].clone()
        parts[1].view(torch.uint8 if parts[1].itemsize == 1 else torch.int16).view(-1)[0] += 1
        return tuple(parts)

    monkeypatch.setattr(hf_write, "encode", off_by_one)
    src = str(released["root"] / "dcp")
    for scheme in SCHEMES:
        out = tmp_path / scheme
        code, err = run(capsys, "dcp-to-hf", src, str(out), "--quantize", scheme, "--verify")
        assert code == 1 and "--verify: the output differs from" in err and "_scale" in err, err
        assert not out.exists()


@pytest.mark.slow
def test_same_bytes_at_any_rank_count(released: dict[str, Any], tmp_path: Path) -> None:
    """1 and 2 ranks (both read paths, --verify) write the same files; across several files (300KB) every
    weight's scales lie in its file."""
    root = released["root"]
    for scheme in SCHEMES:
        digests = []
        for nproc, read in ((0, "direct"), (2, "direct"), (2, "gather")):
            out = tmp_path / f"{scheme}-{nproc}-{read}"
            flags = ("--quantize", scheme, "--max-shard-size", "300KB", "--read", read, "--verify")
            proc = ckptconv("dcp-to-hf", str(root / "dcp"), str(out), *flags, nproc=nproc)
            assert proc.returncode == 0, proc.stderr
            digests.append(tree_sha256(out))
        assert digests[0] == digests[1] == digests[2], scheme
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(weight_map.values())) > 1
        for key, name in weight_map.items():
            if key.endswith(".input_scale"):
                assert weight_map[key.removesuffix("input_scale") + "weight"] == name, key
            elif key.endswith(("_scale", "_scale_2")):
                assert weight_map[key.rsplit("_scale", 1)[0]] == name, key


def test_nvfp4_leaves_odd_widths_and_reads_an_all_zero_weight_as_zeros() -> None:
    """A weight whose input dim is not a multiple of 16 has no NVFP4 layout: left unquantized (and in the
    config's ignore). An all-zero weight, where ModelOpt divides 0 by 0 (NaN scales), gets weight_scale_2 0
    and group scales 1.0."""
    from ckptconv.quant import nvfp4_encode
    from ckptconv.quant.policy import QuantPolicy

    policy = QuantPolicy("nvfp4")
    assert policy.selects("m.up_proj.weight", (32, 48), torch.bfloat16, False)
    assert not policy.selects("m.up_proj.weight", (32, 40), torch.bfloat16, False)
    assert QuantPolicy("fp8-block").selects("m.up_proj.weight", (32, 40), torch.bfloat16, False)
    packed, scale, scale_2 = nvfp4_encode.quantize(torch.zeros(4, 32), torch.bfloat16)
    assert not packed.any() and bool((scale.float() == 1.0).all()) and scale_2 == 0.0
