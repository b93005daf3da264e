"""The megatron-gpt preset against megatron-core 0.16.1's own code (issue #16, point 2).

A tiny GPTModel (local spec, TP=2, bf16; tests/support/workers/megatron_save.py) is saved by megatron's
`dist_checkpointing.save` in four forms: Llama-style (after an Adam step through the DistributedOptimizer, so
the checkpoint also holds optimizer state), Qwen3-style with qk_layernorm in NeMo 2's singleton_local_shards
layout, and Qwen3-MoE-style (3 experts) stacked and singleton. Each goes:

- dcp-to-hf --mapping megatron-gpt: every HF tensor equals, bit for bit, what explicit torch expressions give
  from the model's own TP=1 state dict (QKV viewed per query group, fc1 chunked into gate and up, vocabulary
  rows narrowed, experts one by one); transformers loads it with no missing or unexpected keys and gives
  megatron's logits (bf16 tolerance);
- hf-to-dcp --mapping megatron-gpt back: megatron's own `dist_checkpointing.load` of the GPTModel's
  `sharded_state_dict()` (at TP=2 and at TP=1), then `load_state_dict(strict=True)`, gives the model's
  tensors exactly; the vocabulary's padding rows are zeros.

megatron-core runs only in subprocesses (support/megatron.py); each run costs 10-20 s, so the checkpoints are
built once per session and both loads read all of them in one run per TP size.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron import run_megatron, saved
from test_dcp_to_hf import load_dir, same_bits

from ckptconv.cli.app import main
from ckptconv.formats.dcp import open_dcp
from ckptconv.formats.megatron import BACKENDS, CHECKPOINT_VERSION
from ckptconv.plan.megatron import extra_state_objects

PRESET = "megatron-gpt"
# name -> the worker's gpt options
CASES: dict[str, tuple[str, ...]] = {
    "llama": (),  # the harness's "gpt": Megatron-LM's defaults (DistributedOptimizer, dp_reshardable)
    "qwen3_singleton": ("--qk-layernorm", "--singleton-local-shards", "--optimizer", "none"),
    "qwen3_moe": ("--moe", "--qk-layernorm", "--optimizer", "none"),
    "qwen3_moe_singleton": ("--moe", "--qk-layernorm", "--singleton-local-shards", "--optimizer", "none"),
}
TP_SIZES = (1, 2)


def cli(*argv: str) -> None:
    """`ckptconv ARGV` in this process; exit status 0 required."""
    try:
        main(list(argv))
    except SystemExit as exc:
        assert not exc.code, (argv, exc.code)


def hf_config(meg: dict[str, Any]) -> Any:
    """The transformers config of the model megatron built from `meg` (the worker's config.json): Llama,
    Qwen3 (qk_layernorm) or Qwen3-MoE (experts, top-k softmax renormalised as Megatron's router does)."""
    import transformers as tf

    common = {
        "vocab_size": meg["vocab_size"],
        "hidden_size": meg["hidden_size"],
        "intermediate_size": meg["ffn_hidden_size"],
        "num_hidden_layers": meg["num_layers"],
        "num_attention_heads": meg["num_attention_heads"],
        "num_key_value_heads": meg["num_query_groups"],
        "head_dim": meg["kv_channels"],
        "rms_norm_eps": meg["layernorm_epsilon"],
        "max_position_embeddings": meg["max_position_embeddings"],
        "rope_parameters": {"rope_type": "default", "rope_theta": float(meg["rotary_base"])},
        "tie_word_embeddings": meg["share_embeddings_and_output_weights"],
        "attention_bias": False,
    }
    if meg.get("num_moe_experts"):
        return tf.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=meg["moe_ffn_hidden_size"],
            num_experts=meg["num_moe_experts"],
            num_experts_per_tok=meg["moe_router_topk"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if meg["qk_layernorm"]:
        return tf.Qwen3Config(**common)
    return tf.LlamaConfig(**common, mlp_bias=False)


def hf_expected(model: dict[str, torch.Tensor], meg: dict[str, Any], fused: bool) -> dict[str, torch.Tensor]:
    """The HF tensors, from the GPTModel's TP=1 state dict by explicit torch: linear_qkv [G*(H/G+2)*hd, D]
    viewed [G, H/G+2, hd, D] and split into q, k, v; fc1 [2F, D] chunked into gate, up; the vocabulary's
    first `vocab_size` rows; experts per expert, or stacked [E, ...] when `fused`."""
    groups, heads, hd = meg["num_query_groups"], meg["num_attention_heads"], meg["kv_channels"]
    per = heads // groups
    out = {
        "model.embed_tokens.weight": model["embedding.word_embeddings.weight"][: meg["vocab_size"]],
        "lm_head.weight": model["output_layer.weight"][: meg["vocab_size"]],
        "model.norm.weight": model["decoder.final_layernorm.weight"],
    }
    for i in range(meg["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = model[src + "self_attention.linear_qkv.weight"]
        grouped = qkv.view(groups, per + 2, hd, qkv.shape[-1])
        out[dst + "self_attn.q_proj.weight"] = grouped[:, :per].reshape(-1, qkv.shape[-1])
        out[dst + "self_attn.k_proj.weight"] = grouped[:, per].reshape(-1, qkv.shape[-1])
        out[dst + "self_attn.v_proj.weight"] = grouped[:, per + 1].reshape(-1, qkv.shape[-1])
        out[dst + "self_attn.o_proj.weight"] = model[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = model[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = model[src + "pre_mlp_layernorm.weight"]
        if meg["qk_layernorm"]:
            out[dst + "self_attn.q_norm.weight"] = model[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = model[src + "self_attention.k_layernorm.weight"]
        if not meg.get("num_moe_experts"):
            gate, up = model[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
            out[dst + "mlp.down_proj.weight"] = model[src + "mlp.linear_fc2.weight"]
            continue
        out[dst + "mlp.gate.weight"] = model[src + "mlp.router.weight"]
        experts = [f"{src}mlp.experts.local_experts.{e}." for e in range(meg["num_moe_experts"])]
        if fused:
            out[dst + "mlp.experts.gate_up_proj"] = torch.stack(
                [model[e + "linear_fc1.weight"] for e in experts]
            )
            out[dst + "mlp.experts.down_proj"] = torch.stack(
                [model[e + "linear_fc2.weight"] for e in experts]
            )
            continue
        for e, name in enumerate(experts):
            gate, up = model[name + "linear_fc1.weight"].chunk(2, dim=0)
            out[f"{dst}mlp.experts.{e}.gate_proj.weight"] = gate
            out[f"{dst}mlp.experts.{e}.up_proj.weight"] = up
            out[f"{dst}mlp.experts.{e}.down_proj.weight"] = model[name + "linear_fc2.weight"]
    return out


class Case:
    """One checkpoint megatron wrote, its conversions, and what megatron loads back from them."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root / name
        self.root.mkdir()
        self.ckpt = saved("gpt", *CASES[name])  # shared with the other megatron tests
        self.hf = self.root / "hf"
        self.back = self.root / "back"

    @property
    def fused(self) -> bool:
        """Also converted to HF's fused experts: MoE in the stacked layout (the preset maps singleton experts
        to per-expert HF tensors only)."""
        meg = self.meg
        return bool(meg.get("num_moe_experts")) and not meg["singleton_local_shards"]

    @property
    def meg(self) -> dict[str, Any]:
        return json.loads((self.ckpt.parent / "config.json").read_text())

    @property
    def expected(self) -> dict[str, Any]:
        return torch.load(self.ckpt.parent / "expected.pt", weights_only=True)

    def loaded(self, tp: int) -> dict[str, Any]:
        return torch.load(self.root / f"loaded_tp{tp}.pt", weights_only=True)

    def convert(self) -> None:
        """dcp-to-hf (and --hf-experts fused for MoE), then hf-to-dcp back with Megatron's vocabulary
        padding (make_vocab_size_divisible_by x TP = 32 x 2, the model's) in config.json."""
        meg = self.meg
        cfg = self.root / "hf_config"
        hf_config(meg).save_pretrained(cfg)
        cli("dcp-to-hf", str(self.ckpt), str(self.hf), "--mapping", PRESET, "--copy-from", str(cfg))
        if self.fused:
            fused = ["--hf-experts", "fused", "--config", str(cfg / "config.json")]
            cli("dcp-to-hf", str(self.ckpt), str(self.root / "hf_fused"), "--mapping", PRESET, *fused)
        back_config = json.loads((cfg / "config.json").read_text())
        back_config["make_vocab_size_divisible_by"] = meg["make_vocab_size_divisible_by"]
        back_config["tensor_model_parallel_size"] = meg["tensor_model_parallel_size"]
        (self.root / "back_config.json").write_text(json.dumps(back_config))
        args = ("--mapping", PRESET, "--config", str(self.root / "back_config.json"))
        cli("hf-to-dcp", str(self.hf), str(self.back), *args)  # with metadata.json, common.pt, _extra_state


@pytest.fixture(scope="session")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """Every case saved by megatron, converted both ways, and loaded back by megatron at TP=1 and TP=2."""
    root = tmp_path_factory.mktemp("megatron_gpt")
    built = {name: Case(root, name) for name in CASES}
    for case in built.values():
        case.convert()
    for tp in TP_SIZES:
        args = []
        for case in built.values():
            args += [
                str(case.ckpt.parent / "config.json"),
                str(case.back),
                str(case.root / f"loaded_tp{tp}.pt"),
            ]
        run_megatron(tp, "load-gpt", *args)
    return built


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 precision: 2% of the largest logit (bf16 keeps 8 significant bits)."""
    assert got.shape == want.shape
    scale = want.abs().max().item()
    assert scale > 0.05, scale  # logits that say something
    assert (got - want).abs().max().item() <= 0.02 * scale


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_dcp_to_hf_bit_exact(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    meg, model = case.meg, case.expected["model"]
    variants = [(case.hf, False)] + ([(case.root / "hf_fused", True)] if case.fused else [])
    for directory, fused in variants:
        got, want = load_dir(directory), hf_expected(model, meg, fused)
        assert sorted(got) == sorted(want), directory
        for key, value in want.items():
            assert same_bits(got[key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_transformers_loads_with_megatrons_logits(cases: dict[str, Case], name: str) -> None:
    import transformers as tf

    case = cases[name]
    expected = case.expected
    model, info = tf.AutoModelForCausalLM.from_pretrained(
        case.hf, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(input_ids=expected["logits_tokens"]).logits
    assert_logits_close(logits, expected["logits"][..., : case.meg["vocab_size"]])


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_hf_to_dcp_writes_megatrons_stacked_keys(cases: dict[str, Case], name: str) -> None:
    """The way back writes the stacked layout (Megatron-LM's default) whatever the source's layout: the
    keys and shapes megatron's save gives the same model without singleton_local_shards, with Megatron's
    side files and its `_extra_state` objects."""
    case = cases[name]
    meg = case.meg
    L, E = meg["num_layers"], meg.get("num_moe_experts")
    hidden, ffn, hd = meg["hidden_size"], meg["ffn_hidden_size"], meg["kv_channels"]
    heads, groups = meg["num_attention_heads"], meg["num_query_groups"]
    want = {
        "embedding.word_embeddings.weight": (meg["padded_vocab_size"], hidden),
        "output_layer.weight": (meg["padded_vocab_size"], hidden),
        "decoder.final_layernorm.weight": (hidden,),
        "decoder.layers.self_attention.linear_qkv.weight": (L, (heads + 2 * groups) * hd, hidden),
        "decoder.layers.self_attention.linear_proj.weight": (L, hidden, heads * hd),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, hidden),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, hidden),
    }
    if meg["qk_layernorm"]:
        want["decoder.layers.self_attention.q_layernorm.weight"] = (L, hd)
        want["decoder.layers.self_attention.k_layernorm.weight"] = (L, hd)
    if E:
        F = meg["moe_ffn_hidden_size"]
        want["decoder.layers.mlp.router.weight"] = (L, E, hidden)
        want["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = (L, E, 2 * F, hidden)
        want["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = (L, E, hidden, F)
    else:
        want["decoder.layers.mlp.linear_fc1.weight"] = (L, 2 * ffn, hidden)
        want["decoder.layers.mlp.linear_fc2.weight"] = (L, hidden, ffn)
    spec = open_dcp(case.back)
    assert {k: tuple(t.shape) for k, t in spec.tensors.items()} == want
    if "singleton" not in name:  # the same keys and shapes as megatron's own save
        saved = {k: tuple(t.shape) for k, t in open_dcp(case.ckpt).tensors.items()}
        assert {k: v for k, v in saved.items() if not k.startswith("optimizer.")} == want
    assert json.loads((case.back / "metadata.json").read_text()) == BACKENDS
    common = torch.load(case.back / "common.pt", weights_only=True)
    iteration = torch.load(case.ckpt.parent / "expected.pt", weights_only=True)["common"]["iteration"]
    assert iteration == 1  # megatron's, through dcp-to-hf's stash and back
    assert common == {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    # the _extra_state objects megatron's load asks for, written by hf-to-dcp itself
    objects = {k for k in spec.items if "._extra_state/" in k}
    assert objects == set(extra_state_objects({k: tuple(t.shape) for k, t in spec.tensors.items()}))


@pytest.mark.slow
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_megatron_loads_the_way_back(cases: dict[str, Case], name: str, tp: int) -> None:
    """megatron's dist_checkpointing.load and load_state_dict(strict=True), at TP=tp, give every parameter
    bit for bit; the vocabulary rows past vocab_size are zeros (megatron's were untrained values), and the
    logits of the real vocabulary are megatron's (bit for bit at the TP size that saved it)."""
    case = cases[name]
    meg, expected, loaded = case.meg, case.expected, case.loaded(tp)
    vocab = meg["vocab_size"]
    assert sorted(loaded["model"]) == sorted(expected["model"])
    for key, want in expected["model"].items():
        got = loaded["model"][key]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert got.shape == want.shape and got.dtype == want.dtype, key
            assert same_bits(got[:vocab], want[:vocab]), key
            assert not got[vocab:].any(), key
        else:
            assert same_bits(got, want), key
    assert torch.equal(loaded["tokens"], expected["logits_tokens"])
    if tp == meg["tensor_model_parallel_size"]:  # the same computation as megatron's own: the same bits
        assert torch.equal(loaded["logits"][..., :vocab], expected["logits"][..., :vocab])
    assert_logits_close(loaded["logits"][..., :vocab], expected["logits"][..., :vocab])


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_extra_state_objects_are_megatrons(cases: dict[str, Case], name: str) -> None:
    """extra_state_objects names exactly the `_extra_state` items megatron's save wrote, in either layout,
    and their value is what those items hold."""
    case = cases[name]
    reader = _items(case.ckpt)
    saved = {k for k in reader if "._extra_state/" in k}
    assert saved == set(
        extra_state_objects({k: tuple(t.shape) for k, t in open_dcp(case.ckpt).tensors.items()})
    )
    assert all(reader[k]() == [None] for k in saved)


def _items(ckpt: Path) -> dict[str, Callable[[], Any]]:
    """Every non-tensor item of a DCP checkpoint: key -> a function loading it (weights_only)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    out: dict[str, Callable[[], Any]] = {}
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):

            def load(
                path: Path = ckpt / info.relative_path, at: int = info.offset, n: int = info.length
            ) -> Any:
                with open(path, "rb") as f:
                    f.seek(at)
                    return torch.load(io.BytesIO(f.read(n)), weights_only=True)

            out[index.fqn] = load
    return out
