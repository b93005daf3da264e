"""Quantized HF sources on the way in (#17): block FP8 (weight + weight_scale_inv) and MXFP4 (gpt-oss's
_blocks + _scales) read dequantized by hf-to-dcp, verify, inspect and load_hf.

Tiny real models written by transformers (support/families.py `sized`) at sizes that are not multiples of the
128 block (hidden 200, intermediate 328 / 136) and aligned ones (256 / 384), quantized with DeepSeek's math
(`families.quantize_fp8`) or packed as random MXFP4 (`families.pack_mxfp4`). References: torch's own
`QuantizedHuggingFaceStorageReader` for FP8, transformers' `convert_moe_packed_tensors` for MXFP4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS, ckptconv, torchrun
from families import pack_mxfp4, quantize_fp8, sized
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain

from ckptconv.cli.app import main
from ckptconv.core.layout import shard_rows
from ckptconv.formats.hf import open_hf
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.quant import fp8, mxfp4

LLAMA = {"hidden_size": 200, "intermediate_size": 328}  # no dim a multiple of 128: edge blocks everywhere
QWEN3 = {"hidden_size": 256, "intermediate_size": 384}  # aligned
MOE = {"hidden_size": 200, "moe_intermediate_size": 136}
DEEPSEEK = {"hidden_size": 160, "intermediate_size": 200, "moe_intermediate_size": 136}
GPT_OSS = {"hidden_size": 64, "intermediate_size": 96}  # gate_up: 2 groups of 32 in, down: 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's bf16 source ("<name>-bf16") and its quantized form ("<name>")."""
    root = tmp_path_factory.mktemp("quantized")
    out: dict[str, Path] = {}
    for name, family, sizes, options in (
        ("llama", "llama", LLAMA, {}),
        ("qwen3", "qwen3", QWEN3, {}),
        ("moe", "qwen3", MOE, {"moe": True}),
        ("deepseek", "deepseek_v3", DEEPSEEK, {"mtp": 1}),  # as released: an MTP layer, FP8 too
        ("gpt_oss", "gpt_oss", GPT_OSS, {}),
    ):
        out[name + "-bf16"] = sized(family, root / (name + "-bf16"), sizes, **options)
        out[name] = root / name
        if family == "gpt_oss":
            pack_mxfp4(out[name + "-bf16"], out[name])
        else:  # Qwen3 dense FP8 releases store bf16 scales
            quantize_fp8(out[name + "-bf16"], out[name], torch.bfloat16 if name == "qwen3" else torch.float32)
    return out


def torch_reader(src: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every block-FP8 weight of `src` as torch's QuantizedHuggingFaceStorageReader dequantizes it."""
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    state = {}
    for key in index:
        if key + fp8.SCALE_SUFFIX in index:
            with safe_open(src / index[key], "pt") as f:
                state[key] = torch.empty(f.get_slice(key).get_shape(), dtype=dtype)
    dcp.load(
        state, storage_reader=QuantizedHuggingFaceStorageReader(str(src), target_dtype=dtype), no_dist=True
    )
    return state


def mxfp4_reference(src: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every MXFP4 tensor of `src` as transformers' convert_moe_packed_tensors makes it: [E, in, out]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_dir(src)
    return {
        key.removesuffix("_blocks"): convert_moe_packed_tensors(
            value, stored[key[:-7] + "_scales"], dtype=dtype
        )
        for key, value in stored.items()
        if key.endswith("_blocks")
    }


def expected(name: str, models: dict[str, Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What hf-to-dcp writes for model `name` in `dtype`: the references' dequantized weights, and every other
    tensor of the source cast."""
    src = models[name]
    quantized = mxfp4_reference(src, dtype) if name == "gpt_oss" else torch_reader(src, dtype)
    stored = load_dir(src)
    parts = ("_scale_inv", "_blocks", "_scales")
    return {
        k: v.to(dtype) for k, v in stored.items() if k not in quantized and not k.endswith(parts)
    } | quantized


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    """The CLI in this process with --json: (exit code, the JSON it printed)."""
    try:
        main([*argv, "--json"])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return code, json.loads(captured.out)


def assert_same(got: dict[str, object], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key  # type: ignore[arg-type]


# -- the math and the reads -------------------------------------------------------------------------------


def test_mxfp4_decode_is_transformers_for_every_code_and_scale() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(256, 1, 1).view(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert same_bits(mxfp4.dequantize(blocks, scales, dtype).transpose(1, 2).contiguous(), want), dtype


def test_a_rank_reads_only_its_weight_rows_and_scale_rows(models: dict[str, Path]) -> None:
    hf = open_hf(models["llama"])
    t = hf.tensors["model.layers.0.mlp.gate_proj.weight"]  # [328, 200]: scale [3, 2], in another file
    assert t.quant is not None and t.quant.scale.file != t.file
    full = torch_reader(models["llama"], torch.bfloat16)[t.key]
    full32 = torch_reader(models["llama"], torch.float32)[t.key]
    for rank in range(2):
        lo, hi = shard_rows(328, 2, rank)
        s0, s1 = fp8.scale_rows(lo, hi)
        assert (s0, s1) == ((0, 2), (1, 3))[rank]
        for dtype, want in ((torch.bfloat16, full), (torch.float32, full32)):
            reader = RowReader()
            assert same_bits(reader.rows(t, lo, hi, dtype=dtype), want[lo:hi])
            assert reader.bytes_read == (hi - lo) * 200 + (s1 - s0) * 2 * 4  # fp8 rows, fp32 scale rows
            reader.close()
    reader = RowReader()
    g = torch.Generator().manual_seed(0)
    for _ in range(40):  # any block (a TP / FSDP shard on any dim) is the full dequantization's
        r0, c0 = (int(torch.randint(0, n, (), generator=g)) for n in (328, 200))
        nr, nc = (int(torch.randint(0, n - o + 1, (), generator=g)) for n, o in ((328, r0), (200, c0)))
        got = reader.block(t, (r0, c0), (nr, nc), dtype=torch.float32)
        assert same_bits(got, full32[r0 : r0 + nr, c0 : c0 + nc].contiguous())
    reader.close()


def test_mxfp4_reads_only_its_experts_and_any_block(models: dict[str, Path]) -> None:
    hf = open_hf(models["gpt_oss"])
    key = "model.layers.1.mlp.experts.down_proj"
    t = hf.tensors[key]  # [4, 96, 64]: blocks [4, 64, 3, 16], scales [4, 64, 3]
    assert t.shape == (4, 96, 64) and t.quant is not None and t.dtype == torch.bfloat16
    full = mxfp4_reference(models["gpt_oss"], torch.float32)[key]
    reader = RowReader()
    assert same_bits(reader.rows(t, 1, 3, dtype=torch.float32), full[1:3])
    assert reader.bytes_read == 2 * 64 * 3 * 16 + 2 * 64 * 3
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        offsets = [int(torch.randint(0, n, (), generator=g)) for n in t.shape]
        sizes = [
            int(torch.randint(0, n - o + 1, (), generator=g)) for n, o in zip(t.shape, offsets, strict=True)
        ]
        got = reader.block(t, offsets, sizes, dtype=torch.float32)
        want = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert same_bits(got, want.contiguous())
    reader.close()


# -- hf-to-dcp ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen3", "moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_hf_to_dcp_writes_the_reference_dequantization(
    models: dict[str, Path], name: str, dtype: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dcp"
    code, err = run(capsys, "hf-to-dcp", str(models[name]), str(out), *(("--dtype", dtype) if dtype else ()))
    assert code == 0, err
    assert_same(load_plain(out), expected(name, models, torch.float32 if dtype else torch.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_two_ranks_write_what_one_rank_writes(models: dict[str, Path], name: str, tmp_path: Path) -> None:
    """Each rank dequantizes only its Shard(0) rows (llama: rows 164.. start inside a 128-row block)."""
    out = tmp_path / "dcp2"
    proc = ckptconv("hf-to-dcp", str(models[name]), str(out), nproc=2)
    assert proc.returncode == 0, proc.stderr
    assert_same(load_plain(out), expected(name, models, torch.bfloat16))


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_torchtitan_mappings_read_the_dequantized_weights(
    models: dict[str, Path], dtype: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The official FP8 DeepSeek-V3 layout -> a bf16 torchtitan DCP equal to the mapping applied to torch's
    reader's dequantized weights; gpt-oss's MXFP4 experts -> torchtitan's [E, 2F, D] (a transpose of
    transformers' [E, D, 2F] bf16 layout, which the logical tensor has). verify (HF vs HF, and the quantized
    source against the mapped DCP) matches. In fp32 the stacked experts (composed, not renamed) hold the fp32
    product too."""
    torch_dtype = torch.float32 if dtype else torch.bfloat16
    flags = ("--dtype", dtype) if dtype else ()
    for name, mapping in (("deepseek", "torchtitan-deepseek-v3"), ("gpt_oss", "torchtitan-gpt-oss")):
        plain = tmp_path / f"{name}-dequantized"  # the references' values, as a plain HF checkpoint
        plain.mkdir()
        save_file(expected(name, models, torch_dtype), plain / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((models[name] / "config.json").read_text())
        del config["quantization_config"]
        (plain / "config.json").write_text(json.dumps(config))
        outs = {}
        for label, src in (("quantized", models[name]), ("plain", plain)):
            outs[label] = tmp_path / f"{name}-{label}-dcp"
            code, err = run(capsys, "hf-to-dcp", str(src), str(outs[label]), "--mapping", mapping, *flags)
            assert code == 0, err
            assert ("their scales are not written" in err) == (label == "quantized"), err
            kept = json.loads((outs[label] / "config.json").read_text())  # beside .metadata, for the way back
            assert "quantization_config" not in kept and kept["hidden_size"] == config["hidden_size"]
        want = load_plain(outs["plain"])
        assert_same(load_plain(outs["quantized"]), want)  # type: ignore[arg-type]
        for a, b, extra in (
            (models[name], plain, ()),
            (models[name], outs["quantized"], ("--mapping", mapping)),
        ):
            code, err = run(capsys, "verify", str(a), str(b), *extra)
            assert code == 0, err
    experts = "layers.1.moe.routed_experts.inner_experts.mlp1_weight_EGD"
    gate_up = mxfp4_reference(models["gpt_oss"], torch_dtype)["model.layers.1.mlp.experts.gate_up_proj"]
    got = load_plain(tmp_path / "gpt_oss-quantized-dcp")[experts]
    assert same_bits(got, gate_up.transpose(1, 2).contiguous())  # type: ignore[arg-type]


def test_verify_compares_in_the_other_sides_dtype(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An fp32 DCP of a block-FP8 source holds the fp32 product: verify reads the source in fp32 too (either
    order), and hf-to-dcp --verify checks it the same way."""
    out = tmp_path / "dcp32"
    code, err = run(capsys, "hf-to-dcp", str(models["llama"]), str(out), "--dtype", "fp32", "--verify")
    assert code == 0, err
    for a, b in ((models["llama"], out), (out, models["llama"])):
        code, doc = run_json(capsys, "verify", str(a), str(b))
        assert code == 0 and doc["match"] and doc["compared"] == 21, doc
        assert len(doc["notes"]) == 1 and "14 quantized weights compared" in doc["notes"][0], doc


# -- inspect, load_hf ----------------------------------------------------------------------------------------


def test_inspect_shows_one_logical_tensor_per_quantized_weight(
    models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_json(capsys, "inspect", str(models["llama"]))
    assert code == 0 and doc["num_tensors"] == 21  # the 14 scales are not tensors of their own
    by_key = {t["key"]: t for t in doc["tensors"]}
    gate = by_key["model.layers.0.mlp.gate_proj.weight"]
    assert gate["dtype"] == "float8_e4m3fn" and gate["shape"] == [328, 200]
    assert gate["nbytes"] == 328 * 200 + 3 * 2 * 4 and gate["file"] == "model-00001-of-00002.safetensors"
    assert gate["quantized"] == {
        "scheme": "fp8",
        "block_size": [128, 128],
        "scale_key": "model.layers.0.mlp.gate_proj.weight_scale_inv",
        "scale_dtype": "float32",
        "scale_file": "model-00002-of-00002.safetensors",
        "dequantized_dtype": "bfloat16",
        "values_key": "model.layers.0.mlp.gate_proj.weight",
    }
    assert "quantized" not in by_key["model.embed_tokens.weight"]
    code, doc = run_json(capsys, "inspect", str(models["gpt_oss"]))
    experts = {t["key"]: t for t in doc["tensors"]}["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts["dtype"] == "mxfp4" and experts["shape"] == [4, 64, 192]
    assert experts["quantized"]["blocks_key"].endswith("gate_up_proj_blocks")
    assert not any(t["key"].endswith(("_blocks", "_scales")) for t in doc["tensors"])
    main(["inspect", str(models["llama"])])
    text = capsys.readouterr().out
    assert "float8_e4m3fn [fp8 128x128 -> bfloat16]" in text and "quantized: 14 block-FP8 weights" in text
    _, plan = run_json(capsys, "hf-to-dcp", str(models["llama"]), "unused", "--dry-run")
    sources = {t["key"]: t["source_dtype"] for t in plan["tensors"]}
    assert sources["model.layers.0.mlp.gate_proj.weight"] == "float8_e4m3fn"
    assert sources["model.norm.weight"] == "bfloat16"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_load_hf_into_a_plain_model(models: dict[str, Path], dtype: torch.dtype) -> None:
    """A bf16 model gets the bf16 dequantization, an fp32 one the fp32 product (not a bf16-rounded value)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import ckptconv as lib

    for name in ("llama", "gpt_oss"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models[name + "-bf16"])).to(dtype)
        state = model.state_dict()
        report = lib.load_hf(state, models[name])
        assert not report.missing and not report.unexpected and not report.replaced
        assert_same(dict(state), expected(name, models, dtype))


@pytest.mark.slow
def test_load_hf_into_an_fsdp2_model(models: dict[str, Path], tmp_path: Path) -> None:
    """Each of 2 ranks reads its Shard(0) rows (rank 1's start at row 164 of gate_proj, inside a block) into
    an fp32 model: the fp32 product, bit for bit."""
    ref = tmp_path / "ref.pt"
    torch.save(expected("llama", models, torch.float32), ref)
    proc = torchrun(
        2,
        str(WORKERS / "load_hf_quantized.py"),
        str(models["llama-bf16"]),
        str(models["llama"]),
        str(ref),
        "float32",
    )
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["loaded"] == 21 and not doc["missing"] and not doc["unexpected"] and not doc["replaced"], doc
    assert doc["differ"] == [], doc


# -- bad inputs, the config and the note -------------------------------------------------------------------


def _write(directory: Path, tensors: dict[str, torch.Tensor], method: str | None = None) -> Path:
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config: dict[str, object] = {"dtype": "bfloat16"}
    if method:
        config["quantization_config"] = {"quant_method": method}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _fp8(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols).to(fp8.FP8)


BAD = {
    "scale shape": (
        {"a.weight": _fp8(200, 300), "a.weight_scale_inv": torch.ones(2, 2)},
        None,
        ("'a.weight_scale_inv'", "[2, 2]", "needs [2, 3]"),
    ),
    "scale without its weight": (
        {"b.weight_scale_inv": torch.ones(1, 1), "c": torch.ones(2)},
        "fp8",
        ("'b.weight_scale_inv'", "has no weight 'b.weight'"),
    ),
    "fp8 weight without scale": (
        {"a.weight": _fp8(4, 4), "a.weight_scale_inv": torch.ones(1, 1), "d.weight": _fp8(4, 4)},
        None,
        ("'d.weight'", "no 'd.weight_scale_inv'"),
    ),
    "fp8 checkpoint, no scale at all": ({"d.weight": _fp8(4, 4)}, "fp8", ("'d.weight'", "block-FP8")),
    "scale of a bf16 weight": (
        {"a.weight": torch.ones(4, 4, dtype=torch.bfloat16), "a.weight_scale_inv": torch.ones(1, 1)},
        None,
        ("'a.weight'", "not FP8"),
    ),
    "3-D fp8 experts": (
        {"e.gate_up_proj": torch.zeros(2, 4, 4).to(fp8.FP8), "e.gate_up_proj_scale_inv": torch.ones(2, 1, 1)},
        None,
        ("'e.gate_up_proj'", "2-D only"),
    ),
    "mxfp4 scales shape": (
        {
            "x_blocks": torch.zeros(2, 6, 2, 16, dtype=torch.uint8),
            "x_scales": torch.zeros(2, 6, 3, dtype=torch.uint8),
        },
        "mxfp4",
        ("'x_scales'", "[2, 6, 3]", "need [2, 6, 2]"),
    ),
    "mxfp4 blocks without scales": (
        {"x_blocks": torch.zeros(2, 6, 2, 16, dtype=torch.uint8)},
        "mxfp4",
        ("'x_blocks'", "no scales 'x_scales'"),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_quantized_source_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors, method, needles = BAD[case]
    src = _write(tmp_path / "src", tensors, method)
    for command in (("inspect",), ("hf-to-dcp", str(tmp_path / "out")), ("verify", str(src))):
        code, err = run(capsys, command[0], str(src), *command[1:])
        assert_one_line(code, err, "model.safetensors", *needles)
    assert not (tmp_path / "out").exists()


def test_plain_fp8_tensors_without_scales_are_not_quantized(tmp_path: Path) -> None:
    """A checkpoint that merely holds fp8 tensors (no scale anywhere, no fp8 quantization_config) is read as
    it is stored, as before."""
    src = _write(
        tmp_path / "src", {"d.weight": _fp8(4, 4), "d_blocks": torch.zeros(1, 1, 1, 3, dtype=torch.uint8)}
    )
    hf = open_hf(src)
    assert [t.quant for t in hf.tensors.values()] == [None, None]
    assert hf.tensors["d.weight"].dtype == fp8.FP8
    reader = RowReader()
    assert same_bits(
        reader.rows(hf.tensors["d.weight"], 0, 4), load_file(src / "model.safetensors")["d.weight"]
    )
    reader.close()


def test_the_kept_config_drops_the_quantization_config() -> None:
    from ckptconv.plan.config import dequantized_config

    raw = json.dumps({"dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}, "a": 1}).encode()
    assert json.loads(dequantized_config(raw)) == {"a": 1, "dtype": "bfloat16"}
    for unchanged in (b'{"quantization_config": {"quant_method": "awq"}}', b'{"a": 1}', b"[1]", b"not json"):
        assert dequantized_config(unchanged) == unchanged


def test_hf_to_dcp_says_what_it_dequantized(models: dict[str, Path]) -> None:
    """The one note hf-to-dcp prints (`compose.dequantized_note`, called by convert.py)."""
    from ckptconv.core.dtypes import DtypePolicy
    from ckptconv.plan.to_hf import plan_hf_to_dcp
    from ckptconv.stream.compose import dequantized_note

    for name, policy, note in (
        (
            "llama",
            DtypePolicy(None),
            "dequantized 14 block-FP8 weights (128x128 blocks, *_scale_inv) to bfloat16",
        ),
        (
            "gpt_oss",
            DtypePolicy(torch.float32),
            "dequantized 4 MXFP4 expert tensors (*_blocks, *_scales) to float32",
        ),
    ):
        plan = plan_hf_to_dcp(open_hf(models[name]), policy, world_size=1)
        line = dequantized_note(plan.tensors)
        assert line is not None and line.startswith(note) and line.endswith("their scales are not written")
    assert (
        dequantized_note(
            plan_hf_to_dcp(open_hf(models["llama-bf16"]), DtypePolicy(None), world_size=1).tensors
        )
        is None
    )
