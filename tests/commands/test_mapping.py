"""Key mapping: the rule engine as tables, and both converters through a mapping on sharded checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain

from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import open_dcp
from ckptconv.mapping import load_mapping
from ckptconv.mapping.rules import inverse, map_keys, rope_perm

MAPPING = """
[mapping]
name = "test"
hf_experts = "per_expert"

[[rule]]
runtime = "tok_embeddings.weight"
hf = "model.embed_tokens.weight"

[[rule]]
runtime = "layers.{layer}.attention.wq.weight"
hf = "model.layers.{layer}.self_attn.q_proj.weight"
permute = "q"

[[rule]]
runtime = "layers.{layer}.attention.wk.weight"
hf = "model.layers.{layer}.self_attn.k_proj.weight"
permute = "k"

[[rule]]
runtime = "layers.{layer}.feed_forward.w13.weight"
hf = ["model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"]
dim = 0
sizes = ["intermediate_size", "intermediate_size"]

[[rule]]
runtime = "layers.{layer}.moe.experts.w1"
hf = "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight"
stack = "expert"
when = "per_expert"

[[rule]]
runtime = "layers.{layer}.moe.experts.w2"
hf = "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
stack = "expert"
when = "per_expert"

[[rule]]
runtime = ["layers.{layer}.moe.experts.w1", "layers.{layer}.moe.experts.w3"]
hf = "model.layers.{layer}.mlp.experts.gate_up_proj"
dim = 1
when = "fused"

[[rule]]
runtime = "layers.{layer}.moe.experts.w3"
hf = "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"
stack = "expert"
when = "per_expert"

[[rule]]
runtime = "layers.{layer}.moe.experts.w2"
hf = "model.layers.{layer}.mlp.experts.down_proj"
when = "fused"

[[rule]]
runtime = "layers.{layer}.attention_norm.weight"
hf = "model.layers.{layer}.input_layernorm.weight"

[[rule]]
runtime = "freqs_cis"
drop = true

[[rule]]
runtime = "output.weight"
hf = "lm_head.weight"
tied = "model.embed_tokens.weight"
"""
CONFIG = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 6,
    "tie_word_embeddings": False,
}
E, F, D = 4, 6, 8
SPEC = {
    "tok_embeddings.weight": [[10, D], "float32", "shard0"],
    "layers.0.attention.wq.weight": [[D, D], "float32", "shard0"],
    "layers.0.attention.wk.weight": [[4, D], "float32", "shard1"],
    "layers.0.feed_forward.w13.weight": [[2 * F, D], "float32", "shard0"],
    "layers.1.moe.experts.w1": [[E, F, D], "bfloat16", "shard0"],
    "layers.1.moe.experts.w3": [[E, F, D], "bfloat16", "shard1"],
    "layers.1.moe.experts.w2": [[E, D, F], "bfloat16", "shard1"],
    "layers.0.attention_norm.weight": [[D], "float32", "replicate"],
    "freqs_cis": [[3, 2], "float32", "replicate"],
    "output.weight": [[10, D], "float32", "shard0"],
}


def titan_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's Llama `_permute`, to HF: view(heads, rows // heads // 2, 2, cols).transpose(1, 2)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def expected_hf(full: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": full["tok_embeddings.weight"],
        "model.layers.0.self_attn.q_proj.weight": titan_permute(full["layers.0.attention.wq.weight"], 4),
        "model.layers.0.self_attn.k_proj.weight": titan_permute(full["layers.0.attention.wk.weight"], 2),
        "model.layers.0.mlp.gate_proj.weight": full["layers.0.feed_forward.w13.weight"][:F],
        "model.layers.0.mlp.up_proj.weight": full["layers.0.feed_forward.w13.weight"][F:],
        "model.layers.0.input_layernorm.weight": full["layers.0.attention_norm.weight"],
        "lm_head.weight": full["output.weight"],
    }
    w1, w2, w3 = (full[f"layers.1.moe.experts.w{i}"] for i in (1, 2, 3))
    if fused:
        out["model.layers.1.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out["model.layers.1.mlp.experts.down_proj"] = w2
    else:
        for e in range(E):
            out[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = w1[e]
            out[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = w3[e]
            out[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = w2[e]
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def runtime_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("runtime")
    (root / "spec.json").write_text(json.dumps(SPEC))
    (root / "map.toml").write_text(MAPPING)
    (root / "config.json").write_text(json.dumps(CONFIG))
    torchrun(2, str(WORKERS / "save_runtime.py"), str(root / "ckpt"), str(root / "spec.json"))
    return root / "ckpt", root / "map.toml", root / "config.json"


def full_runtime() -> dict[str, torch.Tensor]:
    import sys

    sys.path.insert(0, str(WORKERS))
    from save_runtime import full_tensors

    return full_tensors(SPEC)


@pytest.mark.parametrize("form", ["per_expert", "fused"])
def test_mapping_both_directions_bit_exact(runtime_ckpt, tmp_path: Path, form: str) -> None:
    ckpt, mapping, config = runtime_ckpt
    full = full_runtime()
    flags = ["--mapping", str(mapping), "--config", str(config), "--dtype", "keep", "--hf-experts", form]
    shas = []
    for nproc, read in [(0, "direct"), (2, "direct"), (3, "gather")]:
        out = tmp_path / f"hf-{nproc}"
        proc = ckptconv(
            "dcp-to-hf", str(ckpt), str(out), *flags, "--max-shard-size", "900", "--read", read, nproc=nproc
        )
        assert proc.returncode == 0, proc.stderr
        shas.append(tree_sha256(out))
    assert shas[0] == shas[1] == shas[2]
    got, want = load_dir(tmp_path / "hf-0"), expected_hf(full, form == "fused")
    assert set(got) == set(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key
    # back to runtime names and layouts, at 2 ranks: the original tensors exactly (freqs_cis was dropped)
    (tmp_path / "hf-0" / "config.json").write_text(config.read_text())
    back = tmp_path / "back"
    proc = ckptconv(
        "hf-to-dcp",
        str(tmp_path / "hf-0"),
        str(back),
        "--mapping",
        str(mapping),
        "--prefix",
        "model.",
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr
    state = load_plain(back)
    assert set(state) == {f"model.{k}" for k in full if k != "freqs_cis"}
    assert "step" in open_dcp(back).items
    for key, value in full.items():
        if key != "freqs_cis":
            assert same_bits(state[f"model.{key}"], value), key  # type: ignore[arg-type]
    again = tmp_path / "again"
    proc = ckptconv("dcp-to-hf", str(back), str(again), *flags, "--max-shard-size", "900")
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(again) == {
        k: v for k, v in tree_sha256(tmp_path / "hf-0").items() if k != "config.json"
    }


def test_flipped_byte_in_one_expert_fails_the_crc_check_at_any_rank_count(
    runtime_ckpt, tmp_path: Path
) -> None:
    """Stacked experts are read one expert's rows at a time; the pieces' CRC-32s, from whichever ranks
    read them, add up to the chunk's and catch a flipped byte in the middle of one expert."""
    import shutil

    from ckptconv.formats.dcp_reader import DcpReader

    src, mapping, config = runtime_ckpt
    flags = ["--mapping", str(mapping), "--config", str(config)]
    good = tmp_path / "good"  # converted before the damage, to verify against
    proc = ckptconv("dcp-to-hf", str(src), str(good), *flags, "--dtype", "keep")
    assert proc.returncode == 0, proc.stderr
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    spec = open_dcp(ckpt).tensors["model.layers.1.moe.experts.w2"]
    chunk = max(spec.chunks, key=lambda c: c.sizes[0])
    with DcpReader(open_dcp(ckpt)) as reader:
        where = reader.locate(spec, chunk)
    assert where is not None and chunk.sizes[0] >= 2
    row_bytes = chunk.numel // chunk.sizes[0] * spec.dtype.itemsize
    with open(ckpt / chunk.file, "r+b") as f:  # one bit of one value of the chunk's last expert
        f.seek(where + (chunk.sizes[0] - 1) * row_bytes + 6)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x04]))
    runs = [
        (
            nproc,
            [
                "dcp-to-hf",
                str(ckpt),
                str(tmp_path / f"out-{nproc}"),
                "--max-shard-size",
                "900",
                "--read",
                read,
            ],
        )
        for nproc, read in [(0, "direct"), (2, "direct"), (3, "gather")]
    ]
    runs += [(nproc, ["verify", str(ckpt), str(good)]) for nproc in (0, 2)]  # a CRC error, not a mismatch
    for nproc, args in runs:
        proc = ckptconv(*args, *flags, nproc=nproc)
        assert proc.returncode == (2 if nproc == 0 else 1), proc.stderr  # torchrun exits 1 for a failed job
        errors = [line for line in proc.stderr.splitlines() if "ckptconv: error:" in line]
        assert len(errors) == 1, proc.stderr
        assert chunk.file in errors[0] and "'model.layers.1.moe.experts.w2'" in errors[0], errors
        assert "fails its CRC-32 check" in errors[0], errors
        assert "ckptconv/" not in proc.stderr.replace(str(tmp_path), "")  # no worker traceback
        assert not list(tmp_path.glob("out-*")) and not list(tmp_path.glob(".out-*"))


def test_rope_perm_is_torchtitans() -> None:
    w = torch.arange(8 * 3).reshape(8, 3)
    perm = rope_perm(8, 2)
    assert torch.equal(w[list(perm)], titan_permute(w, 2))
    assert torch.equal(w[list(perm)][list(inverse(perm))], w)


@pytest.mark.parametrize(
    ("direction", "shapes", "message"),
    [
        ("to_hf", {"mystery.weight": (2,)}, "no rule maps 'mystery.weight'"),
        (
            "to_runtime",
            {
                "model.layers.1.mlp.experts.0.gate_proj.weight": (6, 8),
                "model.layers.1.mlp.experts.2.gate_proj.weight": (6, 8),
            },
            "experts.1.gate_proj.weight' is missing",
        ),
        (
            "to_runtime",
            {
                "model.layers.1.mlp.experts.0.gate_proj.weight": (6, 8),
                "model.layers.1.mlp.experts.1.gate_proj.weight": (6, 9),
            },
            "differ in shape",
        ),
        ("to_hf", {"layers.0.feed_forward.w13.weight": (11, 8)}, "add up to 12"),
        (
            "to_runtime",
            {"model.layers.0.mlp.gate_proj.weight": (6, 8)},
            "needs 'model.layers.0.mlp.up_proj.weight'",
        ),
    ],
)
def test_strict_errors(runtime_ckpt, direction, shapes, message) -> None:
    mapping = load_mapping(str(runtime_ckpt[1]))
    with pytest.raises(CkptconvError, match=message.replace("(", r"\(").replace(".", r"\.")):
        map_keys(mapping, direction, shapes, CONFIG)


def test_allow_unmapped_and_produced_twice(runtime_ckpt, tmp_path: Path) -> None:
    mapping = load_mapping(str(runtime_ckpt[1]))
    mapped = map_keys(mapping, "to_hf", {"mystery": (2,), "norm.x": (3,)}, CONFIG, allow_unmapped=True)
    targets, unmapped = mapped.targets, mapped.unmapped
    assert unmapped == ["mystery", "norm.x"] and [t.key for t in targets] == ["mystery", "norm.x"]
    twice = tmp_path / "twice.toml"
    twice.write_text('[mapping]\n[[rule]]\nruntime = "a.{i}"\nhf = "x"\n')
    with pytest.raises(CkptconvError, match="produced twice"):
        map_keys(load_mapping(str(twice)), "to_hf", {"a.0": (1,), "a.1": (1,)}, {})


def test_tied_embeddings(runtime_ckpt) -> None:
    mapping = load_mapping(str(runtime_ckpt[1]))
    tied = {**CONFIG, "tie_word_embeddings": True}
    targets = map_keys(
        mapping, "to_hf", {"tok_embeddings.weight": (10, 8), "output.weight": (10, 8)}, tied
    ).targets
    assert [t.key for t in targets] == ["model.embed_tokens.weight"]
    targets = map_keys(mapping, "to_runtime", {"model.embed_tokens.weight": (10, 8)}, tied).targets
    assert sorted(t.key for t in targets) == ["output.weight", "tok_embeddings.weight"]


@pytest.mark.parametrize(
    "bad",
    [
        '[mapping]\n[[rule]]\nruntime = "a"\n',  # no hf side
        "not toml ===",
        '[mapping]\n[[rule]]\nruntime = "a"\nhf = "b"\nfoo = 1\n',  # unknown field
        '[mapping]\n[[rule]]\nruntime = "a"\nhf = "b"\nstack = "expert"\n',  # stack without {expert}
        '[mapping]\nhf_experts = "both"\n[[rule]]\nruntime = "a"\nhf = "b"\n',
    ],
)
def test_bad_mapping_files(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(bad)
    with pytest.raises(CkptconvError, match="--mapping"):
        load_mapping(str(path))


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(CkptconvError, match="neither a preset"):
        load_mapping("no-such-preset")


def test_inspect_and_dry_run_show_the_mapped_view(runtime_ckpt, tmp_path: Path, capsys) -> None:
    from ckptconv.cli.app import main

    ckpt, mapping, config = runtime_ckpt
    main(["inspect", str(ckpt), "--mapping", str(mapping), "--config", str(config), "--json"])
    view = {v["key"]: v for v in json.loads(capsys.readouterr().out)["mapped"]}
    assert view["model.layers.0.self_attn.q_proj.weight"]["op"] == "permute"
    assert view["model.layers.1.mlp.experts.3.up_proj.weight"] == {
        "key": "model.layers.1.mlp.experts.3.up_proj.weight",
        "op": "unstack",
        "sources": ["layers.1.moe.experts.w3"],
        "shape": [F, D],
    }
    main(
        [
            "dcp-to-hf",
            str(ckpt),
            str(tmp_path / "o"),
            "--mapping",
            str(mapping),
            "--config",
            str(config),
            "--dry-run",
        ]
    )
    text = capsys.readouterr().out
    assert (
        "model.layers.0.mlp.up_proj.weight" in text
        and "split" in text
        and "model.layers.0.feed_forward.w13" in text
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("shard_dim", [0, 1])
def test_one_expert_reads_only_its_rows(shard_dim: int) -> None:
    """Unstacking expert e of [E, F, D] reads only expert e's rows of the chunks that hold it."""
    from ckptconv.core.specs import ChunkSpec, TensorSpec
    from ckptconv.plan.types import OutTensor, SourcePart
    from ckptconv.stream.unshard import assemble

    full = torch.arange(E * F * D, dtype=torch.float32).reshape(E, F, D)
    step = (E if shard_dim == 1 else 2, F // 2 if shard_dim == 1 else F, D)
    chunks = []
    for i in range(2):
        offsets = (0, i * step[1], 0) if shard_dim == 1 else (i * step[0], 0, 0)
        chunks.append(ChunkSpec(offsets, step, f"__{i}_0.distcp", 0, 1, "torch_save"))
    spec = TensorSpec("w1", "float32", (E, F, D), tuple(chunks))
    mapping = load_mapping_text(MAPPING)
    targets = map_keys(mapping, "to_hf", {"layers.1.moe.experts.w1": (E, F, D)}, CONFIG).targets
    requests: list[tuple[tuple[int, ...], int, int]] = []

    def rows(s: TensorSpec, chunk: ChunkSpec, r0: int, r1: int) -> torch.Tensor:
        requests.append((chunk.offsets, r0, r1))
        block = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))]
        return block[r0:r1].clone()

    for e, target in enumerate(targets):
        requests.clear()
        out = OutTensor(
            target.key, target.shape, torch.float32, tuple(SourcePart(spec, p) for p in target.parts)
        )
        assert torch.equal(assemble(out, rows), full[e])
        read_rows = sum(r1 - r0 for _, r0, r1 in requests)
        assert read_rows == (1 if shard_dim == 0 else 2), (
            requests
        )  # one expert row from each chunk holding it


def load_mapping_text(text: str):  # type: ignore[no-untyped-def]
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    return load_mapping(f.name)


def test_fused_qkv_with_gqa_sizes_from_config(tmp_path: Path) -> None:
    path = tmp_path / "qkv.toml"
    path.write_text(
        "[mapping]\n[[rule]]\n"
        'runtime = "layers.{layer}.attention.wqkv.weight"\n'
        'hf = ["layers.{layer}.q.weight", "layers.{layer}.k.weight", "layers.{layer}.v.weight"]\n'
        'sizes = ["num_attention_heads * head_dim", "num_key_value_heads * head_dim", '
        '"num_key_value_heads * head_dim"]\n'
    )
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 3}
    targets = map_keys(
        load_mapping(str(path)), "to_hf", {"layers.0.attention.wqkv.weight": (24, 5)}, config
    ).targets
    assert [(t.key, t.shape, t.parts[0].src_offsets) for t in targets] == [
        ("layers.0.q.weight", (12, 5), (0, 0)),
        ("layers.0.k.weight", (6, 5), (12, 0)),
        ("layers.0.v.weight", (6, 5), (18, 0)),
    ]
    with pytest.raises(CkptconvError, match=r"num_attention_heads.*pass --config"):
        map_keys(load_mapping(str(path)), "to_hf", {"layers.0.attention.wqkv.weight": (24, 5)}, {})
