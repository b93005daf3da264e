"""Megatron's hybrid Qwen3.5 / Qwen3-Next checkpoints (gated delta-net, gated attention, MoE, MTP) <-> HF,
with megatron-bridge 0.3.1's own mapping functions as the oracle (tests/support/bridge.py).

megatron-core cannot build a gated delta-net layer on CPU (it needs flash-linear-attention and CUDA), so the
checkpoints are built here: a tiny transformers 5 model (save_pretrained, float32), its Megatron tensors
computed by Bridge's functions (support/workers/gdn_megatron.py: merge_qkv_weights with the attention output
gate, merge_gdn_linear_weights, GDNConv1dMapping's indices, Bridge main's _fuse_gdn_separate_to_grouped
ported), then saved
- in torch_dist's layout (per-layer keys, GDN split into .query/.key/..., fc1 [gate; up], experts stacked)
  with dcp.save in this process;
- as Megatron-FSDP's fsdp_dtensor (support/workers/fsdp_dtensor_save.py): DTensors over gloo on 2 ranks
  under `model.module.`, GDN fused by the TP ranks of a TP=1 or TP=2 job, SwiGLU fc1 as weight_w / weight_v,
  experts per expert, with Megatron-LM's `args` / `iteration` / `checkpoint_version` items.

transformers 5.24 drops Qwen3.5's and Qwen3-Next's `mtp.*` weights (`_keys_to_ignore_on_load_unexpected`;
save_pretrained never writes them), so the MTP layer's HF tensors are made here (`_append_mtp`), and checked
bit for bit like the rest. Only the language model is mapped: Qwen3.5's vision tower is left out, and
transformers' Qwen3_5(Moe)ForCausalLM loads the result (it reads `model.language_model.*`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from bridge import megatron_tensors
from conftest import WORKERS, torchrun
from families import tiny
from safetensors.torch import load_file, save_file
from test_dcp_to_hf import load_dir, same_bits

from ckptconv.cli.app import main

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
PRESET = {
    "qwen3_5": "megatron-qwen3_5",
    "qwen3_5_moe": "megatron-qwen3_5",
    "qwen3_next": "megatron-qwen3_next",
}
CAUSAL_LM = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
MTP_FROM = 3  # the full-attention layer (the last of four) whose tensor shapes the MTP layer copies

pytestmark = pytest.mark.slow


def cli(*argv: str) -> int:
    """`ckptconv ARGV` in this process; its exit status."""
    try:
        main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _qwen3_next(path: Path) -> Path:
    import transformers as tf

    cfg = tf.Qwen3NextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tf.Qwen3NextForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


def _append_mtp(path: Path, prefix: str) -> None:
    """One MTP layer in HF's names (Bridge's qwen35_bridge / qwen3_next_bridge mappings): `mtp.fc` [D, 2D],
    its three norms [D], and `mtp.layers.0.*` shaped as the full-attention layer MTP_FROM, random values."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(1)
    layer = f"{prefix}layers.{MTP_FROM}."
    hidden = tensors[prefix + "norm.weight"].shape[0]
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden)}
    shapes |= {f"mtp.{n}.weight": (hidden,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    shapes |= {
        "mtp.layers.0." + k[len(layer) :]: tuple(v.shape) for k, v in tensors.items() if k.startswith(layer)
    }
    tensors |= {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    save_file(tensors, file, metadata={"format": "pt"})


class Case:
    """One family: its HF source, Bridge's Megatron tensors, and the checkpoints and conversions made once."""

    def __init__(self, root: Path, family: str) -> None:
        self.root, self.family, self.preset = root, family, PRESET[family]
        self.src = _qwen3_next(root / "hf") if family == "qwen3_next" else tiny(family, root / "hf")
        self.prefix = "model." if family == "qwen3_next" else "model.language_model."
        _append_mtp(self.src, self.prefix)
        self.config = self.src / "config.json"
        self.meg = megatron_tensors(self.src, family, (1, 2))
        self.torch_dist = root / "torch_dist"
        dcp.save(self.meg["split"], checkpoint_id=str(self.torch_dist))
        self._hf: dict[str, Path] = {}

    @property
    def moe(self) -> bool:
        return self.family != "qwen3_5"

    def expected(self) -> dict[str, torch.Tensor]:
        """The source's tensors the preset maps: every one but Qwen3.5's vision tower."""
        return {
            k: v
            for k, v in load_file(self.src / "model.safetensors").items()
            if not k.startswith("model.visual.")
        }

    def fsdp(self, tp: int, args: bool = True) -> Path:
        """The fsdp_dtensor checkpoint of the GDN fused at TP `tp` (with or without its `args` item)."""
        out = self.root / f"fsdp_tp{tp}{'' if args else '_noargs'}"
        if not out.exists():
            state = self.root / f"fused{tp}.pt"
            torch.save(self.meg[f"fused{tp}"], state)
            torchrun(
                2, str(WORKERS / "fsdp_dtensor_save.py"), str(state), str(out), str(tp) if args else "none"
            )
        return out

    def to_hf(self, ckpt: Path, *extra: str) -> Path:
        """dcp-to-hf of `ckpt` with the family's preset (float32 kept), once; config.json copied beside."""
        out = self.root / ("hf_" + ckpt.name + "".join(extra).replace("-", "_"))
        if out not in self._hf.values():
            argv = ("dcp-to-hf", str(ckpt), str(out), "--mapping", self.preset, "--config", str(self.config))
            assert cli(*argv, "--dtype", "keep", *extra) == 0
            shutil.copy(self.config, out / "config.json")
            self._hf[str(out)] = out
        return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    return {f: Case(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, bad


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_dist_to_hf_bit_exact(cases: dict[str, Case], family: str) -> None:
    case = cases[family]
    assert_same(load_dir(case.to_hf(case.torch_dist)), case.expected())


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_with_source_logits(cases: dict[str, Case], family: str) -> None:
    import transformers as tf

    case = cases[family]
    cls = getattr(tf, CAUSAL_LM[family])
    cfg = tf.AutoConfig.from_pretrained(case.src)
    cfg = cfg if family == "qwen3_next" else cfg.text_config
    got, info = cls.from_pretrained(case.to_hf(case.torch_dist), config=cfg, output_loading_info=True)
    want = cls.from_pretrained(case.src, config=cfg)
    assert info == {
        "missing_keys": set(),
        "unexpected_keys": set(),
        "mismatched_keys": set(),
        "error_msgs": [],
    }
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_model_layer_naming_reads_the_same(cases: dict[str, Case], family: str) -> None:
    """Megatron-LM before PR #6271 (and its dev branch) names the MTP inner layer `mtp_model_layer`."""
    case = cases[family]
    old = {k.replace(".transformer_layer.", ".mtp_model_layer."): v for k, v in case.meg["split"].items()}
    ckpt = case.root / "torch_dist_mtp_model_layer"
    dcp.save(old, checkpoint_id=str(ckpt))
    assert_same(load_dir(case.to_hf(ckpt)), case.expected())


GDN_INPUT_NORM = ".self_attention.in_proj.layer_norm_weight"
QKV_INPUT_NORM = ".self_attention.linear_qkv.layer_norm_weight"


def _back(case: Case, root: Path) -> dict[str, torch.Tensor]:
    """hf-to-dcp of the torch_dist conversion with the family's preset, every key it wrote loaded."""
    layout = ("--runtime-layout", "norm-separate") if case.moe else ()
    argv = ("hf-to-dcp", str(case.to_hf(case.torch_dist)), str(root), "--mapping", case.preset)
    assert cli(*argv, "--config", str(case.config), "--dtype", "keep", *layout) == 0
    meta = dcp.FileSystemReader(str(root)).read_metadata().state_dict_metadata
    shapes = {k: m for k, m in meta.items() if hasattr(m, "size")}
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in shapes.items()}
    dcp.load(tensors, checkpoint_id=str(root))
    return tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_dcp_gives_torch_dists_split_keys(cases: dict[str, Case], family: str, tmp_path: Path) -> None:
    """Every tensor of the torch_dist checkpoint bit for bit under its own key and no other key, GDN split
    keys, MTP and every layer's input norm included."""
    case = cases[family]
    assert_same(_back(case, tmp_path / "back"), case.meg["split"])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_config_with_only_the_interval_types_the_layers_alike(
    cases: dict[str, Case], family: str, tmp_path: Path
) -> None:
    """Qwen's released config.json gives `full_attention_interval` and no `layer_types` (transformers fills
    the list from it): with such a config, the release and the way back are those of the listed types."""
    case = cases[family]
    config = json.loads(case.config.read_text())
    text = config.get("text_config", config)
    assert text.pop("layer_types") == ["linear_attention"] * 3 + ["full_attention"]
    text["full_attention_interval"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hf"
    argv = ("dcp-to-hf", str(case.torch_dist), str(out), "--mapping", case.preset, "--dtype", "keep")
    assert cli(*argv, "--config", str(tmp_path / "config.json")) == 0
    want = case.to_hf(case.torch_dist) / "model.safetensors"
    assert (out / "model.safetensors").read_bytes() == want.read_bytes()
    layout = ("--runtime-layout", "norm-separate") if case.moe else ()
    argv = ("hf-to-dcp", str(out), str(tmp_path / "back"), "--mapping", case.preset, "--dtype", "keep")
    assert cli(*argv, *layout, "--config", str(tmp_path / "config.json")) == 0
    got = dcp.FileSystemReader(str(tmp_path / "back")).read_metadata().state_dict_metadata
    assert sorted(k for k in got if hasattr(got[k], "size")) == sorted(case.meg["split"])


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_dcp_names_a_delta_net_layers_input_norm(
    cases: dict[str, Case], family: str, tmp_path: Path
) -> None:
    """HF names every layer's input norm `input_layernorm`; Megatron names it by the layer's type, which
    config.json's layer_types gives (the preset's ranges `full` / `linear`): `in_proj.layer_norm_weight` on a
    gated delta-net layer, `linear_qkv.layer_norm_weight` on a full-attention one."""
    case = cases[family]
    got = _back(case, tmp_path / "back")
    config = json.loads(case.config.read_text())
    types = config.get("text_config", config)["layer_types"]
    assert "linear_attention" in types and "full_attention" in types
    for i, kind in enumerate(types):
        gdn = kind == "linear_attention"
        assert (f"decoder.layers.{i}{GDN_INPUT_NORM}" in got) == gdn, (i, kind)
        assert (f"decoder.layers.{i}{QKV_INPUT_NORM}" in got) != gdn, (i, kind)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", (1, 2))
def test_hf_to_dcp_fsdp_dtensor_gives_bridges_fused_gdn(
    cases: dict[str, Case], family: str, tp: int, tmp_path: Path
) -> None:
    """hf-to-dcp --format fsdp_dtensor --megatron-gdn fused --megatron-tp TP: under `model.module.`, every
    tensor Bridge's functions give for a job at TP (in_proj / conv1d fused by its ranks) bit for bit, and the
    `args` item has the language model's sizes (Qwen3.5's from text_config) and the TP."""
    case = cases[family]
    back = tmp_path / "back"
    argv = ("hf-to-dcp", str(case.to_hf(case.torch_dist)), str(back), "--mapping", case.preset)
    fused = ("--format", "fsdp_dtensor", "--megatron-gdn", "fused", "--megatron-tp", str(tp))
    assert cli(*argv, "--config", str(case.config), *fused) == 0
    items: dict[str, Any] = {"args": None}
    dcp.load(items, checkpoint_id=str(back), no_dist=True)
    text = json.loads(case.config.read_text())
    text = text.get("text_config", text)
    assert items["args"].tensor_model_parallel_size == tp
    assert items["args"].num_layers == text["num_hidden_layers"]
    assert items["args"].num_attention_heads == text["num_attention_heads"]
    want = {
        "model.module." + k: v for k, v in case.meg[f"fused{tp}"].items() if not k.endswith("_extra_state")
    }
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=str(back))
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, bad


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_dtensor_tp1_and_tp2_give_one_release(cases: dict[str, Case], family: str) -> None:
    case = cases[family]
    tp1, tp2 = case.to_hf(case.fsdp(1)), case.to_hf(case.fsdp(2))
    assert_same(load_dir(tp1), case.expected())
    assert (tp1 / "model.safetensors").read_bytes() == (tp2 / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])  # each HF layout (the MoE adds no GDN tensor)
def test_fused_gdn_without_its_tp_size_is_refused(
    cases: dict[str, Case], family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without `args` (as a Megatron-Bridge conversion has none) the directory is still Megatron-FSDP's by its
    GPTModel names under `model.module.`, but the fused GDN tensor's TP size is unknown: exit 2 naming the
    tensor and --megatron-tp, nothing written. Told the TP size, it gives the TP 2 release byte for byte."""
    case = cases[family]
    ckpt = case.fsdp(2, args=False)
    argv = ("dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--mapping", case.preset)
    argv += ("--config", str(case.config))
    assert cli(*argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "in_proj.weight" in err or "conv1d.weight" in err
    assert "pass --megatron-tp N (the TP size of the job that saved it)" in err
    assert not (tmp_path / "out").exists()
    told, saved = case.to_hf(ckpt, "--megatron-tp", "2"), case.to_hf(case.fsdp(2))
    assert (told / "model.safetensors").read_bytes() == (saved / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_tp_against_the_args_is_refused(
    cases: dict[str, Case], family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TP=2 fused checkpoint read as TP=1 would scramble q/k/v/z/b/a and still load: refused."""
    case = cases[family]
    argv = ("dcp-to-hf", str(case.fsdp(2)), str(tmp_path / "out"), "--mapping", case.preset)
    assert cli(*argv, "--config", str(case.config), "--megatron-tp", "1") == 2
    assert "--megatron-tp 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
