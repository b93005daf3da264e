"""compressed-tensors releases (quant_method "compressed-tensors") read dequantized, bit for bit what
compressed-tensors 0.20.0 itself decompresses.

Each release is made by compressed-tensors' own code (support/ct.py `release`: its presets, its
calculate_qparams, its ModelCompressor) from a tiny transformers llama (families.sized):

    fp8    FP8_DYNAMIC (channel) on gate/up, FP8 (tensor, a static input_scale) on "re:.*self_attn.*",
           FP8_DYNAMIC with strategy group (4 columns a scale) on down_proj (hidden 200, intermediate 332)
    fp8b   FP8_BLOCK 128x128 on Linear, no dim a multiple of 128; every scale in the second shard
    int    W4A16 (group 128) on attention, W4A16_ASYM with group 32 on the MLP; scales in the second shard
    intc   W4A16_ASYM per channel on a model whose down_proj has 332 columns (41.5 int32 words a row)
    mixed  one release of all four formats: FP8_BLOCK q/k/v, W4A16 o_proj, NVFP4 gate/up, MXFP4 down

The oracle is compressed-tensors' decompress (support/ct.py `oracle`, which is its
CompressedTensorsDequantizer where that runs: tested) followed by `.to(dtype)`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ckptconv
from ct import expected, oracle, release, scheme
from families import sized
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import same_bits
from test_hf_to_dcp import load_plain
from test_quantized_sources import run_json

from ckptconv.core.layout import shard_rows
from ckptconv.formats.hf import open_hf
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.plan.config import dequantized_config
from ckptconv.quant import ct

ODD = {"hidden_size": 200, "intermediate_size": 332, "num_hidden_layers": 1}  # q_proj [32, 200]
EVEN = {"hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 1, "head_dim": 32}


def _second(*parts: str) -> Callable[[str], int]:
    """A shard split: keys ending in one of `parts` in the second file."""
    return lambda key: int(key.endswith(parts))


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    odd, even = sized("llama", root / "odd", ODD), sized("llama", root / "even", EVEN)
    return {
        "fp8": release(
            odd,
            root / "fp8",
            {
                "g0": scheme("FP8_DYNAMIC", ["re:.*mlp.(gate|up)_proj$"]),
                "g1": scheme("FP8", ["re:.*self_attn.*"]),
                "g2": scheme("FP8_DYNAMIC", ["re:.*down_proj$"], strategy="group", group_size=4),
            },
        ),
        "fp8b": release(odd, root / "fp8b", {"g0": scheme("FP8_BLOCK", ["Linear"])}, split=_second("_scale")),
        "int": release(
            even,
            root / "int",
            {
                "g0": scheme("W4A16", ["re:.*self_attn.*"]),
                "g1": scheme("W4A16_ASYM", ["re:.*mlp.*"], group_size=32),
            },
            split=_second("weight_scale"),
        ),
        "intc": release(
            odd, root / "intc", {"g0": scheme("W4A16_ASYM", ["Linear"], strategy="channel", group_size=None)}
        ),
        "mixed": release(
            even,
            root / "mixed",
            {
                "g0": scheme("FP8_BLOCK", ["re:.*(q|k|v)_proj$"]),
                "g1": scheme("W4A16", ["re:.*o_proj$"], group_size=32),
                "g2": scheme("NVFP4", ["re:.*(gate|up)_proj$"]),
                "g3": scheme("MXFP4", ["re:.*down_proj$"]),
            },
        ),
    }


# -- the math -----------------------------------------------------------------------------------------------


def test_the_decoding_is_compressed_tensors_for_every_code() -> None:
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(0)
    for bits in range(1, 9):
        for cols in (1, 7, 33, 164):
            v = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (3, cols), generator=g).to(torch.int8)
            packed = pack_to_int32(v, bits)
            want = unpack_from_int32(packed, bits, torch.Size((3, cols)))
            assert torch.equal(ct.unpack_int(packed, bits, cols), want), (bits, cols)
    every = torch.arange(256, dtype=torch.uint8).view(4, 64)
    assert same_bits(ct.fp4_values(every), unpack_fp4_from_uint8(every, 4, 128))
    assert same_bits(ct.mx_scales(every), decompress_mx_scale(every).to(torch.bfloat16))


def test_a_module_is_in_the_group_compressed_tensors_gives_it() -> None:
    """Overlapping targets: exact names, then regexes, then "Linear", a target's later group winning, as
    apply_quantization_config (match_targets, _scheme_from_targets) assigns schemes."""
    from collections import OrderedDict

    from compressed_tensors.utils.match import match_targets

    from ckptconv.formats.quant_ct_config import group_of, parse

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    groups = {
        "g0": ["Linear"],
        "g1": ["re:.*proj$", "model.b.q_proj"],
        "g2": ["model.a.q_proj", "re:.*q_proj$"],
        "g3": ["re:.*mlp.*", "re:.*proj$"],
    }
    qc = {"config_groups": {g: {"targets": t, "weights": weights} for g, t in groups.items()}}
    parsed = parse(qc, "config.json")
    by_target: OrderedDict[str, str] = OrderedDict()
    for g, targets in groups.items():
        for target in targets:
            by_target[target] = g
    linear = torch.nn.Linear(1, 1)
    for module in ("model.a.q_proj", "model.b.q_proj", "model.c.q_proj", "model.mlp.down_proj", "lm_head"):
        want = by_target[match_targets(module, linear, by_target)[0]]
        got = group_of(parsed, module)
        assert got is not None and got.name == want, module


def test_the_oracle_is_compressed_tensors_dequantizer(releases: dict[str, Path]) -> None:
    """support/ct.py's oracle is CompressedTensorsDequantizer.process wherever that runs (not on fp8b: with
    the target "Linear" it takes embed_tokens for a quantized module and fails on its missing scale)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    for name in ("fp8", "int", "intc", "mixed"):
        stored: dict[str, torch.Tensor] = {}
        for f in releases[name].glob("*.safetensors"):
            stored |= load_file(f)
        theirs = CompressedTensorsDequantizer(str(releases[name]), dtype=torch.float32).process(stored)
        ours = oracle(releases[name], torch.float32)
        assert ours and all(same_bits(theirs[k], v) for k, v in ours.items()), name


# -- hf-to-dcp, reads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "fp8b", "int", "intc", "mixed"])
@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_hf_to_dcp_writes_compressed_tensors_dequantization(
    releases: dict[str, Path],
    name: str,
    dtype: str | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "dcp"
    code, err = run(
        capsys, "hf-to-dcp", str(releases[name]), str(out), *(("--dtype", dtype) if dtype else ())
    )
    assert code == 0, err
    got = load_plain(out)
    want = expected(releases[name], torch.float32 if dtype else torch.bfloat16)
    if name == "fp8":  # one group of each strategy
        grids = {k: t.quant.arg("grid") for k, t in open_hf(releases[name]).tensors.items() if t.quant}
        assert grids["model.layers.0.mlp.down_proj.weight"] == (1, 4)
        assert grids["model.layers.0.mlp.up_proj.weight"] == (1, 200)
        assert grids["model.layers.0.self_attn.o_proj.weight"] == (200, 32)
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key  # type: ignore[arg-type]


def test_a_rank_reads_only_its_rows_of_each_part(releases: dict[str, Path]) -> None:
    """Rows [lo, hi) of each scheme's weight read only those rows of its values, scales and zero points (the
    row-packed zero points: their 32-row groups); any block equals the whole dequantization's."""
    hf = open_hf(releases["mixed"])
    full = oracle(releases["mixed"], torch.float32)
    reader = RowReader()
    for proj, row_bytes in (
        ("self_attn.q_proj", 256 + 2 * 4),  # fp8 row + bf16 block scale row is shared: see below
        ("self_attn.o_proj", 128 // 8 * 4 + 128 // 32 * 2),  # int4 words + bf16 group scales
        ("mlp.gate_proj", 256 // 2 + 256 // 16),  # FP4 bytes + fp8 scales (+ the 4-byte global scale)
        ("mlp.down_proj", 384 // 2 + 384 // 32),  # FP4 bytes + E8M0 scales
    ):
        t = hf.tensors[f"model.layers.0.{proj}.weight"]
        assert t.quant is not None and t.quant.scheme.startswith("ct-")
        rows = t.shape[0]
        lo, hi = shard_rows(rows, 2, 1)
        before = reader.bytes_read
        assert same_bits(reader.rows(t, lo, hi, dtype=torch.float32), full[t.key][lo:hi])
        read = reader.bytes_read - before
        if t.quant.scheme == "ct-fp8":
            assert read == (hi - lo) * 256 + 1 * 2 * 2  # one 128-row block of scales, 2 columns of bf16
        else:
            assert read == (hi - lo) * row_bytes + (4 if t.quant.scheme == "ct-nvfp4" else 0), proj
    g = torch.Generator().manual_seed(0)
    for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        t = hf.tensors[key]
        for _ in range(20):
            r0, c0 = (int(torch.randint(0, n, (), generator=g)) for n in t.shape)
            nr, nc = (
                int(torch.randint(1, n - o + 1, (), generator=g))
                for n, o in zip(t.shape, (r0, c0), strict=True)
            )
            got = reader.block(t, (r0, c0), (nr, nc), dtype=torch.float32)
            assert same_bits(got, full[key][r0 : r0 + nr, c0 : c0 + nc].contiguous()), (key, r0, c0, nr, nc)
    asym = open_hf(releases["int"]).tensors[
        "model.layers.0.mlp.down_proj.weight"
    ]  # zero points packed by rows
    want = oracle(releases["int"], torch.float32)[asym.key]
    for lo, hi in ((0, 1), (31, 33), (100, 256), (224, 256)):
        assert same_bits(reader.rows(asym, lo, hi, dtype=torch.float32), want[lo:hi])
    reader.close()


@pytest.mark.slow
def test_two_ranks_write_what_one_rank_writes(releases: dict[str, Path], tmp_path: Path) -> None:
    """All four schemes in one release: each rank dequantizes only its Shard(0) rows."""
    outs = []
    for nproc in (1, 2):
        outs.append(tmp_path / f"dcp{nproc}")
        proc = ckptconv("hf-to-dcp", str(releases["mixed"]), str(outs[-1]), nproc=nproc)
        assert proc.returncode == 0, proc.stderr
    one, two = load_plain(outs[0]), load_plain(outs[1])
    assert set(one) == set(two)
    assert all(same_bits(two[k], v) for k, v in one.items())  # type: ignore[arg-type]
    want = expected(releases["mixed"], torch.bfloat16)
    assert all(same_bits(two[k], v) for k, v in want.items())  # type: ignore[arg-type]


def test_inspect_verify_and_load_hf(
    releases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect --json: each quantized module one logical tensor, its parts not tensors of their own; verify
    compares the dequantized weights; load_hf loads them; the config kept drops the quantization_config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import ckptconv as lib

    src = releases["mixed"]
    code, out = run_json(capsys, "inspect", str(src))
    by_key = {t["key"]: t for t in out["tensors"]}
    assert not any(k.rpartition(".")[2].startswith(("weight_", "input_")) for k in by_key), sorted(by_key)
    down = by_key["model.layers.0.mlp.down_proj.weight"]
    assert down["dtype"] == "mxfp4" and down["shape"] == [256, 384]
    assert down["quantized"]["scheme"] == "ct-mxfp4" and down["quantized"]["block_size"] == 32
    gate = by_key["model.layers.0.mlp.gate_proj.weight"]["quantized"]
    assert gate["scheme"] == "ct-nvfp4" and gate["other_keys"] == [
        "model.layers.0.mlp.gate_proj.weight_global_scale"
    ]
    o_proj = by_key["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj["dtype"] == "int4" and o_proj["shape"] == [256, 128]
    assert by_key["model.layers.0.self_attn.q_proj.weight"]["quantized"]["block_size"] == [128, 128]
    dcp_out = tmp_path / "dcp"
    code, err = run(capsys, "hf-to-dcp", str(src), str(dcp_out), "--dtype", "fp32", "--verify")
    assert code == 0, err
    code, err = run(capsys, "verify", str(src), str(dcp_out))
    assert code == 0, err
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).to(torch.bfloat16)
    state = model.state_dict()
    report = lib.load_hf(state, src)
    assert not report.missing and not report.unexpected and not report.replaced
    want = expected(src, torch.bfloat16)
    assert all(same_bits(state[k], v) for k, v in want.items())
    assert "quantization_config" not in json.loads(dequantized_config((src / "config.json").read_bytes()))


def _global_format(qc: dict[str, Any]) -> None:
    """Older releases: no format per group, the global one "mixed-precision" (each group's inferred)."""
    for group in qc["config_groups"].values():
        group.pop("format")
    qc["format"] = "mixed-precision"


def _kv_cache(t: dict[str, torch.Tensor]) -> None:
    """An FP8 KV cache's scales, as vLLM's releases store them beside the attention's weights."""
    if "model.layers.0.self_attn.o_proj.weight_packed" in t:
        t["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
        t["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)


def test_formats_inferred_and_kv_cache_scales_dropped(
    releases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without per-group formats each group's is inferred from its weights, as compressed-tensors infers it;
    KV-cache scales (kv_cache_scheme) are not weights: hf-to-dcp leaves them out."""
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

    def config(qc: dict[str, Any]) -> None:
        _global_format(qc)
        qc["kv_cache_scheme"] = kv

    src = _edited(releases["mixed"], tmp_path / "src", _kv_cache, config)
    code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert code == 0, err
    got, want = load_plain(tmp_path / "out"), expected(releases["mixed"], torch.bfloat16)
    assert set(got) == set(want), set(got) ^ set(want)
    assert all(same_bits(got[k], v) for k, v in want.items())  # type: ignore[arg-type]


# -- refusals -----------------------------------------------------------------------------------------------


def _edited(
    src: Path,
    dst: Path,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
    config: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A copy of release `src` with its tensors (every file, rewritten in place) or its quantization_config
    changed."""
    shutil.copytree(src, dst)
    if tensors is not None:
        index_path = dst / "model.safetensors.index.json"
        index = json.loads(index_path.read_text()) if index_path.exists() else None
        for f in sorted(dst.glob("*.safetensors")):
            stored = load_file(f)
            tensors(stored)
            save_file(stored, f, metadata={"format": "pt"})
            if index is not None:
                index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != f.name}
                index["weight_map"] |= {k: f.name for k in stored}
        if index is not None:
            index_path.write_text(json.dumps(index))
    if config is not None:
        doc = json.loads((dst / "config.json").read_text())
        config(doc["quantization_config"])
        (dst / "config.json").write_text(json.dumps(doc))
    return dst


O_PROJ = "model.layers.0.self_attn.o_proj"
DOWN = "model.layers.0.mlp.down_proj"
GATE = "model.layers.0.mlp.gate_proj"


def _pop(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """Removes `key` from the file that holds it."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        t.pop(key, None)

    return edit


def _put(key: str, value: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Callable[..., None]:
    """Sets `key` in the file holding its module's weight_packed (where it is, if it is already stored)."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        if key in t or key.rpartition(".")[0] + ".weight_packed" in t:
            t[key] = value(t)

    return edit


def _group(name: str, **changes: Any) -> Callable[[dict[str, Any]], None]:
    """Sets a config_groups entry's format / targets, or its weights' other args."""

    def edit(qc: dict[str, Any]) -> None:
        group = qc["config_groups"][name]
        for k, v in changes.items():
            (group if k in ("format", "targets") else group["weights"])[k] = v

    return edit


BAD: dict[str, tuple[Any, Any, tuple[str, ...]]] = {
    "unknown format": (
        None,
        _group("group_3", format="mxfp6-pack-quantized"),
        ("'mxfp6-pack-quantized'", "'group_3'"),
    ),
    "unknown strategy": (
        None,
        _group("group_1", strategy="attn_head"),
        ("'attn_head'", "'group_1'", "ct-int"),
    ),
    "actorder group": (
        None,
        _group("group_1", actorder="group"),
        ("actorder 'group'", "weight_g_idx", "'group_1'"),
    ),
    "scale shape": (
        _put(O_PROJ + ".weight_scale", lambda t: t[O_PROJ + ".weight_scale"][:, :3].contiguous()),
        None,
        (f"'{O_PROJ}.weight_scale'", "[256, 3]", "needs [256, 4]"),
    ),
    "missing global scale": (
        _pop(GATE + ".weight_global_scale"),
        None,
        (f"'{GATE}.weight_packed'", f"no '{GATE}.weight_global_scale'"),
    ),
    "scale dtype": (
        _put(DOWN + ".weight_scale", lambda t: t[DOWN + ".weight_scale"].float()),
        None,
        (f"'{DOWN}.weight_scale'", "float32, not uint8"),
    ),
    "g_idx": (
        _put(O_PROJ + ".weight_g_idx", lambda t: torch.arange(128, dtype=torch.int32) // 32),
        None,
        (f"'{O_PROJ}.weight_g_idx'", "actorder"),
    ),
    "weight_shape disagrees": (
        _put(O_PROJ + ".weight_shape", lambda t: torch.tensor([256, 64]).to(t[O_PROJ + ".weight_shape"].dtype)),  # noqa: E501
        None,
        (f"'{O_PROJ}.weight_shape' says [256, 64]",),
    ),
    "quantization_config emptied": (None, lambda qc: qc.clear(), ("no quant_method",)),
    "ignored yet quantized": (None, lambda qc: qc["ignore"].append("re:.*down_proj$"), (DOWN, "ignore")),
    "targeted by no group": (
        None,
        _group("group_3", targets=["Embedding"]),
        (DOWN, "no config_groups target"),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_release_is_one_line(
    case: str, releases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors, config, needles = BAD[case]
    src = _edited(releases["mixed"], tmp_path / "src", tensors, config)
    code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert_one_line(code, err, "model.safetensors", *needles)
    assert not (tmp_path / "out").exists()


def test_gptq_is_refused_naming_a_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """AutoGPTQ's layout (qweight / qzeros int32, scales fp16, g_idx) under quant_method "gptq"."""
    src = tmp_path / "gptq"
    src.mkdir()
    layer = "model.layers.0.mlp.down_proj."
    tensors = {
        layer + "qweight": torch.zeros(16, 64, dtype=torch.int32),
        layer + "qzeros": torch.zeros(1, 8, dtype=torch.int32),
        layer + "scales": torch.ones(1, 64, dtype=torch.float16),
        layer + "g_idx": torch.zeros(128, dtype=torch.int32),
        "model.norm.weight": torch.ones(64, dtype=torch.float16),
    }
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = {
        "dtype": "float16",
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    }
    (src / "config.json").write_text(json.dumps(config))
    for command in (("inspect",), ("hf-to-dcp", str(tmp_path / "out"))):
        code, err = run(capsys, command[0], str(src), *command[1:])
        assert_one_line(code, err, "model.safetensors", f"'{layer}", "quant_method 'gptq'")
    assert not (tmp_path / "out").exists()


def test_unpacking_one_word_rows_of_a_transposed_block() -> None:
    """A slab inside the last, partial group of an asymmetric weight reads zero points of one int32 word a
    row, from a transposed block: [n, 1] with stride (1, n), which torch's byte view refused (a traceback).
    The values are compressed-tensors' unpack of the same words (given a fresh contiguous copy, as its own
    unpack refuses that stride too)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from ckptconv.quant.ct import unpack_int

    for bits in (2, 4, 8):
        words = torch.randint(-(2**31), 2**31 - 1, (1, 5), dtype=torch.int32).t().contiguous()
        assert words.stride() == (1, 5)
        count = 32 // bits
        ours = unpack_int(words, bits, count)
        fresh = torch.tensor(words.tolist(), dtype=torch.int32)
        theirs = unpack_from_int32(fresh, bits, torch.Size([5, count]))
        assert torch.equal(ours.to(theirs.dtype), theirs), bits
