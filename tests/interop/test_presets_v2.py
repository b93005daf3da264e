"""Presets against the other projects' own code: a tiny transformers model of each family (families.py)
goes HF -> DCP with the preset, and the runtime tensors must be exactly the keys and shapes torchtitan 0.3.0's
model has and the values its StateDictAdapter.from_hf gives (where that adapter is right; where it is not, the
fixed math, and the set of keys it gets wrong is pinned). The runtime state, saved by one process and by two
ranks with experts split unevenly, converts back to the same bytes, bit-identical to the HF tensors;
transformers loads the result with no missing or unexpected keys and gives the same logits.

torchtitan runs in its own --no-deps install (support/titan.py): it needs triton and fla, which the main venv
does not carry.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS, torchrun, tree_sha256
from families import auto_class, tiny
from safetensors.torch import load_file, save_file
from test_bad_input import run
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain
from titan import run_adapter

# name: (transformers family, its options, torchtitan family, preset, keys torchtitan 0.3.0's adapter gets
# wrong or drops: a regex over runtime keys)
CASES = {
    "llama": ("llama", {}, "llama3", "torchtitan-llama3", ""),
    "llama_tied": ("llama", {"tie": True}, "llama3", "torchtitan-llama3", ""),
    "qwen3": ("qwen3", {}, "qwen3", "torchtitan-qwen3", ""),
    "qwen3_moe": ("qwen3", {"moe": True, "experts": 3}, "qwen3", "torchtitan-qwen3", ""),
    "deepseek_v3": ("deepseek_v3", {"experts": 3}, "deepseek_v3", "torchtitan-deepseek-v3", ""),
    "deepseek_v3_mtp": (
        "deepseek_v3",
        {"q_lora": False, "mtp": 1, "experts": 3},
        "deepseek_v3",
        "torchtitan-deepseek-v3",
        "",
    ),
    "gpt_oss": ("gpt_oss", {"experts": 3}, "gpt_oss", "torchtitan-gpt-oss", r"\.inner_experts\.mlp[12]_"),
    "qwen3_5": ("qwen3_5", {}, "qwen3_5", "torchtitan-qwen3_5", ""),
    "qwen3_5_moe": (
        "qwen3_5_moe",
        {"experts": 3},
        "qwen3_5",
        "torchtitan-qwen3_5",
        r"\.inner_experts\.w[123]_",
    ),
    "qwen3_5_moe_fused": (
        "qwen3_5_moe",
        {"fused_experts": True, "experts": 3},
        "qwen3_5",
        "torchtitan-qwen3_5",
        r"\.inner_experts\.w[123]_",
    ),
    "kimi_k25": ("kimi_k25", {"released": True, "experts": 3}, "kimi_k2_7", "torchtitan-kimi-k2_7", ""),
    "muse_glimmer": ("muse_glimmer", {}, "muse_glimmer", "torchtitan-muse-glimmer", ""),
}
# torchtitan's load-balancing bias, in the families where HF has no counterpart (DeepSeek's is the router's
# e_score_correction_bias)
NO_HF_COUNTERPART = {"qwen3_moe", "gpt_oss", "qwen3_5_moe", "qwen3_5_moe_fused"}


def fixed_experts(name: str, hf: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The runtime tensor `key` (one the 0.3.0 adapter gets wrong) from the HF tensors, by explicit torch."""
    layer = re.search(r"layers\.(\d+)\.", key).group(1)  # type: ignore[union-attr]
    if name == "gpt_oss":
        hf_name = {"mlp1_weight_EGD": "gate_up_proj", "mlp1_bias_EG": "gate_up_proj_bias"}
        hf_name |= {"mlp2_weight_EDF": "down_proj", "mlp2_bias_ED": "down_proj_bias"}
        value = hf[f"model.layers.{layer}.mlp.experts.{hf_name[key.rsplit('.', 1)[1]]}"]
        return value.transpose(1, 2) if value.dim() == 3 else value
    prefix = f"model.language_model.layers.{layer}.mlp.experts."
    which = key.rsplit(".", 1)[1]
    if prefix + "gate_up_proj" in hf:  # fused: [E, 2F, D] and [E, D, F]
        if which == "w2_EDF":
            return hf[prefix + "down_proj"]
        gate, up = hf[prefix + "gate_up_proj"].chunk(2, dim=1)
        return gate if which == "w1_EFD" else up
    name_of = {"w1_EFD": "gate_proj", "w3_EFD": "up_proj", "w2_EDF": "down_proj"}[which]
    count = len([k for k in hf if k.startswith(prefix) and k.endswith(f".{name_of}.weight")])
    return torch.stack([hf[f"{prefix}{e}.{name_of}.weight"] for e in range(count)])


def without_mtp_copies(hf_dir: Path, out: Path, config: dict) -> Path:
    """The HF files less DeepSeek's per-MTP-layer embedding and head copies, which torchtitan 0.3.0's
    adapter cannot read (it has no name for them and raises)."""
    out.mkdir()
    first = config["num_hidden_layers"]
    copy = re.compile(r"model\.layers\.(\d+)\.(embed_tokens|shared_head\.head)\.weight")
    for f in hf_dir.glob("*.safetensors"):
        tensors = load_file(f)
        kept = {
            k: v for k, v in tensors.items() if not ((m := copy.fullmatch(k)) and int(m.group(1)) >= first)
        }
        save_file(kept, out / f.name, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def logits(model: Any) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % model.config.get_text_config().vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_preset_against_torchtitan_and_transformers(name: str, tmp_path: Path, capsys) -> None:
    family, options, titan_family, preset, adapter_wrong = CASES[name]
    hf_dir = tiny(family, tmp_path / "hf", **options)
    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_dir(hf_dir)
    adapter_src = without_mtp_copies(hf_dir, tmp_path / "adapter_in", config) if "mtp" in name else hf_dir
    with ThreadPoolExecutor(2) as pool:
        model_job = pool.submit(run_adapter, titan_family, "model", config, hf_dir, tmp_path / "model.json")
        titan_job = pool.submit(run_adapter, titan_family, "from_hf", config, adapter_src, tmp_path / "t.st")
        code, err = run(
            capsys, "hf-to-dcp", str(hf_dir), str(tmp_path / "ckpt"), "--mapping", preset, "--verify"
        )
        assert code == 0, err
        model_job.result()
        titan_job.result()
    runtime = {k: v for k, v in load_plain(tmp_path / "ckpt").items() if isinstance(v, torch.Tensor)}
    # the keys and shapes of torchtitan's model, less the buffer HF has no counterpart for
    model = json.loads((tmp_path / "model.json").read_text())
    dropped = r"\.moe\.expert_bias_E$" if name in NO_HF_COUNTERPART else r"^$"
    wanted = {k: v[0] for k, v in model.items() if not re.search(dropped, k)}
    assert {k: list(v.shape) for k, v in runtime.items()} == wanted
    # the values torchtitan's adapter gives, where it is right; the keys it gets wrong are pinned
    titan = load_file(tmp_path / "t.st")
    wrong = sorted(k for k in runtime if k not in titan or titan[k].shape != runtime[k].shape)
    assert wrong == sorted(k for k in runtime if adapter_wrong and re.search(adapter_wrong, k)), wrong
    for key, value in runtime.items():
        expected = fixed_experts(name, hf, key) if key in wrong else titan[key]
        assert same_bits(value, expected), key
    # saved by one process and by two ranks (Shard(0): 3 experts split 2 + 1), back to HF: the same bytes
    torch.save(runtime, tmp_path / "state.pt")
    dcp.save({"model": runtime}, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    torchrun(2, str(WORKERS / "save_sharded_state.py"), str(tmp_path / "state.pt"), str(tmp_path / "two"))
    flags = ["--mapping", preset, "--copy-from", str(hf_dir), "--dtype", "keep", "--max-shard-size", "20KB"]
    # the HF files' expert layout (torchtitan-qwen3_5 writes Qwen's fused one unless told)
    flags += ["--hf-experts", "fused" if options.get("fused_experts") else "per_expert"]
    for ckpt in ("one", "two"):
        code, err = run(capsys, "dcp-to-hf", str(tmp_path / ckpt), str(tmp_path / f"hf_{ckpt}"), *flags)
        assert code == 0, err
    assert tree_sha256(tmp_path / "hf_one") == tree_sha256(tmp_path / "hf_two")
    back = load_dir(tmp_path / "hf_one")
    assert back.keys() == hf.keys()
    assert all(same_bits(back[k], hf[k]) for k in hf)
    ours, info = auto_class(family, **options).from_pretrained(tmp_path / "hf_one", output_loading_info=True)
    theirs, original = auto_class(family, **options).from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and info["unexpected_keys"] == original["unexpected_keys"], info
    first_mtp = f"model.layers.{config.get('num_hidden_layers')}."
    assert all(k.startswith(first_mtp) for k in info["unexpected_keys"])  # transformers has no MTP module
    assert torch.equal(logits(ours), logits(theirs))
