"""The megatron-deepseek-v3 preset against megatron-core 0.16.1's own torch_dist checkpoints and
Megatron-FSDP-style fsdp_dtensor checkpoints (issue #37, items 2 and 4).

torch_dist: a tiny DeepSeek-V3-style GPTModel (MLA, a dense then an MoE layer with shared experts and expert
bias, one MTP layer; local spec, bf16, TP=1) built and saved by megatron-core's own code
(tests/support/workers/megatron_deepseek.py, which says which two CPU stand-ins building MLA needs). The
expected HF tensors are the model's own state dict under Megatron-Bridge's DeepSeek mapping
(megatron/bridge/models/deepseek/common.py: names one to one, fc1 chunked into gate and up, experts one by
one, MTP layer m as HF layer num_hidden_layers + m), the vocabulary narrowed to vocab_size. megatron-core
0.16.1 cannot run MLA forward on CPU (its local DotProductAttention takes no k_channels / v_channels), so the
logits compared are transformers' own: the model built from the config with those tensors loaded, against
the converted release.

fsdp_dtensor: the same tensors under `model.module.` as Megatron-FSDP names them (fc1 `_w` / `_v`, experts per
expert, both MTP namings), DTensors saved by torch DCP over gloo on 2 ranks
(tests/support/workers/fsdp_dtensor_deepseek.py), read as ckptconv recognises them (the prefix stripped) and
written back with hf-to-dcp --format fsdp_dtensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import WORKERS, torchrun
from megatron import megatron_dir, run_megatron
from test_dcp_to_hf import load_dir, same_bits
from test_megatron_gpt import cli

PRESET = "megatron-deepseek-v3"
KEEP = ("--dtype", "keep")


def hf_config(meg: dict[str, Any]) -> Any:
    """transformers' DeepseekV3Config of the model megatron built from `meg` (the worker's config.json)."""
    import transformers as tf

    return tf.DeepseekV3Config(
        vocab_size=meg["vocab_size"],
        hidden_size=meg["hidden_size"],
        intermediate_size=meg["ffn_hidden_size"],
        moe_intermediate_size=meg["moe_ffn_hidden_size"],
        num_hidden_layers=meg["num_layers"],
        num_attention_heads=meg["num_attention_heads"],
        num_key_value_heads=meg["num_attention_heads"],
        n_shared_experts=meg["moe_shared_expert_intermediate_size"] // meg["moe_ffn_hidden_size"],
        n_routed_experts=meg["num_moe_experts"],
        routed_scaling_factor=meg["moe_router_topk_scaling_factor"],
        kv_lora_rank=meg["kv_lora_rank"],
        q_lora_rank=meg["q_lora_rank"],
        qk_rope_head_dim=meg["qk_pos_emb_head_dim"],
        qk_nope_head_dim=meg["qk_head_dim"],
        v_head_dim=meg["v_head_dim"],
        n_group=meg["moe_router_num_groups"],
        topk_group=meg["moe_router_group_topk"],
        num_experts_per_tok=meg["moe_router_topk"],
        first_k_dense_replace=meg["moe_layer_freq"].index(1),
        norm_topk_prob=True,
        rms_norm_eps=meg["layernorm_epsilon"],
        max_position_embeddings=meg["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(meg["rotary_base"])},
        tie_word_embeddings=False,
        num_nextn_predict_layers=meg["mtp_num_layers"],
    )


def hf_expected(model: dict[str, torch.Tensor], meg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The HF tensors from the GPTModel's state dict by Megatron-Bridge's DeepSeek mapping (see the module
    docstring), MTP layer m as HF layer L + m."""
    vocab, L = meg["vocab_size"], meg["num_layers"]
    out = {
        "model.embed_tokens.weight": model["embedding.word_embeddings.weight"][:vocab],
        "lm_head.weight": model["output_layer.weight"][:vocab],
        "model.norm.weight": model["decoder.final_layernorm.weight"],
    }
    names = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
        "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight",
    }
    glu = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts."}
    for key, value in model.items():
        if key.startswith("decoder.layers."):
            i, rest = key[len("decoder.layers.") :].split(".", 1)
            dst = f"model.layers.{i}."
        elif key.startswith("mtp.layers."):
            m, rest = key[len("mtp.layers.") :].split(".", 1)
            rest = rest.removeprefix("transformer_layer.")
            dst = f"model.layers.{L + int(m)}."
        else:
            continue
        expert = rest.removeprefix("mlp.experts.local_experts.")
        if expert != rest:
            e, leaf = expert.split(".", 1)
            if leaf == "linear_fc1.weight":
                gate, up = value.chunk(2, dim=0)
                out[f"{dst}mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{dst}mlp.experts.{e}.up_proj.weight"] = up
            else:
                out[f"{dst}mlp.experts.{e}.down_proj.weight"] = value
        elif rest in glu:
            gate, up = value.chunk(2, dim=0)
            out[dst + glu[rest] + "gate_proj.weight"], out[dst + glu[rest] + "up_proj.weight"] = gate, up
        else:
            out[dst + names[rest]] = value
    return out


class Saved:
    """megatron's checkpoint, its conversions, and the HF model the expected tensors make."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ckpt = root / "meg" / "ckpt"
        run_megatron(1, "deepseek", str(self.ckpt))
        self.meg = json.loads((self.ckpt.parent / "config.json").read_text())
        self.model = torch.load(self.ckpt.parent / "expected.pt", weights_only=True)["model"]
        self.want = hf_expected(self.model, self.meg)
        self.cfg = root / "hf_config"
        hf_config(self.meg).save_pretrained(self.cfg)
        back = json.loads((self.cfg / "config.json").read_text())
        back["make_vocab_size_divisible_by"] = self.meg["make_vocab_size_divisible_by"]
        (root / "back_config.json").write_text(json.dumps(back))
        self.hf = root / "hf"
        # --dtype keep: megatron's router keeps expert_bias in fp32, as DeepSeek's release does
        cli(
            "dcp-to-hf",
            str(self.ckpt),
            str(self.hf),
            "--mapping",
            PRESET,
            "--copy-from",
            str(self.cfg),
            *KEEP,
        )
        self.back = root / "back"
        cli(
            "hf-to-dcp",
            str(self.hf),
            str(self.back),
            "--mapping",
            PRESET,
            "--config",
            str(root / "back_config.json"),
            "--runtime-layout",
            "local",  # megatron-core built the model with the local spec
        )

    def source_model(self) -> Any:
        """transformers' own DeepseekV3ForCausalLM of the expected (non-MTP) tensors: from_pretrained of them
        saved as one safetensors file beside the config (bf16, expert_bias fp32 as megatron keeps it)."""
        import transformers as tf
        from safetensors.torch import save_file

        source = self.root / "source"
        source.mkdir(exist_ok=True)
        (source / "config.json").write_bytes((self.cfg / "config.json").read_bytes())
        first_mtp = f"model.layers.{self.meg['num_layers']}."
        main_only = {k: v.contiguous() for k, v in self.want.items() if not k.startswith(first_mtp)}
        save_file(main_only, source / "model.safetensors", metadata={"format": "pt"})
        model, info = tf.AutoModelForCausalLM.from_pretrained(source, output_loading_info=True, dtype="auto")
        assert not any(info.values()), info
        return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return Saved(tmp_path_factory.mktemp("megatron_deepseek"))


def _dcp_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint in full, through torch's own dcp.load (keys under `prefix`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)
    }
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {k[len(prefix) :]: v for k, v in state.items()}


@pytest.mark.slow
def test_torch_dist_to_hf_bit_exact(saved: Saved) -> None:
    got = load_dir(saved.hf)
    assert sorted(got) == sorted(saved.want)
    for key, value in saved.want.items():
        assert same_bits(got[key], value), key


@pytest.mark.slow
def test_release_is_what_save_pretrained_writes_and_loads_with_the_logits(
    saved: Saved, tmp_path: Path
) -> None:
    """transformers loads the release (MTP layer keys unexpected: it has no MTP module, as for DeepSeek's own
    files), every tensor save_pretrained writes for the source model is the release's bit for bit, and the
    logits are the source model's."""
    import transformers as tf

    source = saved.source_model()
    source.save_pretrained(tmp_path / "ref")
    got, ref = load_dir(saved.hf), load_dir(tmp_path / "ref")
    # transformers keeps the router's gate fp32 where the release has megatron's bf16: compared in its dtype
    for key, value in ref.items():
        assert same_bits(got[key].to(value.dtype), value), key
    first_mtp = f"model.layers.{saved.meg['num_layers']}."
    assert set(got) - set(ref) and all(k.startswith(first_mtp) for k in set(got) - set(ref))
    model, info = tf.AutoModelForCausalLM.from_pretrained(
        saved.hf, output_loading_info=True, dtype=torch.bfloat16
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(k.startswith(first_mtp) for k in info["unexpected_keys"]), info
    tokens = torch.randint(0, saved.meg["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, logits = source(input_ids=tokens).logits, model(input_ids=tokens).logits
    assert want.abs().max() > 0.05 and torch.equal(logits, want)


@pytest.mark.slow
def test_hf_to_dcp_gives_megatrons_torch_dist_tensors(saved: Saved) -> None:
    """The way back holds megatron's keys, shapes and dtypes, each tensor bit for bit (dcp.load); the padded
    vocabulary rows are zeros where megatron's were untrained values."""
    meg, back = _dcp_tensors(saved.ckpt), _dcp_tensors(saved.back)
    assert sorted(back) == sorted(meg)
    vocab = saved.meg["vocab_size"]
    for key, want in meg.items():
        got = back[key]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert got.shape == want.shape and same_bits(got[:vocab], want[:vocab]), key
            assert not got[vocab:].any(), key
        else:
            assert same_bits(got, want), key


@pytest.mark.slow
@pytest.mark.parametrize(  # each expert naming and each MTP naming; the way back for the local experts
    ("experts", "mtp"),
    [("local", "transformer_layer"), ("local", "mtp_model_layer"), ("grouped", "transformer_layer")],
)
def test_fsdp_dtensor_to_hf(saved: Saved, tmp_path: Path, experts: str, mtp: str) -> None:
    """A 2-rank fsdp_dtensor save of the same tensors gives the same release, byte for byte; hf-to-dcp back
    with --format fsdp_dtensor (and --runtime-layout mtp-model-layer) gives the source's tensors (local
    experts)."""
    ckpt = tmp_path / "fsdp"
    expected = saved.ckpt.parent / "expected.pt"
    megatron_dir()  # the worker takes megatron-core's uneven-DTensor code from it
    torchrun(2, str(WORKERS / "fsdp_dtensor_deepseek.py"), str(expected), str(ckpt), experts, mtp)
    out = tmp_path / "hf"
    cli("dcp-to-hf", str(ckpt), str(out), "--mapping", PRESET, "--copy-from", str(saved.cfg), *KEEP)
    for f in sorted(saved.hf.glob("*.safetensors")):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    if experts != "local":
        return
    layouts = ("--runtime-layout", "mtp-model-layer,local" if mtp == "mtp_model_layer" else "local")
    back = tmp_path / "back"
    config = ("--config", str(saved.root / "back_config.json"))
    fsdp = ("--format", "fsdp_dtensor", *layouts)
    cli("hf-to-dcp", str(out), str(back), "--mapping", PRESET, *config, *fsdp, *KEEP)
    source, got = _dcp_tensors(ckpt, "model.module."), _dcp_tensors(back, "model.module.")
    assert sorted(got) == sorted(source)
    vocab = saved.meg["vocab_size"]
    for key, want in source.items():
        n = vocab if key in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert same_bits(got[key][:n], want[:n]), key


@pytest.mark.slow
def test_a_base_holding_the_mtp_copies_gets_them_bit_exact(saved: Saved, tmp_path: Path) -> None:
    """DeepSeek's own files repeat the embedding and the head in each MTP layer: with --copy-from a base that
    holds them, the release has them too, narrowed to vocab_size like the main ones, bit for bit (without
    one, as above, it has none); hf-to-dcp checks them equal to the main ones and drops them."""
    from safetensors.torch import save_file

    mtp = f"model.layers.{saved.meg['num_layers']}."
    copies = {
        mtp + "embed_tokens.weight": saved.want["model.embed_tokens.weight"],
        mtp + "shared_head.head.weight": saved.want["lm_head.weight"],
    }
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_bytes((saved.cfg / "config.json").read_bytes())
    tensors = {k: v.contiguous().clone() for k, v in (saved.want | copies).items()}
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "hf"
    cli("dcp-to-hf", str(saved.ckpt), str(out), "--mapping", PRESET, "--copy-from", str(base), *KEEP)
    got = load_dir(out)
    assert sorted(got) == sorted(tensors)
    for key, value in tensors.items():
        assert same_bits(got[key], value), key
    back = tmp_path / "back"
    config = ("--config", str(saved.root / "back_config.json"))
    cli("hf-to-dcp", str(out), str(back), "--mapping", PRESET, *config, "--runtime-layout", "local")
    want, again = _dcp_tensors(saved.back), _dcp_tensors(back)
    assert sorted(again) == sorted(want)
    for key, value in want.items():
        assert same_bits(again[key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_dist", "fsdp_dtensor"])
def test_mtp_model_layer_in_either_format_round_trips(saved: Saved, tmp_path: Path, fmt: str) -> None:
    """--runtime-layout mtp-model-layer writes the inner MTP layer as `mtp_model_layer` in the format's own
    keys (torch_dist: fc1 [gate; up], experts stacked; fsdp_dtensor: fc1 `_w` / `_v`, one key per expert);
    dcp-to-hf of that gives the release back, bit for bit."""
    back = tmp_path / "back"
    config = ("--config", str(saved.root / "back_config.json"))
    fsdp = ("--format", "fsdp_dtensor") if fmt == "fsdp_dtensor" else ()
    cli("hf-to-dcp", str(saved.hf), str(back), "--mapping", PRESET, *config, *fsdp, *KEEP,
        "--runtime-layout", "mtp-model-layer")  # fmt: skip
    keys = sorted(_dcp_tensors(back, "model.module." if fsdp else ""))
    mtp = [k for k in keys if k.startswith("mtp.")]
    outer = ("enorm", "hnorm", "eh_proj", "final_layernorm")  # the modules around the inner layer
    assert mtp and all(".mtp_model_layer." in k for k in mtp if k.split(".")[3] not in outer)
    assert not any(".transformer_layer." in k for k in keys)
    fc1 = [k for k in mtp if "linear_fc1.weight" in k]
    halves = [k for k in fc1 if k.endswith(("_w", "_v"))]
    assert fc1 and (halves == fc1 if fsdp else not halves), fc1
    out = tmp_path / "hf"
    cli("dcp-to-hf", str(back), str(out), "--mapping", PRESET, "--copy-from", str(saved.cfg), *KEEP)
    want, got = load_dir(saved.hf), load_dir(out)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key


# the local spec's norm names -> TransformerEngine's (gpt_layer_specs.py, MLA with qk_layernorm): dense layers
# fuse the pre-MLP norm into fc1; MoE layers (and DeepSeek's MTP layer, an MoE layer) keep pre_mlp_layernorm
TE_NAMES = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}


@pytest.mark.slow
def test_transformer_engine_spec_is_written_by_default_and_read_back(saved: Saved, tmp_path: Path) -> None:
    """hf-to-dcp writes TransformerEngine's norm names (the spec Megatron-LM uses on GPU): the local-spec
    checkpoint's tensors under those names, bit for bit; dcp-to-hf reads them to the same release."""
    back = tmp_path / "back"
    cli(
        "hf-to-dcp",
        str(saved.hf),
        str(back),
        "--mapping",
        PRESET,
        "--config",
        str(saved.root / "back_config.json"),
    )
    dense = saved.meg["moe_layer_freq"].index(1)
    want = {}
    for key, value in _dcp_tensors(saved.back).items():
        for local, te in TE_NAMES.items():
            key = key.replace(local, te)
        if key.startswith("decoder.layers.") and int(key.split(".")[2]) < dense:
            key = key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        want[key] = value
    got = _dcp_tensors(back)
    assert sorted(got) == sorted(want)
    assert any(k.endswith("mlp.linear_fc1.layer_norm_weight") for k in got)
    assert any(k.startswith("decoder.") and k.endswith("pre_mlp_layernorm.weight") for k in got)
    for key, value in want.items():
        assert same_bits(got[key], value), key
    out = tmp_path / "hf"
    cli("dcp-to-hf", str(back), str(out), "--mapping", PRESET, "--copy-from", str(saved.cfg), *KEEP)
    release, again = load_dir(saved.hf), load_dir(out)
    assert sorted(again) == sorted(release)
    for key, value in release.items():
        assert same_bits(again[key], value), key
