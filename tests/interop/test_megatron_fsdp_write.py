"""hf-to-dcp --mapping megatron-gpt --format fsdp_dtensor: what Megatron-FSDP's loader reads (issue #37, 3).

Tiny transformers Qwen3 and Qwen3-MoE models (save_pretrained) are converted, then:

- the checkpoint holds exactly Megatron-FSDP's keys: `model.module.<fqn>` of the TransformerEngine spec's
  modules, per layer and per expert (global numbers), SwiGLU fc1 as `_w` / `_v`, fp32 (its main weights), and
  the `args`, `iteration` and `checkpoint_version` items; each tensor equals what explicit torch makes of the
  HF tensors (QKV per query group, the vocabulary padded with zeros);
- megatron-core 0.16.1's own `handle_experts_in_state_dict` turns the model's local expert keys (at EP 1 and
  EP 3) into keys the checkpoint holds, and `dcp.load` as `_load_base_checkpoint` calls it fills them (slow:
  a subprocess with megatron-core, tests/support/workers/megatron_fsdp_load.py);
- dcp-to-hf back gives save_pretrained's tensors bit for bit; 1 and 2 ranks write the same tensors;
- the flags' refusals: one line, exit 2, nothing written.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS, ckptconv
from megatron import _env, megatron_dir
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import load_dir, same_bits
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ckptconv.core.specs import StashedItem
from ckptconv.formats.stash import write_stash

PRESET = "megatron-gpt"
COMMON = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": False,
}
EXPERTS = 3
ITEMS = {"args", "iteration", "checkpoint_version"}


def make_model(kind: str, out: Path) -> Path:
    """save_pretrained of a tiny Qwen3 ("dense") or Qwen3-MoE ("moe", 3 experts), fp32, seeded."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "dense":
        model: Any = tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON))
    else:
        config = tf.Qwen3MoeConfig(
            **COMMON,
            moe_intermediate_size=16,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        model = tf.Qwen3MoeForCausalLM(config)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def hf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, make_model(request.param, tmp_path_factory.mktemp(request.param) / "hf")


def expected(hf: dict[str, torch.Tensor], moe: bool, sequential: bool, vocab_rows: int) -> dict[str, Any]:
    """Megatron-FSDP's model keys (after `model.module.`; TransformerEngine spec module names, SwiGLU fc1 as
    `_w` gate and `_v` up) and their values, from the HF tensors by explicit torch."""
    groups, per, hd = COMMON["num_key_value_heads"], 2, COMMON["head_dim"]

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(vocab_rows - t.shape[0], t.shape[1])])

    out = {
        "embedding.word_embeddings.weight": padded(hf["model.embed_tokens.weight"]),
        "output_layer.weight": padded(hf["lm_head.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    for i in range(COMMON["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[src + "self_attn.q_proj.weight"].view(groups, per * hd, -1)
        k = hf[src + "self_attn.k_proj.weight"].view(groups, hd, -1)
        v = hf[src + "self_attn.v_proj.weight"].view(groups, hd, -1)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[dst + "self_attention.linear_qkv.layer_norm_weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
        out[dst + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        norm = hf[src + "post_attention_layernorm.weight"]
        if not moe:
            out[dst + "mlp.linear_fc1.layer_norm_weight"] = norm
            out[dst + "mlp.linear_fc1.weight_w"] = hf[src + "mlp.gate_proj.weight"]
            out[dst + "mlp.linear_fc1.weight_v"] = hf[src + "mlp.up_proj.weight"]
            out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
            continue
        out[dst + "pre_mlp_layernorm.weight"] = norm
        out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
        for e in range(EXPERTS):
            x = f"{src}mlp.experts.{e}."
            if sequential:
                fc1, fc2 = (
                    f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                    f"mlp.experts.local_experts.{e}.linear_fc2.weight",
                )
            else:
                fc1, fc2 = f"mlp.experts.linear_fc1.weight{e}", f"mlp.experts.linear_fc2.weight{e}"
            out[dst + fc1 + "_w"] = hf[x + "gate_proj.weight"]
            out[dst + fc1 + "_v"] = hf[x + "up_proj.weight"]
            out[dst + fc2] = hf[x + "down_proj.weight"]
    return out


def load_model(ckpt: Path, keys: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`dcp.load({"model": {"module.<fqn>": ...}})`, strict keys, nested as Megatron-FSDP's state dict is."""
    model = {f"module.{k}": torch.empty(v.shape, dtype=torch.float32) for k, v in keys.items()}
    dcp.load({"model": model}, checkpoint_id=str(ckpt), planner=DefaultLoadPlanner(), no_dist=True)
    return {k.removeprefix("module."): v for k, v in model.items()}


def load_items(ckpt: Path) -> dict[str, Any]:
    """The bytes items, loaded as `_load_base_checkpoint`'s rank-0 pass loads them (our own output)."""
    items: dict[str, Any] = {"args": None, "iteration": None, "checkpoint_version": None}
    dcp.load(items, checkpoint_id=str(ckpt), no_dist=True)
    return items


def convert(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *flags: str) -> None:
    code, err = run(
        capsys, "hf-to-dcp", str(src), str(out), "--mapping", PRESET, "--format", "fsdp_dtensor", *flags
    )
    assert code == 0, err


@pytest.mark.parametrize("sequential", [False, True], ids=["grouped", "sequential"])
def test_fsdp_dtensor_keys_values_and_items(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, hf_model: tuple[str, Path], sequential: bool
) -> None:
    kind, src = hf_model
    if sequential and kind == "dense":
        pytest.skip("experts only")
    out = tmp_path / "fsdp"
    layout = ["--runtime-layout", "experts-sequential"] if sequential else []
    convert(capsys, src, out, "--verify", *layout)  # --verify: read back as dcp-to-hf reads it
    assert not (out / "metadata.json").exists() and not (out / "common.pt").exists()
    hf = load_dir(src)
    want = expected(hf, kind == "moe", sequential, 128)
    stored = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    assert set(stored) == {f"model.module.{k}" for k in want} | ITEMS
    assert all(stored[f"model.module.{k}"].properties.dtype == torch.float32 for k in want)
    got = load_model(out, want)
    assert all(same_bits(got[k], want[k].float()) for k in want)
    items = load_items(out)
    assert items["iteration"] == 0 and items["checkpoint_version"] == 3.0
    args = items["args"]
    assert type(args) is Namespace
    # what check_checkpoint_args compares, and the model arguments --use-checkpoint-args takes
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 32, 4)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert (args.num_query_groups, args.kv_channels, args.ffn_hidden_size) == (2, 8, 64)
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (128, 128)
    assert args.swiglu and args.qk_layernorm and args.untie_embeddings_and_output_weights
    assert args.max_position_embeddings == 32768 and args.normalization == "RMSNorm"
    if kind == "moe":
        assert (args.num_experts, args.moe_ffn_hidden_size, args.moe_router_topk) == (3, 16, 2)
        assert args.moe_grouped_gemm is not sequential
    else:
        assert not hasattr(args, "num_experts")


def test_back_to_hf_bit_exact(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, hf_model: tuple[str, Path]
) -> None:
    _, src = hf_model
    convert(capsys, src, tmp_path / "fsdp")
    back = tmp_path / "back"
    # the fsdp_dtensor reader (prefix recognised) lands separately: until then its prefix is named
    flags = ["--mapping", PRESET, "--prefix", "model.module.", "--dtype", "keep", "--copy-from", str(src)]
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "fsdp"), str(back), *flags)
    assert code == 0, err
    hf, got = load_dir(src), load_dir(back)
    assert got.keys() == hf.keys() and all(same_bits(got[k], hf[k]) for k in hf)


def test_megatron_tp_and_source_iteration(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--megatron-tp 2: the vocabulary padded to 128 x 2 rows, args at TP 2; the source stash's iteration."""
    src = make_model("dense", tmp_path / "hf")
    buffer = io.BytesIO()
    torch.save(7, buffer)
    write_stash(src, [StashedItem("iteration", ("iteration",), buffer.getvalue(), 7, True)])
    convert(capsys, src, tmp_path / "fsdp", "--megatron-tp", "2", "--dtype", "bf16")
    stored = FileSystemReader(str(tmp_path / "fsdp")).read_metadata().state_dict_metadata
    emb = stored["model.module.embedding.word_embeddings.weight"]
    assert list(emb.size) == [256, 32] and emb.properties.dtype == torch.bfloat16
    items = load_items(tmp_path / "fsdp")
    assert items["iteration"] == 7
    assert items["args"].tensor_model_parallel_size == 2 and items["args"].padded_vocab_size == 256


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ("--mapping", "torchtitan-qwen3", "--format", "fsdp_dtensor"),
            "--format applies to a Megatron mapping",
        ),
        (
            ("--mapping", "torchtitan-qwen3", "--megatron-tp", "2"),
            "--megatron-tp applies to a Megatron mapping",
        ),
        (("--mapping", PRESET, "--megatron-gdn", "split"), "has no GDN layouts"),
        (
            ("--mapping", PRESET, "--megatron-gdn", "fused"),
            "needs the TP size of the job that will load it: --megatron-tp N",
        ),
        (
            ("--mapping", PRESET, "--format", "torch"),
            "--format 'torch' is not one of torch_dist, fsdp_dtensor",
        ),
        (("--format", "fsdp_dtensor"), "pass --mapping too"),
        (("--mapping", PRESET, "--megatron-tp", "0"), "--megatron-tp 0"),
        (("--mapping", PRESET, "--format", "fsdp_dtensor", "--prefix", "model."), "leave --prefix out"),
    ],
)
def test_refusals(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: tuple[str, ...], needle: str
) -> None:
    src = make_model("dense", tmp_path / "hf")
    code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"), *flags)
    assert_one_line(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_config_tp_conflict(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = make_model("dense", tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tensor_model_parallel_size": 4}))
    code, err = run(
        capsys, "hf-to-dcp", str(src), str(tmp_path / "out"), "--mapping", PRESET, "--megatron-tp", "2"
    )
    assert_one_line(code, err, "--megatron-tp 2", "tensor_model_parallel_size 4")
    assert not (tmp_path / "out").exists()


def _local_keys(want: dict[str, torch.Tensor], ep_size: int, ep_rank: int) -> dict[str, list[int]]:
    """The model's state dict keys at EP rank `ep_rank` of `ep_size` (its local experts numbered from 0),
    `module.`-prefixed as Megatron-FSDP's model state dict holds them."""
    import re

    local = EXPERTS // ep_size
    out = {}
    for key, value in want.items():
        m = re.search(r"(weight|local_experts\.)(\d+)", key) if ".mlp.experts." in key else None
        if m is None:
            out[f"module.{key}"] = list(value.shape)
            continue
        e = int(m.group(2))
        if not ep_rank * local <= e < (ep_rank + 1) * local:
            continue
        out[f"module.{key[: m.start(2)]}{e - ep_rank * local}{key[m.end(2) :]}"] = list(value.shape)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [False, True], ids=["grouped", "sequential"])
def test_megatron_core_loads_it(capsys: pytest.CaptureFixture[str], tmp_path: Path, sequential: bool) -> None:
    """megatron-core 0.16.1's handle_experts_in_state_dict at EP 1 and at each rank of EP 3, then dcp.load
    as _load_base_checkpoint calls it (strict keys): every expert lands where the HF experts say."""
    src = make_model("moe", tmp_path / "hf")
    out = tmp_path / "fsdp"
    convert(capsys, src, out, *(["--runtime-layout", "experts-sequential"] if sequential else []))
    want = expected(load_dir(src), True, sequential, 128)
    loads = [(1, 0)] + [(EXPERTS, r) for r in range(EXPERTS)]
    spec = {
        "num_experts": EXPERTS,
        "loads": [{"ep_size": n, "ep_rank": r, "keys": _local_keys(want, n, r)} for n, r in loads],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(WORKERS / "megatron_fsdp_load.py"), str(out), str(tmp_path / "spec.json")]
    cmd.append(str(tmp_path / "loaded.pt"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(str(megatron_dir())), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = torch.load(tmp_path / "loaded.pt", weights_only=False)  # our own test's output
    assert result["items"]["args_type"] == "Namespace" and result["items"]["args"]["num_experts"] == EXPERTS
    assert result["items"]["iteration"] == 0 and result["items"]["checkpoint_version"] == 3.0
    for (n, r), loaded in zip(loads, result["loads"], strict=True):
        experts = {k for k in loaded if ".mlp.experts." in k}
        assert len(experts) == 2 * 3 * EXPERTS // n, (n, r, sorted(experts))
        for key, value in loaded.items():
            assert same_bits(value, want[key.removeprefix("module.")]), (n, r, key)


@pytest.mark.slow
def test_one_and_two_ranks_write_the_same(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = make_model("moe", tmp_path / "hf")
    convert(capsys, src, tmp_path / "one")
    flags = ["--mapping", PRESET, "--format", "fsdp_dtensor"]
    proc = ckptconv("hf-to-dcp", str(src), str(tmp_path / "two"), *flags, nproc=2)
    assert proc.returncode == 0, proc.stderr
    assert any(p.name.startswith("__1_") for p in (tmp_path / "two").glob("*.distcp"))  # rank 1 wrote
    want = expected(load_dir(src), True, False, 128)
    one, two = load_model(tmp_path / "one", want), load_model(tmp_path / "two", want)
    assert all(same_bits(one[k], two[k]) for k in want)
    a, b = load_items(tmp_path / "one"), load_items(tmp_path / "two")
    assert vars(a.pop("args")) == vars(b.pop("args")) and a == b
