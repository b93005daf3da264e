"""ModelOpt NVFP4 (and MIXED_PRECISION with an FP8 layer), MXFP8 and DeepSeek-V4 releases read dequantized.

Releases built from tiny transformers models (support/families.py `sized`) by the formats' own code
(support/modelopt.py): NVFP4 by nvidia-modelopt 0.47.0's NVFP4QTensor.quantize with its config from ModelOpt's
convert_hf_quant_config_format (layer 0's experts per expert, layer 1's stacked: gate_up_proj [E, O, I/2]
with one weight_scale_2, down_proj in ModelOpt's bmm layout [E, I/2, O] with one per expert; an ignored
o_proj; input_scale dropped; the MIXED_PRECISION copy has layer 0's q_proj in ModelOpt's FP8); MXFP8 and
DeepSeek-V4's FP8 by transformers 5.24.0's Fp8Quantize (ue8m0), DeepSeek-V4's FP4 experts by ModelOpt's
MXFP4QTensor.quantize. Scales are in the second shard, their weights in the first. The references, bit for
bit: NVFP4QTensor.dequantize (NVFP4), FP8QTensor.dequantize (ModelOpt's FP8), transformers'
Fp8Dequantize._dequantize_one (MXFP8, DeepSeek-V4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ckptconv
from families import sized
from modelopt import build, reference
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain
from test_quantized_sources import run_json

import ckptconv as lib
from ckptconv.formats.hf import open_hf
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.quant import fp8, nvfp4

RELEASES = ("nvfp4", "nvfp4-mixed", "mxfp8", "dsv4")
PARTS = ("weight_scale", "weight_scale_2", "input_scale", "_scale_inv", ".scale")


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modelopt")
    sized("qwen3", root / "moe-bf16", {"hidden_size": 64, "moe_intermediate_size": 48}, moe=True)
    sized("llama", root / "llama-bf16", {"hidden_size": 64, "intermediate_size": 96})
    sizes = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64}
    sized("deepseek_v3", root / "ds-bf16", sizes)
    build(
        ("nvfp4", root / "moe-bf16", root / "nvfp4"),
        ("mxfp8", root / "llama-bf16", root / "mxfp8"),
        ("dsv4", root / "ds-bf16", root / "dsv4"),
        ("grid", root, root / "grid.safetensors"),
    )
    return {name: root / name for name in RELEASES} | {"grid": root / "grid.safetensors"}


def expected(src: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What hf-to-dcp writes: the reference's dequantized weights, every other tensor cast; scales dropped."""
    quantized = reference(src, dtype)
    stored = load_dir(src)
    plain = {k: v.to(dtype) for k, v in stored.items() if k not in quantized and not k.endswith(PARTS)}
    return plain | quantized


def assert_same(got: dict[str, object], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key  # type: ignore[arg-type]


# -- the math -----------------------------------------------------------------------------------------------

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def test_nvfp4_decode_is_modelopts_for_every_code_and_scale(releases: dict[str, Path]) -> None:
    """Every byte of codes under every finite E4M3 scale and three global scales: NVFP4QTensor.dequantize's
    values, zeros' signs included."""
    stored = load_file(releases["grid"])
    for i in range(3):
        for dtype in DTYPES:
            s2 = stored[f"scale_2.{i}"]
            got = nvfp4.dequantize(stored["packed"], stored["scale"], dtype, 16, s2, negative_zero=False)
            assert same_bits(got, stored[f"{i}.{str(dtype).removeprefix('torch.')}"]), (i, dtype)


def test_fp4_and_mxfp8_decode_are_transformers_for_every_code_and_scale() -> None:
    """DeepSeek-V4's FP4 (int8) and MXFP8 (fp8) bytes under every finite E8M0 scale: what transformers'
    Fp8Dequantize._dequantize_one gives."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    reference = Fp8Dequantize(SimpleNamespace(quantization_config=None))._dequantize_one
    e8m0 = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 255 is NaN
    fp4 = torch.arange(-128, 128, dtype=torch.int8).repeat(255, 2)  # [255, 512]: 1024 values, 32 groups
    fp4_scale = e8m0[:, None].expand(-1, 32).contiguous()
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    fp8_q = codes.view(fp8.FP8).repeat(255, 1)[:, :224]  # [255, 224]: 7 groups of 32 (not NaN)
    fp8_scale = e8m0[:, None].expand(-1, 7).contiguous()
    for dtype in DTYPES:
        want = reference(fp4, fp4_scale, output_dtype=dtype)
        assert same_bits(nvfp4.dequantize(fp4, fp4_scale, dtype, 32), want), dtype
        want = reference(fp8_q, fp8_scale, output_dtype=dtype)
        assert same_bits(fp8.dequantize(fp8_q, fp8_scale, dtype, 1, 32), want), dtype


# -- hf-to-dcp, inspect, verify, load_hf ---------------------------------------------------------------------


@pytest.mark.parametrize("name", RELEASES)
@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_hf_to_dcp_writes_the_reference_dequantization(
    releases: dict[str, Path],
    name: str,
    dtype: str | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "dcp"
    flags = ("--dtype", dtype) if dtype else ()
    code, err = run(capsys, "hf-to-dcp", str(releases[name]), str(out), *flags)
    assert code == 0, err
    assert "their scales are not written" in err, err
    assert_same(load_plain(out), expected(releases[name], torch.float32 if dtype else torch.bfloat16))


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("nvfp4", "model.layers.1.mlp.experts.gate_up_proj.weight"),  # [E, O, I]: stacked rows
        ("nvfp4", "model.layers.1.mlp.experts.down_proj"),  # [E, I, O]: bmm, a weight_scale_2 per expert
        ("nvfp4", "model.layers.0.mlp.experts.1.down_proj.weight"),
        ("mxfp8", "model.layers.0.mlp.down_proj.weight"),
        ("dsv4", "model.layers.1.mlp.experts.2.down_proj.weight"),  # FP4
        ("dsv4", "model.layers.0.mlp.up_proj.weight"),  # FP8 128 x 128
    ],
)
def test_any_block_is_the_reference_and_reads_its_parts_only(
    releases: dict[str, Path], name: str, key: str
) -> None:
    """A rank's rows, or any block (a TP / FSDP shard on any dim), read from the weight and its scales in
    another file, is the reference's block in bf16 and fp32."""
    t = open_hf(releases[name]).tensors[key]
    assert t.quant is not None and t.quant.scale.file != t.file
    g = torch.Generator().manual_seed(0)
    reader = RowReader()
    for dtype in (torch.bfloat16, torch.float32):
        full = reference(releases[name], dtype)[key]
        assert full.shape == t.shape
        half = t.shape[0] // 2
        assert same_bits(reader.rows(t, half, t.shape[0], dtype=dtype), full[half:].contiguous())
        for _ in range(25):
            offsets = [int(torch.randint(0, n, (), generator=g)) for n in t.shape]
            sizes = [
                int(torch.randint(1, n - o + 1, (), generator=g))
                for n, o in zip(t.shape, offsets, strict=True)
            ]
            got = reader.block(t, offsets, sizes, dtype=dtype)
            want = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
            assert same_bits(got, want.contiguous()), (offsets, sizes)
    reader.close()
    if name == "nvfp4" and key.endswith("gate_up_proj.weight"):  # experts [1, 3) of [4, 96, 64]
        reader = RowReader()
        reader.rows(t, 1, 3, dtype=torch.float32)
        assert reader.bytes_read == 2 * 96 * 32 + 2 * 96 * 4 + 4  # packed rows, scale rows, the global scale
        reader.close()


def test_inspect_verify_and_load_hf(
    releases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect --json: one logical tensor per weight (the ignored o_proj plain); verify compares the
    dequantized values with a DCP of them; load_hf fills a plain state dict with the bf16 reference."""
    src = releases["nvfp4"]
    _, doc = run_json(capsys, "inspect", str(src))
    by_key = {t["key"]: t for t in doc["tensors"]}
    assert not any(k.endswith(PARTS) for k in by_key)
    down = by_key["model.layers.1.mlp.experts.down_proj"]
    assert down["dtype"] == "nvfp4" and down["shape"] == [4, 48, 64]
    assert down["quantized"] == {
        "scheme": "nvfp4",
        "block_size": 16,
        "scale_key": "model.layers.1.mlp.experts.down_proj_weight_scale",
        "scale_dtype": "float8_e4m3fn",
        "scale_file": "model-00002-of-00002.safetensors",
        "dequantized_dtype": "bfloat16",
        "values_key": "model.layers.1.mlp.experts.down_proj",
        "other_keys": ["model.layers.1.mlp.experts.down_proj_weight_scale_2"],
    }
    assert "quantized" not in by_key["model.layers.1.self_attn.o_proj.weight"]
    for name, scheme, stored in (("mxfp8", "mxfp8", "float8_e4m3fn"), ("dsv4", "dsv4-fp4", "fp4")):
        _, doc = run_json(capsys, "inspect", str(releases[name]))
        schemes = {t["quantized"]["scheme"]: t["dtype"] for t in doc["tensors"] if "quantized" in t}
        assert schemes[scheme] == stored, schemes
    out = tmp_path / "dcp"
    code, err = run(capsys, "hf-to-dcp", str(src), str(out), "--verify")
    assert code == 0, err
    code, doc = run_json(capsys, "verify", str(src), str(out))
    assert doc["match"], doc
    want = expected(src, torch.bfloat16)
    state = {k: torch.empty_like(v) for k, v in want.items()}
    report = lib.load_hf(state, src)
    assert not report.missing and not report.unexpected
    assert_same(dict(state), want)


@pytest.mark.slow
def test_two_ranks_write_what_one_rank_writes(releases: dict[str, Path], tmp_path: Path) -> None:
    """Every scheme at once: each of 2 ranks dequantizes only its Shard(0) rows."""
    for name in RELEASES:
        out = tmp_path / name
        proc = ckptconv("hf-to-dcp", str(releases[name]), str(out), nproc=2)
        assert proc.returncode == 0, proc.stderr
        assert_same(load_plain(out), expected(releases[name], torch.bfloat16))


# -- bad inputs ---------------------------------------------------------------------------------------------


def _write(directory: Path, tensors: dict[str, torch.Tensor], qc: dict | None, **top: object) -> Path:
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config: dict[str, object] = {"dtype": "bfloat16", **top}
    if qc is not None:
        config["quantization_config"] = qc
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _nvfp4(rows: int = 4, cols: int = 32, scale_cols: int | None = None) -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.zeros(rows, cols // 2, dtype=torch.uint8),
        "a.weight_scale": torch.ones(rows, scale_cols or cols // 16).to(torch.float8_e4m3fn),
        "a.weight_scale_2": torch.tensor(0.5),
    }


NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}
E8M0 = torch.float8_e8m0fnu
FP8, AWQ = {"quant_algo": "FP8"}, {"quant_algo": "W4A8_AWQ"}
DSV4 = {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
BAD = {
    "unknown quant_algo": (_nvfp4(), {**NVFP4, "quant_algo": "W4A8_AWQ"}, {}, ("'a.weight'", "'W4A8_AWQ'")),
    "nvfp4 scale shape": (_nvfp4(scale_cols=3), NVFP4, {}, ("'a.weight_scale'", "[4, 3]", "needs [4, 2]")),
    "no weight_scale_2": (
        {k: v for k, v in _nvfp4().items() if not k.endswith("_2")},
        NVFP4,
        {},
        ("'a.weight'", "no 'a.weight_scale_2'"),
    ),
    "no weight_scale": (
        {**_nvfp4(), "b.weight": torch.zeros(4, 16, dtype=torch.uint8)},
        NVFP4,
        {},
        ("'b.weight'", "no 'b.weight_scale'"),
    ),
    "scale of another dtype": (
        {**_nvfp4(), "a.weight_scale": torch.ones(4, 2)},
        NVFP4,
        {},
        ("'a.weight_scale'", "float32, not float8_e4m3fn"),
    ),
    "ignored module quantized": (
        _nvfp4(),
        {**NVFP4, "ignore": ["a"]},
        {},
        ("'a.weight_scale'", "ignores"),
    ),
    "mixed precision, an AWQ layer": (
        _nvfp4(),
        {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": AWQ}},
        {},
        ("'a.weight_scale'", "quant_algo 'W4A8_AWQ'"),
    ),
    "mixed precision, an FP8 layer stored as NVFP4": (
        _nvfp4(),
        {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": FP8}},
        {},
        ("'a.weight'", "uint8, not float8_e4m3fn"),
    ),
    "hf_quant_config.json only": (_nvfp4(), None, {}, ("'a.weight_scale_2'", "no quantization_config")),
    "mxfp8 scale shape": (
        {"a.weight": torch.zeros(4, 64).to(fp8.FP8), "a.weight_scale_inv": torch.ones(4, 3).to(E8M0)},
        {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [1, 32]},
        {},
        ("'a.weight_scale_inv'", "1x32 blocks needs [4, 2]"),
    ),
    "dsv4 fp4 without expert_dtype": (
        {"a.weight": torch.zeros(4, 32, dtype=torch.int8), "a.scale": torch.ones(4, 2).to(E8M0)},
        DSV4,
        {},
        ("'a.weight'", "expert_dtype"),
    ),
    "dsv4 fp4 scale shape": (
        {"a.weight": torch.zeros(4, 32, dtype=torch.int8), "a.scale": torch.ones(4, 1).to(E8M0)},
        DSV4,
        {"expert_dtype": "fp4"},
        ("'a.scale'", "needs [4, 2]"),
    ),
    "bmm experts without their scales": (
        {**_nvfp4(), "experts.gate_up_proj": torch.zeros(2, 8, 4, dtype=torch.uint8)},
        NVFP4,
        {},
        ("'experts.gate_up_proj'", "no 'experts.gate_up_proj_weight_scale'"),
    ),
    "dsv4 fp4 weight without its scale": (
        {
            "a.weight": torch.zeros(4, 32, dtype=torch.int8),
            "a.scale": torch.ones(4, 2).to(E8M0),
            "b.weight": torch.zeros(4, 32, dtype=torch.int8),
        },
        DSV4,
        {"expert_dtype": "fp4"},
        ("'b.weight'", "no 'b.scale'"),
    ),
    "nvfp4 parts without a quantization_config": (
        {k: v for k, v in _nvfp4().items() if not k.endswith("_2")},
        None,
        {},
        ("'a.weight_scale'", "no quantization_config"),
    ),
    "dsv4 fp8 scale shape": (
        {"a.weight": torch.zeros(200, 64).to(fp8.FP8), "a.scale": torch.ones(1, 1).to(E8M0)},
        DSV4,
        {},
        ("'a.scale'", "needs [2, 1]"),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_release_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors, qc, top, needles = BAD[case]
    src = _write(tmp_path / "src", tensors, qc, **top)
    for command in (("inspect",), ("hf-to-dcp", str(tmp_path / "out"))):
        code, err = run(capsys, command[0], str(src), *command[1:])
        assert_one_line(code, err, "model.safetensors", *needles)
    assert not (tmp_path / "out").exists()


def test_a_norm_scale_and_an_unquantized_ignored_module_stay_tensors(tmp_path: Path) -> None:
    """`.scale` beside a float weight (a norm's, as Inkling2 has) is a tensor of its own; an ignored module
    keeps its plain weight beside the NVFP4 ones."""
    src = _write(
        tmp_path / "src",
        {"n.weight": torch.ones(4), "n.scale": torch.ones(4), **_nvfp4(), "lm_head.weight": torch.ones(2)},
        NVFP4,
    )
    tensors = open_hf(src).tensors
    assert [k for k, t in tensors.items() if t.quant is not None] == ["a.weight"]
    assert set(tensors) == {"n.weight", "n.scale", "a.weight", "lm_head.weight"}
    shutil.rmtree(src)
    src = _write(tmp_path / "src", {"n.weight": torch.ones(4), "n.scale": torch.ones(4)}, DSV4)
    assert set(open_hf(src).tensors) == {"n.weight", "n.scale"}


def test_a_group_size_no_release_has_is_refused_before_any_allocation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The scales were repeated group_size times before being cut to the weight's width: a 3 KB release
    claiming group_size 2**28 took 17 GB, 2**34 a traceback. Now bounded, and refused naming config.json."""
    src = _write(tmp_path / "src", _nvfp4(), {**NVFP4, "group_size": 2**34})
    code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert_one_line(code, err, str(src / "config.json"), "group_size 17179869184", "ModelOpt writes 16")
    assert not (tmp_path / "out").exists()
