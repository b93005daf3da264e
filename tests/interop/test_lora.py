"""dcp-to-hf --lora (issue #21): PEFT LoRA / rsLoRA / DoRA models trained under FSDP2 on 2 ranks and saved
whole with DCP (workers/peft_save.py), converted, and held to PEFT's own code: the adapter to
`save_pretrained`'s file, the merge to `merge_and_unload()`, the adapter's logits after
`PeftModel.from_pretrained`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from families import tiny
from safetensors.torch import load_file
from test_bad_input import assert_one_line, run

pytestmark = pytest.mark.slow  # every test reads a checkpoint written under torchrun

# name -> the LoraConfig the run trains with (`init_lora_weights: false`: B is not zero)
CONFIGS: dict[str, dict[str, Any]] = {
    "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "rslora": {
        "r": 4,
        "lora_alpha": 6,
        "use_rslora": True,
        "rank_pattern": {"gate_proj": 8},
        "target_modules": ["q_proj", "v_proj", "gate_proj", "embed_tokens"],
    },
    "dora": {"r": 4, "lora_alpha": 16, "use_dora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    # transformers 5's fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) through PEFT's
    # target_parameters: two nested ParamWrappers per experts module
    "moe": {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["q_proj"],
        "target_parameters": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],  # not the nesting order
    },
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny("llama", tmp_path_factory.mktemp("lora") / "base")


@pytest.fixture(scope="module")
def runs(base: Path) -> dict[str, Path]:
    """Each config trained one step under FSDP2 on 2 ranks: RUN/dcp, and PEFT's RUN/adapter, RUN/merged,
    RUN/logits.pt; RUN/base is the model it adapts (a tiny Llama; Qwen3-MoE for "moe")."""
    moe = tiny("qwen3", base.parent / "moe-base", moe=True)
    out = {}
    for name, config in CONFIGS.items():
        run_dir = base.parent / name
        config = {**config, "init_lora_weights": False}
        model = moe if name == "moe" else base
        torchrun(2, str(WORKERS / "peft_save.py"), str(model), str(run_dir), json.dumps(config))
        (run_dir / "base").symlink_to(model)
        out[name] = run_dir
    return out


def convert(run_dir: Path, out: Path, *flags: str, nproc: int = 0) -> None:
    config = ("--lora-config", str(run_dir / "adapter" / "adapter_config.json"))
    proc = ckptconv("dcp-to-hf", str(run_dir / "dcp"), str(out), *config, *flags, "-q", nproc=nproc)
    assert proc.returncode == 0, proc.stderr


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in b:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_adapter_is_pefts_own_and_gives_the_trained_logits(
    runs: dict[str, Path], base: Path, tmp_path: Path, name: str
) -> None:
    from peft import PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    run_dir = runs[name]
    convert(run_dir, tmp_path / "adapter", "--lora", "adapter")
    ours = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert_same(ours, load_file(run_dir / "adapter" / "adapter_model.safetensors"))  # fp32, as trained
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "ckptconv_state.json",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # PEFT warns of missing or unexpected adapter keys
        plain = AutoModelForCausalLM.from_pretrained(run_dir / "base")
        model = PeftModel.from_pretrained(plain, tmp_path / "adapter")
    loaded = set_peft_model_state_dict(model, load_peft_weights(str(tmp_path / "adapter")))
    assert not loaded.unexpected_keys
    assert not [k for k in loaded.missing_keys if "lora_" in k]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker computed logits.pt (OMP_NUM_THREADS=1): MoE sums in that order
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.load(run_dir / "input_ids.pt")).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits, torch.load(run_dir / "logits.pt"))


def test_adapter_config_derived_from_the_shapes_loads_as_the_trainers(
    runs: dict[str, Path], base: Path, tmp_path: Path
) -> None:
    """No --lora-config: r and rank_pattern from the shapes, alpha from --lora-alpha, rsLoRA from its flag;
    PEFT reads it as the same LoRA (same scaling on every module)."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = runs["rslora"]
    cmd = ["dcp-to-hf", str(run_dir / "dcp"), str(tmp_path / "a"), "--lora", "adapter", "--lora-alpha", "6"]
    proc = ckptconv(*cmd, "--lora-rslora", "--lora-base", "tiny/llama", "-q")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 6 and config["use_rslora"] is True
    assert config["base_model_name_or_path"] == "tiny/llama"
    assert config["target_modules"] == ["embed_tokens", "gate_proj", "q_proj", "v_proj"]
    assert {int(v) for v in config["rank_pattern"].values()} == {8}
    LoraConfig.from_pretrained(str(tmp_path / "a"))  # PEFT accepts every field
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "a")
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter")
    ours = {n: m.scaling for n, m in model.named_modules() if hasattr(m, "scaling")}
    theirs = {n: m.scaling for n, m in trained.named_modules() if hasattr(m, "scaling")}
    assert ours == theirs and ours


def test_lora_targets_are_the_derived_configs_target_modules(
    runs: dict[str, Path], base: Path, tmp_path: Path
) -> None:
    """--lora-targets (comma-separated and repeated) is written as target_modules, the rest as derived; PEFT
    loads every factor and gives the logits of the config derived without it."""
    from peft import PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    run_dir = runs["lora"]
    named = ("--lora-targets", "q_proj,v_proj", "--lora-targets", "mlp.down_proj")
    for out, flags in (("derived", ()), ("named", named)):
        cmd = [
            "dcp-to-hf",
            str(run_dir / "dcp"),
            str(tmp_path / out),
            "--lora",
            "adapter",
            "--lora-alpha",
            "8",
        ]
        proc = ckptconv(*cmd, *flags, "-q")
        assert proc.returncode == 0, proc.stderr
    configs = {
        out: json.loads((tmp_path / out / "adapter_config.json").read_text()) for out in ("derived", "named")
    }
    assert configs["named"].pop("target_modules") == ["q_proj", "v_proj", "mlp.down_proj"]
    assert configs["derived"].pop("target_modules") == ["down_proj", "q_proj", "v_proj"]
    assert configs["named"] == configs["derived"]
    logits = {}
    for out in ("derived", "named"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # PEFT warns of missing or unexpected adapter keys
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / out)
        loaded = set_peft_model_state_dict(model, load_peft_weights(str(tmp_path / out)))
        assert not loaded.unexpected_keys
        assert not [k for k in loaded.missing_keys if "lora_" in k]
        with torch.no_grad():
            logits[out] = model(input_ids=torch.load(run_dir / "input_ids.pt")).logits
    assert torch.equal(logits["named"], logits["derived"])


def test_lora_targets_errors_are_one_line(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything is written: without --lora adapter, with the trainer's config (given or
    beside the checkpoint), an empty name, names PEFT would not match to exactly the adapted modules."""
    import shutil

    src, out = str(runs["lora"] / "dcp"), str(tmp_path / "out")
    trainer = runs["lora"] / "adapter" / "adapter_config.json"
    beside = shutil.copytree(runs["lora"] / "dcp", tmp_path / "beside")
    shutil.copy(trainer, beside / "adapter_config.json")
    adapter = ("--lora", "adapter", "--lora-alpha", "8")
    layer0 = "'model.layers.0.mlp.down_proj'"
    cases = [
        (src, ["--lora-targets", "q_proj"], "--lora-targets applies with --lora adapter"),
        (
            src,
            ["--lora", "merge", "--lora-alpha", "8", "--lora-targets", "q_proj"],
            "applies with --lora adapter",
        ),
        (
            src,
            ["--lora", "adapter", "--lora-config", str(trainer), "--lora-targets", "q_proj"],
            "target_modules",
        ),
        (str(beside), ["--lora", "adapter", "--lora-targets", "q_proj"], "target_modules come from"),
        (src, [*adapter, "--lora-targets", "q_proj,,v_proj"], "--lora-targets: an empty module name"),
        (src, [*adapter, "--lora-targets", "q_proj,v_proj"], f"no name matches {layer0}", "add 'down_proj'"),
        (src, [*adapter, "--lora-targets", "q_proj,v_proj,down_proj,o_proj"], "'o_proj' matches no module"),
    ]
    for path, flags, *needles in cases:
        assert_one_line(*run(capsys, "dcp-to-hf", path, out, *flags), *needles)
    assert not Path(out).exists()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_merge_is_merge_and_unload(runs: dict[str, Path], tmp_path: Path, name: str) -> None:
    """fp32: the same float operations in the same order, so bit for bit; the default bf16 release is that
    cast once (and --verify agrees). MoE: against its per-expert base the fused release is refused; allowed,
    the experts stay fused as the DCP holds them, and transformers loads them as the per-expert tensors its
    merged model saved."""
    from transformers import AutoModelForCausalLM

    run_dir = runs[name]
    merged = load_file(run_dir / "merged" / "model.safetensors")
    flags = ("--lora", "merge", "--dtype", "fp32", "--copy-from", str(run_dir / "base"))
    if name == "moe":
        # the base transformers saved holds one tensor per expert, the DCP its fused runtime layout: written
        # as the DCP holds it, the release would not match its base, which --copy-from makes the reference
        config = ("--lora-config", str(run_dir / "adapter" / "adapter_config.json"))
        refused = ckptconv("dcp-to-hf", str(run_dir / "dcp"), str(tmp_path / "fp32"), *config, *flags, "-q")
        assert refused.returncode == 2 and "would not match the reference" in refused.stderr
        assert "experts.0.gate_proj.weight" in refused.stderr and not (tmp_path / "fp32").exists()
        flags += ("--allow-layout-change",)
    convert(run_dir, tmp_path / "fp32", *flags)
    if name == "moe":
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").state_dict()
        assert_same(ours, AutoModelForCausalLM.from_pretrained(run_dir / "merged").state_dict())
        assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "fp32" / "model.safetensors")
        return
    assert_same(load_file(tmp_path / "fp32" / "model.safetensors"), merged)
    convert(run_dir, tmp_path / "bf16", "--lora", "merge", "--verify")
    bf16 = {k: v.to(torch.bfloat16) for k, v in merged.items()}
    assert_same(load_file(tmp_path / "bf16" / "model.safetensors"), bf16)


def test_merge_bytes_do_not_depend_on_the_number_of_ranks(runs: dict[str, Path], tmp_path: Path) -> None:
    for name in ("dora", "moe"):
        flags = ("--lora", "merge", "--max-shard-size", "20KB")
        convert(runs[name], tmp_path / name / "one", *flags)
        convert(runs[name], tmp_path / name / "two", *flags, nproc=2)
        assert len(list((tmp_path / name / "one").glob("*.safetensors"))) >= 2  # both ranks write
        assert tree_sha256(tmp_path / name / "one") == tree_sha256(tmp_path / name / "two")


def test_drop_writes_the_base_model(runs: dict[str, Path], base: Path, tmp_path: Path) -> None:
    proc = ckptconv("dcp-to-hf", str(runs["lora"] / "dcp"), str(tmp_path / "base"), "--lora", "drop", "-q")
    assert proc.returncode == 0, proc.stderr
    original = {k: v.to(torch.bfloat16) for k, v in load_file(base / "model.safetensors").items()}
    assert_same(load_file(tmp_path / "base" / "model.safetensors"), original)  # frozen: as it was


def test_lora_errors_are_one_line(
    runs: dict[str, Path], fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = str(runs["lora"] / "dcp"), str(tmp_path / "out")
    assert_one_line(*run(capsys, "dcp-to-hf", src, out), "--lora adapter", "--lora merge", "--lora drop")
    assert_one_line(*run(capsys, "dcp-to-hf", src, out, "--lora", "merge"), "--lora-alpha", "--lora-config")
    assert_one_line(*run(capsys, "dcp-to-hf", src, out, "--lora", "fuse"), "--lora 'fuse'")
    assert_one_line(*run(capsys, "dcp-to-hf", src, out, "--lora-alpha", "8"), "--lora-alpha applies with")
    bad_name = run(capsys, "dcp-to-hf", src, out, "--lora", "drop", "--lora-name", "other")
    assert_one_line(*bad_name, "--lora-name 'other'", "default")
    plain = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), out, "--lora", "adapter", "--lora-alpha", "8")
    assert_one_line(*plain, "holds no LoRA factors")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**CONFIGS["lora"], "r": 8, "peft_type": "LORA"}))
    mismatch = run(capsys, "dcp-to-hf", src, out, "--lora", "merge", "--lora-config", str(wrong))
    assert_one_line(*mismatch, "r=8")
    gather = run(capsys, "dcp-to-hf", src, out, "--lora", "merge", "--lora-alpha", "8", "--read", "gather")
    assert_one_line(*gather, "--read direct")
    assert not Path(out).exists()


def test_inspect_reports_the_adapters(runs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    proc = ckptconv("inspect", str(runs["rslora"] / "dcp"), "--json")
    assert proc.returncode == 0, proc.stderr
    (adapter,) = json.loads(proc.stdout)["release"]["lora"]
    assert adapter == {
        "name": "default",
        "modules": 7,  # q, v, gate in 2 layers, and embed_tokens
        "targets": ["embed_tokens", "gate_proj", "q_proj", "v_proj"],
        "ranks": {"4": 5, "8": 2},
        "dora": False,
        "alpha": None,  # in no tensor, and no adapter_config.json beside the checkpoint
        "rslora": None,
    }
    src = shutil.copytree(runs["dora"] / "dcp", tmp_path / "dcp")
    shutil.copy(runs["dora"] / "adapter" / "adapter_config.json", src)
    proc = ckptconv("inspect", str(src))
    assert proc.returncode == 0, proc.stderr
    assert "DoRA adapter 'default': 6 modules (down_proj, q_proj, v_proj), r=4, alpha 16" in proc.stdout
    proc = ckptconv("inspect", str(runs["lora"].parent / "base"), "--json")  # no LoRA: no entry
    assert proc.returncode == 0 and "lora" not in json.loads(proc.stdout)
    plain = ckptconv("dcp-to-hf", str(src), str(tmp_path / "merged"), "--lora", "merge", "-q")
    assert plain.returncode == 0, plain.stderr  # the adapter_config.json beside it gives alpha


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_hf_from_the_live_sharded_model_writes_what_dcp_to_hf_writes(
    runs: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """`ckptconv.save_hf(state_dict, lora=MODE)` on 2 ranks (workers/peft_save.py), against PEFT's own."""
    run_dir = runs[name]
    adapter = run_dir / "save_hf_adapter"
    assert_same(
        load_file(adapter / "adapter_model.safetensors"),
        load_file(run_dir / "adapter" / "adapter_model.safetensors"),
    )
    assert json.loads((adapter / "adapter_config.json").read_text()) == json.loads(
        (run_dir / "adapter" / "adapter_config.json").read_text()
    )
    ours = load_file(run_dir / "save_hf_merge" / "model.safetensors")
    convert(run_dir, tmp_path / "merged", "--lora", "merge", "--dtype", "fp32")
    assert_same(ours, load_file(tmp_path / "merged" / "model.safetensors"))  # what dcp-to-hf writes
    dropped = load_file(run_dir / "save_hf_drop" / "model.safetensors")
    assert sorted(dropped) == sorted(ours) and not any("lora" in k for k in dropped)


@pytest.mark.parametrize("name", ["rslora", "dora"])
def test_adapter_to_dcp_resumes_in_a_wrapped_fsdp2_model_and_comes_back_byte_identical(
    runs: dict[str, Path], base: Path, tmp_path: Path, name: str
) -> None:
    """hf-to-dcp BASE OUT --lora-adapter: `dcp.load` fills a PEFT-wrapped FSDP2 model on 2 ranks with what
    `PeftModel.from_pretrained` loads (every key, bit for bit; the trained logits), and dcp-to-hf --lora
    adapter of that DCP gives back PEFT's adapter_model.safetensors byte for byte. `--verify` passes."""
    adapter = runs[name] / "adapter"
    proc = ckptconv(
        "hf-to-dcp",
        str(base),
        str(tmp_path / "dcp"),
        "--lora-adapter",
        str(adapter),
        "--prefix",
        "model",
        "--verify",  # the DCP read back against the base and the adapter
    )
    assert proc.returncode == 0 and "match the source bit for bit" in proc.stderr, proc.stderr
    args = [str(base), str(adapter), str(tmp_path / "dcp")]
    args += [str(runs[name] / "input_ids.pt"), str(runs[name] / "logits.pt")]
    loaded = torchrun(2, str(WORKERS / "peft_load.py"), *args)
    assert "peft_load: identical" in loaded.stdout
    config = str(adapter / "adapter_config.json")
    again = ckptconv(
        "dcp-to-hf",
        str(tmp_path / "dcp"),
        str(tmp_path / "back"),
        "--lora",
        "adapter",
        "--lora-config",
        config,
    )
    assert again.returncode == 0, again.stderr
    back = (tmp_path / "back" / "adapter_model.safetensors").read_bytes()
    assert back == (adapter / "adapter_model.safetensors").read_bytes()


def test_load_hf_loads_base_and_adapter_into_a_wrapped_model(runs: dict[str, Path], base: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    import ckptconv

    adapter = runs["rslora"] / "adapter"
    torch.manual_seed(7)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig.from_pretrained(adapter))
    state = model.state_dict()
    report = ckptconv.load_hf(state, base, lora_adapter=adapter)
    assert not report.missing and not report.unexpected
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).state_dict()
    assert_same(state, want)


def test_lora_adapter_errors_are_one_line(
    runs: dict[str, Path], base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    out = str(tmp_path / "out")
    adapter = str(runs["lora"] / "adapter")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file(
        {"base_model.model.model.vision.proj.lora_A.weight": torch.zeros(4, 8)}, wrong / "a.safetensors"
    )
    other = tmp_path / "other"
    other.mkdir()
    save_file({"base_model.model.x.hada_w1_a": torch.zeros(4, 8)}, other / "adapter_model.safetensors")
    cases = [
        (["--lora-adapter", str(wrong)], "'model.vision.proj'", "is it an adapter of this model?"),
        (["--lora-adapter", str(other)], "hada_w1_a", "only LoRA and DoRA"),
        (["--lora-adapter", adapter, "--lora-name", "a.b"], "--lora-name 'a.b'"),
        (["--lora-adapter", adapter, "--mapping", "torchtitan-llama3"], "--lora-adapter with --mapping"),
        (["--lora-adapter", str(tmp_path / "none")], "none"),
    ]
    for flags, *needles in cases:
        assert_one_line(*run(capsys, "hf-to-dcp", str(base), out, *flags), *needles)
    moe = runs["moe"]
    experts = run(capsys, "hf-to-dcp", str(moe / "base"), out, "--lora-adapter", str(moe / "adapter"))
    assert_one_line(*experts, "target_parameters", "does not read those yet")
    assert not Path(out).exists()


def test_inspect_counts_the_rank_of_stacked_experts(runs: dict[str, Path]) -> None:
    proc = ckptconv("inspect", str(runs["moe"] / "dcp"), "--json")
    assert proc.returncode == 0, proc.stderr
    (adapter,) = json.loads(proc.stdout)["release"]["lora"]
    assert adapter["targets"] == ["experts", "q_proj"] and adapter["ranks"] == {
        "2": 6
    }  # 2 layers x 3 wrappers


TITAN_MOE = {
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["wo"],
    "target_parameters": ["inner_experts.w1_EFD", "inner_experts.w2_EDF", "inner_experts.w3_EFD"],
}
TITAN_DENSE = {"r": 4, "lora_alpha": 8, "target_modules": ["wo", "w1", "w2", "w3"]}


@pytest.fixture(scope="module")
def titan_runs(base: Path) -> dict[str, Path]:
    """PEFT on torchtitan 0.3.0's own Qwen3-MoE (LoRA on wo and, through target_parameters, on the stacked
    experts w1_EFD / w2_EDF / w3_EFD: three nested wrappers) and Llama 3 (wo, w1, w2, w3), loaded with
    torchtitan's from_hf and saved with DCP; PEFT's merge, by torchtitan's to_hf (workers/titan_peft.py)."""
    from titan import run_script

    moe = tiny("qwen3", base.parent / "titan-moe-base", moe=True)
    out = {}
    for name, (family, model, config) in {
        "moe": ("qwen3", moe, TITAN_MOE),
        "dense": ("llama3", base, TITAN_DENSE),
    }.items():
        out[name] = base.parent / f"titan-{name}"
        run_script(WORKERS / "titan_peft.py", family, str(model), json.dumps(config), str(out[name]))
        (out[name] / "base").symlink_to(model)
    return out


def test_merge_through_a_torchtitan_mapping_is_pefts_merge(
    titan_runs: dict[str, Path], tmp_path: Path
) -> None:
    """--mapping torchtitan-qwen3 --lora merge: the stacked experts' update added to each expert's block
    as the mapping unstacks it, wo's as it is renamed; equal, bit for bit, to PEFT's merge_and_unload() of
    the torchtitan model through torchtitan's own to_hf."""
    run_dir = titan_runs["moe"]
    args = ["dcp-to-hf", str(run_dir / "dcp"), str(tmp_path / "out"), "--mapping", "torchtitan-qwen3"]
    args += ["--config", str(run_dir / "base" / "config.json"), "--lora", "merge", "--lora-alpha", "4"]
    proc = ckptconv(*args, "--dtype", "fp32", "-q")
    assert proc.returncode == 0, proc.stderr
    assert_same(load_file(tmp_path / "out" / "model.safetensors"), load_file(run_dir / "merged.safetensors"))
    two = ckptconv(*args[:2], str(tmp_path / "two"), *args[3:], "--dtype", "fp32", "-q", nproc=2)
    assert two.returncode == 0, two.stderr
    assert tree_sha256(tmp_path / "out") == tree_sha256(tmp_path / "two")
    adapter = ckptconv(*args[:2], str(tmp_path / "a"), *args[3:-4], "--lora", "adapter", "--lora-alpha", "4")
    assert adapter.returncode == 2 and "stacked experts adapted by target_parameters" in adapter.stderr


def test_adapter_through_a_torchtitan_mapping_merges_as_the_trainers(
    titan_runs: dict[str, Path], tmp_path: Path
) -> None:
    """--mapping torchtitan-llama3 --lora adapter: factors under HF's names, which PEFT merges into the HF
    base model into exactly what PEFT's merge of the torchtitan model gives through torchtitan's to_hf."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = titan_runs["dense"]
    args = ["dcp-to-hf", str(run_dir / "dcp"), str(tmp_path / "a"), "--mapping", "torchtitan-llama3"]
    args += ["--config", str(run_dir / "base" / "config.json"), "--lora", "adapter", "--lora-alpha", "8"]
    proc = ckptconv(*args, "-q")
    assert proc.returncode == 0, proc.stderr
    keys = sorted(load_file(tmp_path / "a" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight" in keys and len(keys) == 2 * 4 * 2
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "base"), tmp_path / "a")
    merged = model.merge_and_unload().state_dict()
    assert_same(
        {k: merged[k] for k in load_file(run_dir / "merged.safetensors")},
        load_file(run_dir / "merged.safetensors"),
    )


def test_verify_compares_a_lora_checkpoint_with_its_adapter_and_its_merge(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = runs["dora"]
    config = ["--lora-config", str(run_dir / "adapter" / "adapter_config.json")]
    dcp_dir = str(run_dir / "dcp")
    merged = ckptconv("verify", dcp_dir, str(run_dir / "merged"), "--lora", "merge", *config)
    assert merged.returncode == 0 and "match:" in merged.stdout, merged.stderr
    adapter = ckptconv("verify", dcp_dir, str(run_dir / "adapter"), "--lora", "adapter", *config, "--json")
    assert adapter.returncode == 0 and json.loads(adapter.stdout)["match"] is True, adapter.stderr
    wrong = ckptconv("verify", dcp_dir, str(run_dir / "merged"), "--lora", "merge", "--lora-alpha", "15")
    assert wrong.returncode == 1, wrong.stderr  # another alpha: another merge
    assert_one_line(*run(capsys, "verify", dcp_dir, str(run_dir / "merged")), "--lora merge")


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_torchtunes_lora_names_through_its_mapping_are_torchtunes_own_conversions(
    tmp_path: Path, kind: str
) -> None:
    """A torchtune 0.6.1 LoRA / DoRA Llama 3 (`lora_a`, `lora_b`, `magnitude` beside the weight) saved with
    DCP: `--mapping torchtune-llama3 --lora adapter` equals torchtune's `tune_to_peft_adapter_weights` (q/k
    B rows permuted as the weights are), `--lora merge` its `get_merged_lora_ckpt` then `tune_to_hf`, bit
    for bit (alpha / r = 2: scaling B before or after the product rounds alike)."""
    from tune import run_script

    run_script(WORKERS / "tune_lora.py", str(tmp_path / "run"), *(["dora"] if kind == "dora" else []))
    run_dir = tmp_path / "run"
    args = ["--mapping", "torchtune-llama3", "--config", str(run_dir / "config.json")]
    args += ["--lora-config", str(run_dir / "adapter" / "adapter_config.json"), "-q"]
    src = str(run_dir / "dcp")
    adapter = ckptconv("dcp-to-hf", src, str(tmp_path / "adapter"), *args, "--lora", "adapter")
    assert adapter.returncode == 0, adapter.stderr
    assert_same(
        load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
        load_file(run_dir / "adapter" / "adapter_model.safetensors"),
    )
    merged = ckptconv("dcp-to-hf", src, str(tmp_path / "merged"), *args, "--lora", "merge", "--dtype", "fp32")
    assert merged.returncode == 0, merged.stderr
    assert_same(
        load_file(tmp_path / "merged" / "model.safetensors"), load_file(run_dir / "merged.safetensors")
    )


def test_an_fp8_release_of_a_merge_quantizes_the_merged_weights(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """--lora merge --quantize fp8: each weight quantized (DeepSeek's block FP8, test_quantize.ref_quantize)
    from PEFT's fp32 merge, not from a cast of it."""
    from test_quantize import ref_quantize

    run_dir = runs["dora"]
    convert(run_dir, tmp_path / "fp8", "--lora", "merge", "--quantize", "fp8")
    ours = load_file(tmp_path / "fp8" / "model.safetensors")
    merged = load_file(run_dir / "merged" / "model.safetensors")
    quantized = [k for k in merged if k + "_scale_inv" in ours]
    assert len(quantized) == 14  # q, k, v, o, gate, up, down in 2 layers
    for key in quantized:
        values, scale = ref_quantize(merged[key])
        assert torch.equal(ours[key].view(torch.uint8), values.view(torch.uint8)), key
        assert torch.equal(ours[key + "_scale_inv"], scale), key


def test_lora_from_and_into_s3(
    runs: dict[str, Path],
    tmp_path: Path,
    s3_endpoint: str,
    s3: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A LoRA run's DCP in S3 (moto's server) merges to the local bytes; an adapter written into S3 holds
    the local bytes, adapter_model.safetensors completed last (what makes it look complete)."""
    import s3fs
    from test_object_storage_out import _in_process, _objects

    run_dir = runs["dora"]
    config = ("--lora-config", str(run_dir / "adapter" / "adapter_config.json"))
    s3.put(str(run_dir / "dcp"), "ckpts/lora-run", recursive=True)
    convert(run_dir, tmp_path / "merged", "--lora", "merge")
    code, err = _in_process(
        capsys,
        s3_endpoint,
        "dcp-to-hf",
        "s3://ckpts/lora-run",
        str(tmp_path / "m3"),
        "--lora",
        "merge",
        *config,
        "-q",
    )
    assert code == 0, err
    assert tree_sha256(tmp_path / "m3") == tree_sha256(tmp_path / "merged")
    done: list[str] = []
    call = s3fs.S3FileSystem.call_s3

    def record(self: Any, method: str, *args: Any, **kw: Any) -> Any:
        if method in ("complete_multipart_upload", "put_object"):
            done.append(kw["Key"].rsplit("/", 1)[-1])
        return call(self, method, *args, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", record)
    s3fs.S3FileSystem.clear_instance_cache()
    out = "s3://ckpts/lora-adapter"
    code, err = _in_process(
        capsys, s3_endpoint, "dcp-to-hf", str(run_dir / "dcp"), out, "--lora", "adapter", *config, "-q"
    )
    assert code == 0, err
    convert(run_dir, tmp_path / "adapter", "--lora", "adapter")
    assert _objects(s3, "lora-adapter") == tree_sha256(tmp_path / "adapter")
    data = [n for n in done if not n.endswith(".ckptconv-lock")]
    assert data[-1] == "adapter_model.safetensors", done
