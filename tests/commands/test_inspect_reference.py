"""inspect's layout and reference (issue #36 item 4): which variant a checkpoint stores its routed experts in
(per expert, as transformers' save_pretrained writes them, or fused), and with `--reference BASE` how its
tensors (a DCP's mapped ones with `--mapping`) differ from BASE's headers. Real checkpoints: a tiny Qwen3-MoE
saved by transformers, a fused copy written by safetensors from the same weights, DCPs from dcp.save."""

from __future__ import annotations

import doctest
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv
from families import _fuse_experts, config, tiny
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line
from test_json_schema import report

from ckptconv.plan import variants
from ckptconv.plan.variants import Seen, detect, hf_experts

E, H, F = 4, 32, 8  # experts, hidden size, expert intermediate size (families.config("qwen3", moe=True))
PER_EXPERT_KEY = "model.layers.0.mlp.experts.0.down_proj.weight"  # the first in save_pretrained's file
PER_EXPERT = {"variant": "per_expert", "basis": "keys", "key": PER_EXPERT_KEY}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/: the model's save_pretrained (per expert); fused/: the same weights with the experts fused
    (safetensors' save_file); fused-bf16/: fused/ in bf16; dcp/: the model's own state_dict (transformers 5
    holds its experts fused) by dcp.save; inner/: the inner Qwen3MoeModel's (no `model.` prefix, no lm_head);
    titan/: base/ as torchtitan lays it out (hf-to-dcp --mapping torchtitan-qwen3)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("inspect-reference")
    base = tiny("qwen3", root / "base", moe=True)
    fused = _fuse_experts(load_file(base / "model.safetensors"))
    for name, tensors in (
        ("fused", fused),
        ("fused-bf16", {k: v.to(torch.bfloat16) for k, v in fused.items()}),
    ):
        (root / name).mkdir()
        shutil.copy(base / "config.json", root / name / "config.json")
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(config("qwen3", moe=True)).to(torch.float32)
    dcp.save(model.state_dict(), checkpoint_id=str(root / "dcp"), no_dist=True)
    dcp.save(model.model.state_dict(), checkpoint_id=str(root / "inner"), no_dist=True)
    made = ckptconv("hf-to-dcp", str(base), str(root / "titan"), "--mapping", "torchtitan-qwen3")
    assert made.returncode == 0, made.stderr
    return root


def headers(path: Path) -> dict[str, tuple[list[int], str]]:
    """A safetensors file's keys, shapes and dtypes, read by safetensors itself (the oracle)."""
    out = {}
    with safe_open(path / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            piece = f.get_slice(key)
            out[key] = (piece.get_shape(), {"F32": "float32", "BF16": "bfloat16"}[piece.get_dtype()])
    return out


def tail(path: Path, *args: str) -> list[str]:
    """The lines inspect prints after its table (and mapped view): layout and reference."""
    proc = ckptconv("inspect", str(path), *args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("layout"))
    return lines[first:]


def missing(key: str, shape: str) -> str:
    return f"  missing {key!r}: the reference has it ({shape} float32), the checkpoint does not"


def extra(key: str, shape: str) -> str:
    return f"  extra {key!r}: the checkpoint has it ({shape} float32), the reference does not"


# -- the variant alone ---------------------------------------------------------------------------------------


def test_the_detectors_docstring_examples() -> None:
    assert doctest.testmod(variants).failed == 0


@pytest.mark.parametrize(
    ("shapes", "variant"),
    [
        ({"model.layers.0.mlp.experts.3.up_proj.weight": (8, 32)}, "per_expert"),
        ({"model.layers.0.block_sparse_moe.experts.0.w1.weight": (8, 32)}, "per_expert"),  # Mixtral's names
        (
            {"model.layers.0.mlp.experts.gate_up_proj": (4, 32, 48), "x.experts.gate_up_proj_bias": (4, 48)},
            "fused",
        ),
        ({"a.experts.down_proj": (4, 32, 8), "b.experts.0.down_proj.weight": (32, 8)}, "mixed"),
        ({"model.layers.0.mlp.shared_experts.gate_proj.weight": (8, 32)}, None),  # DeepSeek's shared expert
        ({"model.layers.0.mlp.experts.down_proj": (32, 8)}, None),  # 2-D: not a stack of experts
        ({"model.embed_tokens.weight": (64, 32)}, None),
    ],
)
def test_hf_experts_from_keys_and_shapes(shapes: dict[str, tuple[int, ...]], variant: str | None) -> None:
    found = hf_experts(Seen(shapes))
    assert (found and found.variant) == variant
    assert [v.aspect for v in detect(Seen(shapes))] == ([] if variant is None else ["hf_experts"])


# -- an HF checkpoint ----------------------------------------------------------------------------------------


def test_a_base_matches_itself(moe: Path) -> None:
    base = moe / "base"
    assert tail(base, "--reference", str(base)) == [
        f"layout: routed experts stored per expert ({PER_EXPERT_KEY})",
        f"reference {base}: no difference in keys, shapes or dtypes",
        f"layout of the reference: routed experts stored per expert ({PER_EXPERT_KEY})",
    ]
    doc = report("inspect", str(base), "--reference", str(base))
    assert doc["layout"] == {"hf_experts": PER_EXPERT}
    assert doc["reference"] == {"path": str(base), "differences": [], "layout": {"hf_experts": PER_EXPERT}}


def test_without_reference_the_layout_alone(moe: Path) -> None:
    fused = moe / "fused"
    assert tail(fused) == ["layout: routed experts stored fused (model.layers.0.mlp.experts.down_proj)"]
    doc = report("inspect", str(fused))
    assert doc["reference"] is None
    assert doc["layout"] == {
        "hf_experts": {"variant": "fused", "basis": "keys", "key": "model.layers.0.mlp.experts.down_proj"}
    }


def test_a_fused_release_against_its_per_expert_base(moe: Path) -> None:
    base, fused = moe / "base", moe / "fused"
    assert tail(fused, "--reference", str(base)) == [
        "layout: routed experts stored fused (model.layers.0.mlp.experts.down_proj)",
        f"reference {base}: 28 difference(s): 24 missing, 4 extra",
        missing("model.layers.0.mlp.experts.0.down_proj.weight", f"[{H}, {F}]"),
        missing("model.layers.0.mlp.experts.0.gate_proj.weight", f"[{F}, {H}]"),
        missing("model.layers.0.mlp.experts.0.up_proj.weight", f"[{F}, {H}]"),
        "  and 21 more missing (--json lists every one)",
        extra("model.layers.0.mlp.experts.down_proj", f"[{E}, {H}, {F}]"),
        extra("model.layers.0.mlp.experts.gate_up_proj", f"[{E}, {2 * F}, {H}]"),
        extra("model.layers.1.mlp.experts.down_proj", f"[{E}, {H}, {F}]"),
        "  and 1 more extra (--json lists every one)",
        f"layout of the reference: routed experts stored per expert ({PER_EXPERT_KEY})",
    ]
    doc = report("inspect", str(fused), "--reference", str(base))
    ours, theirs = headers(fused), headers(base)
    text = {k: f"[{', '.join(map(str, s))}] {d}" for k, (s, d) in (ours | theirs).items()}
    expected = [
        {"kind": "missing", "key": k, "planned": None, "reference": text[k]} for k in theirs if k not in ours
    ] + [{"kind": "extra", "key": k, "planned": text[k], "reference": None} for k in ours if k not in theirs]
    assert doc["reference"]["differences"] == expected
    assert doc["reference"]["layout"] == {"hf_experts": PER_EXPERT}


def test_an_hf_checkpoint_with_a_mapping_is_compared_as_it_is(moe: Path) -> None:
    """The mapping's rules say which variant the keys are in; the HF keys themselves are compared."""
    fused = moe / "fused"
    lines = tail(fused, "--mapping", "torchtitan-qwen3", "--reference", str(fused))
    assert lines[:3] == [
        "layout: routed experts stored fused (model.layers.0.mlp.experts.down_proj)",
        "layout: routed experts (runtime) written experts-EFD by the mapping "
        "(layers.0.moe.routed_experts.inner_experts.w1_EFD)",
        f"reference {fused}: no difference in keys, shapes or dtypes",
    ]


# -- a DCP ---------------------------------------------------------------------------------------------------


def test_a_dcp_as_dcp_to_hf_takes_it(moe: Path) -> None:
    ckpt, base, fused = moe / "dcp", moe / "base", moe / "fused"
    assert tail(ckpt, "--reference", str(fused)) == [
        "layout: routed experts stored fused (model.layers.0.mlp.experts.gate_up_proj)",
        f"reference {fused}: no difference in keys, shapes or dtypes",
        "layout of the reference: routed experts stored fused (model.layers.0.mlp.experts.down_proj)",
    ]
    lines = tail(ckpt, "--reference", str(base))
    assert lines[1] == f"reference {base}: 28 difference(s): 24 missing, 4 extra"
    assert lines[6] == extra("model.layers.0.mlp.experts.gate_up_proj", f"[{E}, {2 * F}, {H}]")  # DCP's order
    # dtypes: the checkpoint's stored fp32 against a bf16 base, every tensor told
    doc = report("inspect", str(ckpt), "--reference", str(moe / "fused-bf16"))
    kinds = {d["kind"] for d in doc["reference"]["differences"]}
    assert kinds == {"dtype"} and len(doc["reference"]["differences"]) == doc["num_tensors"]
    first = doc["reference"]["differences"][0]
    assert first == {"kind": "dtype", "key": "lm_head.weight", "planned": "float32", "reference": "bfloat16"}
    lines = tail(ckpt, "--reference", str(moe / "fused-bf16"))
    assert lines[1].endswith(f": {doc['num_tensors']} difference(s): {doc['num_tensors']} dtype")
    assert lines[2] == "  dtype of 'lm_head.weight': float32 in the checkpoint, bfloat16 in the reference"
    assert lines[5:7] == [
        f"  and {doc['num_tensors'] - 3} more dtype (--json lists every one)",
        "  (a DCP's dtypes as stored: dcp-to-hf writes --dtype, bf16 unless told, and --fp32's keys fp32)",
    ]


def test_a_dcp_with_the_wrong_prefix(moe: Path) -> None:
    """The inner model's state dict: no `model.` on any key, no lm_head."""
    fused = moe / "fused"
    doc = report("inspect", str(moe / "inner"), "--reference", str(fused))
    differences = doc["reference"]["differences"]
    theirs = headers(fused)
    assert [d["key"] for d in differences if d["kind"] == "missing"] == list(theirs)
    extras = [d["key"] for d in differences if d["kind"] == "extra"]
    assert extras == list(doc["release"]["model"])  # in the checkpoint's order
    assert sorted("model." + k for k in extras) == sorted(k for k in theirs if k != "lm_head.weight")
    lines = tail(moe / "inner", "--reference", str(fused))
    n = len(theirs)
    assert lines[1] == f"reference {fused}: {2 * n - 1} difference(s): {n} missing, {n - 1} extra"
    assert lines[2] == missing("lm_head.weight", f"[64, {H}]")
    assert lines[6] == extra("embed_tokens.weight", f"[64, {H}]")


def test_a_dcp_with_a_mapping_as_the_mapping_writes_it(moe: Path) -> None:
    titan, base, fused = moe / "titan", moe / "base", moe / "fused"
    written = {
        "variant": "per_expert",
        "basis": "mapping",
        "key": "model.layers.0.mlp.experts.0.gate_proj.weight",
    }
    runtime = {
        "variant": "experts-EFD",
        "basis": "keys",
        "key": "layers.0.moe.routed_experts.inner_experts.w1_EFD",
    }
    lines = tail(titan, "--mapping", "torchtitan-qwen3", "--reference", str(base))
    assert lines == [
        f"layout: routed experts written per expert by the mapping ({written['key']})",
        f"layout: routed experts (runtime) stored experts-EFD ({runtime['key']})",
        f"reference {base}: no difference in keys, shapes or dtypes (the mapped view)",
        f"layout of the reference: routed experts stored per expert ({PER_EXPERT_KEY})",
    ]
    doc = report("inspect", str(titan), "--mapping", "torchtitan-qwen3", "--reference", str(fused))
    assert doc["layout"] == {"hf_experts": written, "runtime:routed experts": runtime}
    differences = doc["reference"]["differences"]
    assert [d["kind"] for d in differences] == ["missing"] * 4 + ["extra"] * 24
    assert {d["key"] for d in differences if d["kind"] == "missing"} == {
        f"model.layers.{n}.mlp.experts.{p}" for n in (0, 1) for p in ("gate_up_proj", "down_proj")
    }
    lines = tail(titan, "--mapping", "torchtitan-qwen3", "--reference", str(fused))
    assert lines[2] == f"reference {fused}: 28 difference(s) (the mapped view): 4 missing, 24 extra"
    # without the reference, the layout lines only; the runtime keys say nothing of HF experts by themselves
    assert tail(titan, "--mapping", "torchtitan-qwen3") == lines[:2]
    assert report("inspect", str(titan))["layout"] == {}


# -- bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("nowhere", "no such directory"),
        ("dcp", "no model.safetensors.index.json or *.safetensors in it"),
        ("base/config.json", "not a directory"),
    ],
)
def test_a_bad_reference_is_one_line(moe: Path, where: str, why: str) -> None:
    flag = f"--reference {moe / where}"
    proc = ckptconv("inspect", str(moe / "base"), "--reference", str(moe / where))
    assert_one_line(proc.returncode, proc.stderr, f"{flag}: {why}", "base model's HF directory")
    assert proc.stdout == ""
    doc = report("inspect", str(moe / "base"), "--reference", str(moe / where), code=2)
    assert flag in doc["error"]["message"]


def test_reference_is_not_for_explain(moe: Path) -> None:
    proc = ckptconv(
        "inspect", str(moe / "titan"), "--mapping", "torchtitan-qwen3", "--explain", "x", "--reference", "."
    )
    assert_one_line(proc.returncode, proc.stderr, "--reference: not with --explain")


def test_a_later_torchtitan_layout_is_told(moe: Path, tmp_path: Path) -> None:
    """A checkpoint in torchtitan's stacked experts [E, 2, F, D] (written by hf-to-dcp --runtime-layout, whose
    values interop/test_runtime_layouts.py holds to the PRs' math): inspect names the layout it detected."""
    made = ckptconv(
        "hf-to-dcp",
        str(moe / "base"),
        str(tmp_path / "e2fd"),
        "--mapping",
        "torchtitan-qwen3",
        "--runtime-layout",
        "experts-E2FD",
    )
    assert made.returncode == 0, made.stderr
    doc = report("inspect", str(tmp_path / "e2fd"), "--mapping", "torchtitan-qwen3")
    assert doc["layout"]["runtime:routed experts"] == {
        "variant": "experts-E2FD",
        "basis": "keys",
        "key": "layers.0.moe.routed_experts.inner_experts.w1_EFD",
    }
    shapes = {t["key"]: t["shape"] for t in doc["tensors"]}
    assert shapes["layers.0.moe.routed_experts.inner_experts.w1_EFD"] == [E, 2, F, H]
