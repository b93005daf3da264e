"""The torchtitan harness itself: tiny transformers checkpoints (families.py) and torchtitan 0.3.0's real
StateDictAdapters run out of process (titan.py, workers/titan_adapter.py).

What these pin down about torchtitan 0.3.0 against transformers 5.23 is written in EXPECTED below, one entry
per checkpoint; the tests fail when either side changes, so a preset comparison built on the harness notices.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import families
import pytest
import torch
from safetensors.torch import load_file, save_file
from titan import REQUIREMENTS, run_adapter, titan_dir

# checkpoint name -> (families.tiny family, its options, torchtitan family)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {}, "llama3"),
    "llama_tied": ("llama", {"tie": True}, "llama3"),
    "qwen3": ("qwen3", {}, "qwen3"),
    "qwen3_moe": ("qwen3", {"moe": True}, "qwen3"),
    "deepseek_v3": ("deepseek_v3", {}, "deepseek_v3"),
    "deepseek_v3_mtp": ("deepseek_v3", {"q_lora": False, "mtp": 1}, "deepseek_v3"),
    "gpt_oss": ("gpt_oss", {}, "gpt_oss"),
    "qwen3_5": ("qwen3_5", {}, "qwen3_5"),
    "qwen3_5_moe": ("qwen3_5_moe", {}, "qwen3_5"),
    "qwen3_5_moe_fused": ("qwen3_5_moe", {"fused_experts": True}, "qwen3_5"),
    "kimi_k25": ("kimi_k25", {}, "kimi_k2_7"),
    "kimi_k25_released": ("kimi_k25", {"released": True}, "kimi_k2_7"),
    "muse_glimmer": ("muse_glimmer", {}, "muse_glimmer"),
}

# A few saved tensors per checkpoint, as save_pretrained writes them (hidden 32, vocab 64; expert
# intermediate 8 so that [E, 2I, H] and [E, H, 2I] cannot be confused).
SAVED_SHAPES: dict[str, dict[str, list[int]]] = {
    "llama": {"model.layers.0.self_attn.k_proj.weight": [16, 32], "lm_head.weight": [64, 32]},
    "qwen3_moe": {
        # transformers 5.23 fuses experts in memory but saves them per expert again
        "model.layers.0.mlp.experts.3.gate_proj.weight": [8, 32],
        "model.layers.0.mlp.experts.3.down_proj.weight": [32, 8],
        "model.layers.0.self_attn.q_norm.weight": [8],
    },
    "deepseek_v3": {
        "model.layers.0.self_attn.q_a_proj.weight": [16, 32],
        "model.layers.0.self_attn.q_b_proj.weight": [48, 16],  # heads * (nope 8 + rope 4)
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": [20, 32],  # kv_lora 16 + rope 4
        "model.layers.0.self_attn.kv_b_proj.weight": [64, 16],  # heads * (nope 8 + v 8)
        "model.layers.1.mlp.experts.0.gate_proj.weight": [8, 32],
        "model.layers.1.mlp.gate.e_score_correction_bias": [4],
        "model.layers.1.mlp.shared_experts.up_proj.weight": [8, 32],
    },
    "deepseek_v3_mtp": {
        "model.layers.0.self_attn.q_proj.weight": [48, 32],
        "model.layers.2.eh_proj.weight": [32, 64],
        "model.layers.2.shared_head.head.weight": [64, 32],
        "model.layers.2.embed_tokens.weight": [64, 32],
        "model.layers.2.mlp.experts.3.down_proj.weight": [32, 8],
    },
    "gpt_oss": {
        # bf16 layout: [E, hidden, 2 * I] with gate and up interleaved on the last dim; down [E, I, hidden]
        "model.layers.0.mlp.experts.gate_up_proj": [4, 32, 48],
        "model.layers.0.mlp.experts.gate_up_proj_bias": [4, 48],
        "model.layers.0.mlp.experts.down_proj": [4, 24, 32],
        "model.layers.0.mlp.experts.down_proj_bias": [4, 32],
        "model.layers.0.self_attn.sinks": [4],
    },
    "qwen3_5": {
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": [64, 32],  # 2 * (2 * 8) + 4 * 8
        "model.language_model.layers.0.linear_attn.conv1d.weight": [64, 1, 4],
        "model.language_model.layers.0.linear_attn.A_log": [4],
        "model.language_model.layers.3.self_attn.q_proj.weight": [256, 32],  # heads * head_dim * 2 (gate)
        "model.visual.patch_embed.proj.weight": [16, 3, 2, 4, 4],  # Conv3d
        "model.visual.blocks.0.attn.qkv.weight": [48, 16],
        "model.visual.pos_embed.weight": [16, 16],
        "lm_head.weight": [64, 32],
    },
    "qwen3_5_moe": {
        "model.language_model.layers.0.mlp.experts.0.gate_proj.weight": [8, 32],
        "model.language_model.layers.0.mlp.shared_expert_gate.weight": [1, 32],
    },
    "qwen3_5_moe_fused": {
        "model.language_model.layers.0.mlp.experts.gate_up_proj": [4, 16, 32],
        "model.language_model.layers.0.mlp.experts.down_proj": [4, 32, 8],
    },
    "kimi_k25": {
        # save_pretrained's own spelling; see families._KIMI_RELEASED
        "language_model.model.blocks.0.self_attn.q_b_proj.weight": [48, 16],
        "language_model.lm_head.weight": [64, 32],
        "vision_tower.encoder.blocks.0.wqkv.weight": [48, 16],
        "vision_tower.encoder.patch_embed.proj.weight": [16, 3, 4, 4],  # Conv2d
        "vision_tower.patch_embed.pos_emb.weight": [4, 4, 16],
        "model.mm_projector.pre_norm.weight": [16],
        "mm_projector.proj.0.weight": [64, 64],
    },
    "kimi_k25_released": {
        "language_model.model.layers.1.mlp.experts.0.up_proj.weight": [8, 32],
        "vision_tower.patch_embed.proj.weight": [16, 3, 4, 4],
        "mm_projector.pre_norm.weight": [16],
    },
    "muse_glimmer": {
        "model.language_model.layers.3.self_attn.gate_proj.weight": [32, 32],
        "model.language_model.layers.0.mlp.gate_proj.weight": [96, 32],
        "model.vision_tower.patch_embedder.patch_embedding.weight": [16, 96],  # Linear, 2 * 3 * 4 * 4
        "model.vision_tower.patch_embedder.position_embedding_table.weight": [16, 16],
        "model.vision_adapter.fc1.weight": [32, 64],
        "model.vision_projection.weight": [32, 32],
    },
}


def pattern(key: str) -> str:
    """A key with its layer and expert numbers as N."""
    return re.sub(r"\.\d+(?=\.|$)", ".N", key)


def patterns(keys: Any) -> set[str]:
    return {pattern(k) for k in keys}


_ROOT: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Where `checkpoint` and `titan` keep what they make, once per module run."""
    _ROOT.append(tmp_path_factory.mktemp("titan"))
    yield
    _ROOT.clear()
    for cached in (checkpoint, reference_state, titan):
        cached.cache_clear()


@cache
def checkpoint(name: str) -> Path:
    """The tiny checkpoint `name` (saved once per module run); `titan` writes its results beside it."""
    family, options, _ = CASES[name]
    return families.tiny(family, _ROOT[-1] / name / "hf", **options)


def read_hf(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def load_into_transformers(name: str, tensors: dict[str, torch.Tensor], where: Path) -> tuple[Any, dict]:
    """`tensors` as the weights of a copy of checkpoint `name` (its config), loaded by from_pretrained."""
    family, options, _ = CASES[name]
    shutil.copytree(checkpoint(name), where)
    for file in where.glob("*.safetensors"):
        file.unlink()
    save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
    return families.auto_class(family, **options).from_pretrained(
        where, output_loading_info=True, dtype=torch.float32
    )


@cache
def reference_state(name: str) -> dict[str, torch.Tensor]:
    """The state_dict transformers builds from checkpoint `name` itself."""
    family, options, _ = CASES[name]
    model = families.auto_class(family, **options).from_pretrained(checkpoint(name), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------------
# the tiny checkpoints


@pytest.mark.parametrize("name", CASES)
def test_tiny_saves_and_transformers_loads_it_back(name: str, tmp_path: Path) -> None:
    family, options, _ = CASES[name]
    started = time.monotonic()
    path = families.tiny(family, tmp_path / "hf", **options)
    assert time.monotonic() - started < 10  # < 2 s once transformers is imported
    saved = read_hf(path)
    assert {t.dtype for t in saved.values()} == {torch.float32}
    for key, shape in SAVED_SHAPES.get(name, {}).items():
        assert list(saved[key].shape) == shape, key
    model, info = families.auto_class(family, **options).from_pretrained(
        path, output_loading_info=True, dtype=torch.float32
    )
    assert type(model).__name__ == families.CLASSES["qwen3_moe" if options.get("moe") else family][0]
    problems = {k: sorted(v) for k, v in info.items() if v}
    if name == "deepseek_v3_mtp":
        # DeepseekV3ForCausalLM only ignores r"model\.layers\.61.*" (the 671B checkpoint's MTP layer), so a
        # checkpoint of another depth gets its MTP layer reported as unexpected (after transformers fused
        # its experts) and dropped. transformers' separate MtpModel (generate(use_mtp=True)) looks for layer
        # 61 only as well.
        mtp = {k for k in saved if k.startswith("model.layers.2.") and ".mlp.experts." not in k}
        mtp |= {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"}
        assert set(problems.pop("unexpected_keys")) == mtp
    assert problems == {}
    # Bit-exact: saving what was loaded gives the same tensors (after the same layout rewrite tiny did).
    model.save_pretrained(tmp_path / "again")
    again = read_hf(tmp_path / "again")
    if options.get("fused_experts"):
        again = families._fuse_experts(again)
    if options.get("released"):
        again = families._kimi_released(again)
    if options.get("mtp"):
        saved = {k: v for k, v in saved.items() if not k.startswith("model.layers.2.")}
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[k], saved[k]) for k in saved)


def test_tiny_is_seeded(tmp_path: Path) -> None:
    a = read_hf(families.tiny("deepseek_v3", tmp_path / "a", mtp=1))
    b = read_hf(families.tiny("deepseek_v3", tmp_path / "b", mtp=1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize(
    "rules",
    [
        [],  # save_pretrained's own: language_model.model.blocks.N, model.mm_projector.pre_norm, ...
        list(families._KIMI_RELEASED),  # the released Kimi-K2.5 names
        # what KimiK25StateDictAdapter.from_hf also takes: language_model.layers.N without model.
        [*families._KIMI_RELEASED, (r"^language_model\.model\.layers\.", "language_model.layers.")],
        # the in-memory names
        [
            (r"^language_model\.model\.blocks\.", "model.language_model.layers."),
            (r"^language_model\.model\.", "model.language_model."),
            (r"^language_model\.lm_head\.", "lm_head."),
        ],
    ],
    ids=["save_pretrained", "released", "language_model.layers", "model.language_model"],
)
def test_kimi_k25_loader_takes_every_spelling(rules: list[tuple[str, str]], tmp_path: Path) -> None:
    renamed = {}
    for key, value in read_hf(checkpoint("kimi_k25")).items():
        for old, new in rules:
            key = re.sub(old, new, key)
        renamed[key] = value
    model, info = load_into_transformers("kimi_k25", renamed, tmp_path / "hf")
    assert not any(info.values()), info
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference_state("kimi_k25").items())


# ---------------------------------------------------------------------------------------------------------
# torchtitan 0.3.0's adapters


@pytest.mark.slow  # the first call installs 1.1 GB (triton)
def test_titan_dir_holds_the_pins() -> None:
    pins = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    pins = [p for p in pins if p]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", p) for p in pins), pins

    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "_", name).lower()

    installed = {
        (canonical(d.name.split("-")[0]), d.name.removesuffix(".dist-info").split("-")[1])
        for d in titan_dir().glob("*.dist-info")
    }
    assert installed == {(canonical(p.split("==")[0]), p.split("==")[1]) for p in pins}


@cache
def titan(name: str) -> dict[str, Path | str]:
    """torchtitan's adapter on checkpoint `name`, every direction; a direction that failed maps to its error.

    model: the runtime keys and shapes; load: what torchtitan's own HF load hands the model; from_hf: the
    adapter on every HF tensor; round_trip: to_hf of from_hf; resave: to_hf of load (a load, then an HF
    save)."""
    _, _, family = CASES[name]
    src = checkpoint(name)
    config = json.loads((src / "config.json").read_text())
    out = src.parent
    done: dict[str, Path | str] = {}

    def run(direction: str, source: Path, dst: Path, key: str | None = None) -> None:
        try:
            run_adapter(family, direction, config, source, dst)
            done[key or direction] = dst
        except Exception as e:  # RuntimeError with the worker's output, or a timeout
            done[key or direction] = f"{type(e).__name__}: {e}"

    titan_dir()
    with ThreadPoolExecutor(3) as pool:
        for direction, dst in (
            ("model", "model.json"),
            ("load", "loaded.safetensors"),
            ("from_hf", "runtime.safetensors"),
        ):
            pool.submit(run, direction, src, out / dst)
    with ThreadPoolExecutor(2) as pool:
        for source, dst, key in (
            ("from_hf", "round_trip.safetensors", "round_trip"),
            ("load", "resave.safetensors", "resave"),
        ):
            if isinstance(done[source], Path):
                pool.submit(run, "to_hf", done[source], out / dst, key)
            else:
                done[key] = f"no {source}"
    return done


def shapes_of(result: Path) -> dict[str, list[int]]:
    if result.suffix == ".json":
        return {k: v[0] for k, v in json.loads(result.read_text()).items()}
    return {k: list(v.shape) for k, v in load_file(result).items()}


def compare_hf(hf: dict[str, torch.Tensor], back: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    return {
        "dropped": sorted(patterns(set(hf) - set(back))),
        "changed": sorted(patterns(k for k in hf if k in back and not torch.equal(back[k], hf[k]))),
        "added": sorted(patterns(set(back) - set(hf))),
    }


def observe(name: str, tmp_path: Path) -> dict[str, Any]:
    """What torchtitan did with checkpoint `name`, as key patterns; a failed direction as its error text.

    from_hf / load: runtime keys not in the model, model keys left out (at their init after torchtitan's
    load_state_dict(strict=False)), keys of the wrong shape. round_trip / resave: HF keys to_hf dropped,
    changed (not bit-exact) or added. in_transformers: from_pretrained of resave, its loading info and the
    parameters that differ from loading the checkpoint itself."""
    runs = titan(name)
    hf = read_hf(checkpoint(name))
    assert isinstance(runs["model"], Path), runs["model"]
    model = shapes_of(runs["model"])
    seen: dict[str, Any] = {}
    for direction in ("from_hf", "load"):
        if isinstance(runs[direction], str):
            seen[direction] = runs[direction]
            continue
        got = shapes_of(runs[direction])  # type: ignore[arg-type]
        seen[direction] = {
            "not_in_model": sorted(patterns(set(got) - set(model))),
            "left_out": sorted(patterns(set(model) - set(got))),
            "wrong_shape": sorted(patterns(k for k in got if k in model and got[k] != model[k])),
        }
    for direction in ("round_trip", "resave"):
        result = runs[direction]
        seen[direction] = result if isinstance(result, str) else compare_hf(hf, load_file(result))
    result = runs["resave"]
    if isinstance(result, str):
        seen["in_transformers"] = "no resave"
    else:
        model_, info = load_into_transformers(name, load_file(result), tmp_path / "resave")
        state = model_.state_dict()
        seen["in_transformers"] = {k: sorted(patterns(v)) for k, v in info.items()}
        seen["in_transformers"]["differ"] = sorted(
            patterns(k for k, v in reference_state(name).items() if not torch.equal(state[k], v))
        )
    return seen


_GPT_OSS_EXPERTS = [
    "layers.N.moe.routed_experts.inner_experts.mlp1_bias_EG",
    "layers.N.moe.routed_experts.inner_experts.mlp1_weight_EGD",
    "layers.N.moe.routed_experts.inner_experts.mlp2_bias_ED",
    "layers.N.moe.routed_experts.inner_experts.mlp2_weight_EDF",
]
_QWEN3_5_EXPERTS = [
    "layers.N.moe.routed_experts.inner_experts.w1_EFD",
    "layers.N.moe.routed_experts.inner_experts.w2_EDF",
    "layers.N.moe.routed_experts.inner_experts.w3_EFD",
]
_MTP_TRANSFORMERS_IGNORES = sorted(
    patterns(
        f"model.layers.2.{k}"
        for k in (
            "eh_proj.weight",
            "enorm.weight",
            "hnorm.weight",
            "shared_head.norm.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight",
            "self_attn.kv_b_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight",
            "mlp.shared_experts.down_proj.weight",
        )
    )
)

# What torchtitan 0.3.0 does with each tiny checkpoint (see `observe`). A missing field means nothing there:
# every HF tensor round-trips bit-exactly, the model gets every runtime key at its shape, and transformers
# loads the result with no missing or unexpected keys and the checkpoint's own values. A string is a
# fragment of the error that direction fails with.
EXPECTED: dict[str, dict[str, Any]] = {
    "llama": {},
    # from_hf copies embed_tokens to lm_head (enable_weight_tying); to_hf leaves lm_head out again
    "llama_tied": {},
    "qwen3": {},
    # expert_bias_E: torchtitan's load-balancing bias, which HF Qwen3-MoE has no tensor for; the qwen3 adapter
    # does not map it, so a load leaves it at its init (zeros).
    "qwen3_moe": {
        "from_hf": {"left_out": ["layers.N.moe.expert_bias_E"]},
        "load": {"left_out": ["layers.N.moe.expert_bias_E"]},
    },
    "deepseek_v3": {},
    # The adapter maps the MTP layer's enorm, hnorm, eh_proj and shared_head.norm (to mtp_layers.N.*) but not
    # its copies of embed_tokens and shared_head.head, and from_hf raises on any key it has no mapping for.
    # torchtitan's own load never passes it those: it reads only the keys to_hf of its model names, so the
    # load works, and its HF save leaves the two copies out.
    "deepseek_v3_mtp": {
        "from_hf": "KeyError: 'model.layers.{}.embed_tokens.weight'",
        "round_trip": "no from_hf",
        "resave": {
            "dropped": ["model.layers.N.embed_tokens.weight", "model.layers.N.shared_head.head.weight"]
        },
        # as for the checkpoint itself (test_tiny_saves_and_transformers_loads_it_back)
        "in_transformers": {"unexpected_keys": _MTP_TRANSFORMERS_IGNORES},
    },
    # The 0.3.0 gpt_oss adapter maps the MXFP4 names (gate_up_proj_blocks, down_proj_blocks) to
    # inner_experts.mlp1_weight / mlp2_weight and the biases to mlp1_bias / mlp2_bias, but the parameters
    # of GptOssGroupedExperts are mlp1_weight_EGD, mlp1_bias_EG, mlp2_weight_EDF and mlp2_bias_ED. So the
    # bf16 routed experts (gate_up_proj, down_proj) are dropped, the biases go to names the model does not
    # have, and torchtitan's load (strict=False) leaves all four at their init without a word; its HF save
    # has no experts.
    "gpt_oss": {
        "from_hf": {
            "not_in_model": [
                "layers.N.moe.routed_experts.inner_experts.mlp1_bias",
                "layers.N.moe.routed_experts.inner_experts.mlp2_bias",
            ],
            "left_out": sorted(["layers.N.moe.expert_bias_E", *_GPT_OSS_EXPERTS]),
        },
        "load": {"left_out": sorted(["layers.N.moe.expert_bias_E", *_GPT_OSS_EXPERTS])},
        "round_trip": {
            "dropped": ["model.layers.N.mlp.experts.down_proj", "model.layers.N.mlp.experts.gate_up_proj"]
        },
        "resave": {
            "dropped": [
                "model.layers.N.mlp.experts.down_proj",
                "model.layers.N.mlp.experts.down_proj_bias",
                "model.layers.N.mlp.experts.gate_up_proj",
                "model.layers.N.mlp.experts.gate_up_proj_bias",
            ]
        },
        "in_transformers": {
            "missing_keys": [
                "model.layers.N.mlp.experts.down_proj",
                "model.layers.N.mlp.experts.down_proj_bias",
                "model.layers.N.mlp.experts.gate_up_proj",
                "model.layers.N.mlp.experts.gate_up_proj_bias",
            ],
            # freshly initialised by transformers (the biases happen to init to the checkpoint's zeros)
            "differ": ["model.layers.N.mlp.experts.down_proj", "model.layers.N.mlp.experts.gate_up_proj"],
        },
    },
    "qwen3_5": {},
    # transformers 5.23 saves Qwen3.5-MoE experts per expert; the qwen3_5 adapter only knows the fused
    # mlp.experts.gate_up_proj / down_proj and skips other keys silently, so from_hf drops every routed
    # expert, and torchtitan's load (which asks for the fused names) fails.
    "qwen3_5_moe": {
        "from_hf": {"left_out": sorted(["layers.N.moe.expert_bias_E", *_QWEN3_5_EXPERTS])},
        "load": "missing model.language_model.layers.0.mlp.experts.gate_up_proj",
        "round_trip": {
            "dropped": [
                "model.language_model.layers.N.mlp.experts.N.down_proj.weight",
                "model.language_model.layers.N.mlp.experts.N.gate_proj.weight",
                "model.language_model.layers.N.mlp.experts.N.up_proj.weight",
            ]
        },
        "resave": "no load",
        "in_transformers": "no resave",
    },
    # The fused layout transformers' own parameters have (and from_pretrained takes): gate_up_proj
    # [E, 2I, H], down_proj [E, H, I]. The adapter assumes [E, H, 2I] and [E, I, H] (chunk on the last dim,
    # then transpose), so from_hf gives w1/w3 [E, H/2, 2I] and w2 [E, I, H] for the model's [E, I, H] and
    # [E, H, I], and torchtitan's load refuses the shapes. (Its to_hf inverts its own from_hf bit-exactly.)
    "qwen3_5_moe_fused": {
        "from_hf": {"left_out": ["layers.N.moe.expert_bias_E"], "wrong_shape": _QWEN3_5_EXPERTS},
        "load": "shape of model.language_model.layers.0.mlp.experts.gate_up_proj: checkpoint [4, 16, 32], "
        "model [4, 32, 16]",
        "resave": "no load",
        "in_transformers": "no resave",
    },
    # save_pretrained's own Kimi spelling (families._KIMI_RELEASED) is not the released one the adapter maps.
    "kimi_k25": {
        "from_hf": "vision key(s) have no mapping: ['vision_tower.encoder.patch_embed.proj.bias', "
        "'vision_tower.encoder.patch_embed.proj.weight']",
        "load": "missing language_model.model.layers.0.self_attn.q_a_proj.weight",
        "round_trip": "no from_hf",
        "resave": "no load",
        "in_transformers": "no resave",
    },
    "kimi_k25_released": {},
    "muse_glimmer": {},
}
_EMPTY = {
    "from_hf": {"not_in_model": [], "left_out": [], "wrong_shape": []},
    "load": {"not_in_model": [], "left_out": [], "wrong_shape": []},
    "round_trip": {"dropped": [], "changed": [], "added": []},
    "resave": {"dropped": [], "changed": [], "added": []},
    "in_transformers": {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
        "differ": [],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_titan_adapter(name: str, tmp_path: Path) -> None:
    seen = observe(name, tmp_path)
    for part, empty in _EMPTY.items():
        expected = EXPECTED[name].get(part, {})
        if isinstance(expected, str):
            assert isinstance(seen[part], str) and expected in seen[part], (part, seen[part])
        else:
            assert seen[part] == {**empty, **expected}, part


def interleave_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a q/k projection -> adjacent pairs (torchtitan's ComplexRoPE), per head:
    the `_reverse_permute` of torchtitan's llama3 adapter, written out."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_llama(hf: dict, rt: dict) -> None:
    assert torch.equal(
        rt["layers.1.attention.qkv_linear.wq.weight"],
        interleave_rows(hf["model.layers.1.self_attn.q_proj.weight"], 4),
    )
    assert torch.equal(
        rt["layers.1.attention.qkv_linear.wk.weight"],
        interleave_rows(hf["model.layers.1.self_attn.k_proj.weight"], 2),
    )
    assert torch.equal(
        rt["layers.1.attention.qkv_linear.wv.weight"], hf["model.layers.1.self_attn.v_proj.weight"]
    )
    assert torch.equal(rt["layers.0.feed_forward.w1.weight"], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(rt["layers.0.feed_forward.w3.weight"], hf["model.layers.0.mlp.up_proj.weight"])


def check_qwen3_moe(hf: dict, rt: dict) -> None:
    # CosSinRoPE is rotate-half like HF: no permute; experts stacked on a new dim 0
    assert torch.equal(
        rt["layers.0.attention.qkv_linear.wq.weight"], hf["model.layers.0.self_attn.q_proj.weight"]
    )
    for w, proj in (("w1_EFD", "gate_proj"), ("w3_EFD", "up_proj"), ("w2_EDF", "down_proj")):
        stacked = torch.stack([hf[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] for e in range(4)])
        assert torch.equal(rt[f"layers.1.moe.routed_experts.inner_experts.{w}"], stacked)


def check_deepseek_v3(hf: dict, rt: dict) -> None:
    # MLA: plain renames (HF's rope_interleave checkpoints are already in ComplexRoPE's pair order)
    assert torch.equal(
        rt["layers.0.attention.wkv_a.weight"], hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    )
    assert torch.equal(rt["layers.0.attention.wq_b.weight"], hf["model.layers.0.self_attn.q_b_proj.weight"])
    assert torch.equal(
        rt["layers.1.moe.expert_bias_E"], hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    )
    stacked = torch.stack([hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(4)])
    assert torch.equal(rt["layers.1.moe.routed_experts.inner_experts.w2_EDF"], stacked)


def check_deepseek_v3_mtp(hf: dict, rt: dict) -> None:
    # layer num_hidden_layers + i -> mtp_layers.i; shared_head.norm -> mtp_norm
    assert torch.equal(rt["mtp_layers.0.eh_proj.weight"], hf["model.layers.2.eh_proj.weight"])
    assert torch.equal(rt["mtp_layers.0.mtp_norm.weight"], hf["model.layers.2.shared_head.norm.weight"])
    assert torch.equal(rt["mtp_layers.0.attention.wq.weight"], hf["model.layers.2.self_attn.q_proj.weight"])
    stacked = torch.stack([hf[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
    assert torch.equal(rt["mtp_layers.0.moe.routed_experts.inner_experts.w1_EFD"], stacked)


def check_qwen3_5(hf: dict, rt: dict) -> None:
    p = "model.language_model.layers."
    q, k, v = hf[p + "0.linear_attn.in_proj_qkv.weight"].split([16, 16, 32])  # key 2 * 8, value 4 * 8
    assert torch.equal(rt["layers.0.attn.in_proj_q.weight"], q)
    assert torch.equal(rt["layers.0.attn.in_proj_k.weight"], k)
    assert torch.equal(rt["layers.0.attn.in_proj_v.weight"], v)
    assert torch.equal(rt["layers.0.attn.conv_v.weight"], hf[p + "0.linear_attn.conv1d.weight"][32:])
    assert torch.equal(
        rt["layers.3.attn.wq.weight"], hf[p + "3.self_attn.q_proj.weight"]
    )  # q and gate, as is
    for part, fused in zip("qkv", hf["model.visual.blocks.1.attn.qkv.bias"].chunk(3), strict=True):
        assert torch.equal(rt[f"vision_encoder.layers.1.attn.w{part}.bias"], fused)
    patch = hf["model.visual.patch_embed.proj.weight"]  # Conv3d [16, 3, 2, 4, 4] -> Linear [16, 96]
    assert torch.equal(rt["vision_encoder.patch_embed.weight"], patch.reshape(16, -1))


def check_kimi_k25_released(hf: dict, rt: dict) -> None:
    for part, fused in zip("qkv", hf["vision_tower.encoder.blocks.1.wqkv.weight"].chunk(3), strict=True):
        assert torch.equal(rt[f"vision_encoder.layers.1.attn.w{part}.weight"], fused)
    assert torch.equal(
        rt["vision_encoder.layers.0.norm1.weight"], hf["vision_tower.encoder.blocks.0.norm0.weight"]
    )
    assert torch.equal(
        rt["vision_encoder.layers.0.mlp.linear_fc2.weight"],
        hf["vision_tower.encoder.blocks.0.mlp.fc1.weight"],
    )
    patch = hf["vision_tower.patch_embed.proj.weight"]  # Conv2d [16, 3, 4, 4] -> Linear [16, 48]
    assert torch.equal(rt["vision_encoder.patch_embed.weight"], patch.reshape(16, -1))
    assert torch.equal(
        rt["vision_encoder.pos_embed"], hf["vision_tower.patch_embed.pos_emb.weight"]
    )  # [4, 4, 16]
    assert torch.equal(rt["vision_encoder.projector.linear_1.weight"], hf["mm_projector.proj.0.weight"])
    assert torch.equal(
        rt["layers.1.attention.wkv_b.weight"], hf["language_model.model.layers.1.self_attn.kv_b_proj.weight"]
    )
    assert torch.equal(rt["lm_head.weight"], hf["language_model.lm_head.weight"])


def check_muse_glimmer(hf: dict, rt: dict) -> None:
    t, v = "model.language_model.layers.", "model.vision_tower.layers."
    assert torch.equal(
        rt["layers.2.attention.qkv_linear.wq.weight"], interleave_rows(hf[t + "2.self_attn.q_proj.weight"], 4)
    )
    assert torch.equal(
        rt["layers.2.attention.qkv_linear.wk.weight"], interleave_rows(hf[t + "2.self_attn.k_proj.weight"], 2)
    )
    assert torch.equal(rt["layers.2.attention.o_gate.weight"], hf[t + "2.self_attn.gate_proj.weight"])
    assert torch.equal(
        rt["vision_encoder.layers.1.attn.wq.weight"], interleave_rows(hf[v + "1.attn.q_proj.weight"], 2)
    )
    assert torch.equal(
        rt["vision_encoder.layers.1.attn.wk.bias"], interleave_rows(hf[v + "1.attn.k_proj.bias"], 2)
    )
    assert torch.equal(rt["vision_encoder.layers.1.attn.wv.bias"], hf[v + "1.attn.v_proj.bias"])
    assert torch.equal(rt["tok_embeddings.embedding.weight"], hf["model.language_model.embed_tokens.weight"])
    assert torch.equal(rt["vision_adapter.c_fc.weight"], hf["model.vision_adapter.fc1.weight"])


CHECKS = {
    "llama": check_llama,
    "qwen3_moe": check_qwen3_moe,
    "deepseek_v3": check_deepseek_v3,
    "deepseek_v3_mtp": check_deepseek_v3_mtp,
    "qwen3_5": check_qwen3_5,
    "kimi_k25_released": check_kimi_k25_released,
    "muse_glimmer": check_muse_glimmer,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKS)
def test_titan_runtime_values(name: str) -> None:
    """The reshapes, splits, stacks and q/k row permutations the adapter applies, checked value by value on
    what torchtitan's load hands the model."""
    loaded = titan(name)["load"]
    assert isinstance(loaded, Path), loaded
    CHECKS[name](read_hf(checkpoint(name)), load_file(loaded))


@pytest.mark.slow
def test_qwen3_5_moe_to_hf_experts_are_transposed_for_transformers(tmp_path: Path) -> None:
    """Given the routed experts (stacked from the per-expert checkpoint, as the qwen3 adapter stacks them),
    the qwen3_5 adapter writes gate_up_proj [E, H, 2I] and down_proj [E, I, H]: transposed against the
    [E, 2I, H] / [E, H, I] transformers 5.23 loads, which refuses them on size."""
    hf = read_hf(checkpoint("qwen3_5_moe"))
    from_hf = titan("qwen3_5_moe")["from_hf"]
    assert isinstance(from_hf, Path), from_hf
    runtime = load_file(from_hf)
    for layer in range(4):
        p = f"model.language_model.layers.{layer}.mlp.experts."
        for w, proj in (("w1_EFD", "gate_proj"), ("w3_EFD", "up_proj"), ("w2_EDF", "down_proj")):
            stacked = torch.stack([hf[f"{p}{e}.{proj}.weight"] for e in range(4)])
            runtime[f"layers.{layer}.moe.routed_experts.inner_experts.{w}"] = stacked
    save_file(runtime, tmp_path / "runtime.safetensors")
    config = json.loads((checkpoint("qwen3_5_moe") / "config.json").read_text())
    run_adapter("qwen3_5", "to_hf", config, tmp_path / "runtime.safetensors", tmp_path / "hf.safetensors")
    back = load_file(tmp_path / "hf.safetensors")
    fused = families._fuse_experts(hf)
    for layer in range(4):
        p = f"model.language_model.layers.{layer}.mlp.experts."
        assert list(back[p + "gate_up_proj"].shape) == [4, 32, 16]
        assert torch.equal(back[p + "gate_up_proj"].transpose(1, 2), fused[p + "gate_up_proj"])
        assert torch.equal(back[p + "down_proj"].transpose(1, 2), fused[p + "down_proj"])
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        load_into_transformers("qwen3_5_moe", back, tmp_path / "hf")
