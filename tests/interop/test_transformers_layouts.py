"""`--mapping transformers`: a DCP of a live transformers-5 model (its runtime layout, `model.state_dict()`)
converts to exactly what `save_pretrained` writes for it (keys, shapes, bits), transformers loads that with no
missing or unexpected keys and the same logits, and hf-to-dcp of save_pretrained's files gives the runtime
layout `dcp.load` fills `model.state_dict()` from. The oracles are transformers' real classes (tiny ones
built from a config: support/tf_layouts.py) and torch's dcp.save / dcp.load. The presets under
ckptconv/mapping/presets/transformers are what scripts/gen_transformers_mappings.py writes with the installed
transformers.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import TESTS, WORKERS, ckptconv, torchrun, tree_sha256
from safetensors.torch import save_file
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import load_dir, same_bits
from tf_layouts import build, input_ids

from ckptconv.mapping.family import family_spec, index, mapping_for

# the MoE families the issue names, one of each conversion pattern (qwen2_moe's, mixtral's renames, phimoe's
# router rename), and gpt_oss, whose runtime layout is what save_pretrained writes (no mapping)
FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "olmoe",
    "phimoe",
    "qwen3_5_moe",
    "qwen3_next",
    "dots1",
    "hunyuan_v1_moe",
    "lfm2_moe",
    "jamba",
    "minimax",
    "gpt_oss",
]


def save_runtime(model: torch.nn.Module, path: Path) -> Path:
    """What a transformers-5 training job saves: its module state dict, with DCP, in one process."""
    dcp.save({k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint_id=str(path))
    return path


def ok(proc: object) -> None:
    assert proc.returncode == 0, (proc.stdout, proc.stderr)  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_runtime_dcp_to_save_pretrained_and_back(tmp_path: Path, model_type: str) -> None:
    model = build(model_type)
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    ckpt = save_runtime(model, tmp_path / "dcp")
    out = tmp_path / "out"
    config = ref / "config.json"
    args = ("--mapping", "transformers", "--dtype", "keep")  # save_pretrained keeps the model's float32
    ok(ckptconv("dcp-to-hf", str(ckpt), str(out), *args, "--config", str(config)))
    want, got = load_dir(ref), load_dir(out)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, bad[:5]

    shutil.copy(config, out / "config.json")
    loaded, info = type(model).from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = input_ids(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)

    back = tmp_path / "back"
    ok(ckptconv("hf-to-dcp", str(ref), str(back), *args))
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    stored = set(dcp.FileSystemReader(str(back)).read_metadata().state_dict_metadata)
    assert stored == set(state), sorted(stored ^ set(state))[:5]
    dcp.load(state, checkpoint_id=str(back))  # strict: every key of the model's state dict is read
    runtime = model.state_dict()
    bad = [k for k in state if not same_bits(state[k], runtime[k])]
    assert not bad, bad[:5]


@pytest.mark.slow
def test_fsdp2_two_ranks_same_bytes(tmp_path: Path) -> None:
    """Qwen3-MoE under FSDP2 on 2 ranks (experts split unevenly): its sharded DCP converts to the bytes the
    one-process save converts to, at 1 and 2 ranks."""
    model = build("qwen3_moe")
    model.save_pretrained(tmp_path / "ref")
    one = save_runtime(model, tmp_path / "one")
    torchrun(2, str(WORKERS / "tf_layouts_fsdp.py"), "qwen3_moe", str(tmp_path / "two"))
    config = str(tmp_path / "ref" / "config.json")
    outs = []
    for name, ckpt, nproc in (("a", one, 0), ("b", tmp_path / "two", 0), ("c", tmp_path / "two", 2)):
        out = tmp_path / f"out_{name}"
        args = ("--mapping", "transformers", "--config", config, "--dtype", "keep")
        ok(ckptconv("dcp-to-hf", str(ckpt), str(out), *args, nproc=nproc))
        outs.append(tree_sha256(out))
    assert outs[0] == outs[1] == outs[2]
    want, got = load_dir(tmp_path / "ref"), load_dir(tmp_path / "out_b")
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_verify_and_inspect(tmp_path: Path, model_type: str) -> None:
    """verify of the runtime DCP against save_pretrained's files: equal (exit 0); one expert's value changed
    in the release: exit 1. inspect shows the mapped view: save_pretrained's keys."""
    model = build(model_type)
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    ckpt = save_runtime(model, tmp_path / "dcp")
    config = str(ref / "config.json")
    ok(ckptconv("verify", str(ckpt), str(ref), "--mapping", "transformers", "--config", config))
    shown = ckptconv("inspect", str(ckpt), "--mapping", "transformers", "--config", config, "--json")
    ok(shown)
    mapped = {t["key"] for t in json.loads(shown.stdout)["mapped"]}
    assert mapped == set(load_dir(ref))
    tensors = load_dir(ref)
    key = next(k for k in tensors if ".experts.1." in k)
    tensors[key] = tensors[key] + 1
    save_file(tensors, ref / "model.safetensors", metadata={"format": "pt"})
    proc = ckptconv("verify", str(ckpt), str(ref), "--mapping", "transformers", "--config", config)
    assert proc.returncode == 1 and key in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)


def _tiny_dcp(path: Path, config: dict | None) -> Path:
    dcp.save({"model.norm.weight": torch.ones(4)}, checkpoint_id=str(path))
    if config is not None:
        (path.parent / "config.json").write_text(json.dumps(config))
    return path


def test_no_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _tiny_dcp(tmp_path / "dcp", None)
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--mapping", "transformers")
    assert_one_line(code, err, "--mapping transformers", "model_type", "pass --config")
    assert not (tmp_path / "out").exists()


def test_uncovered_model_type_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _tiny_dcp(tmp_path / "dcp", {"model_type": "no_such_family"})
    config = str(tmp_path / "config.json")
    code, err = run(
        capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--mapping", "transformers", "--config", config
    )
    assert_one_line(code, err, "'no_such_family' is not covered", "qwen3_moe", "mixtral")
    assert not (tmp_path / "out").exists()
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, hf / "model.safetensors")
    for verb in (["inspect", str(ckpt)], ["hf-to-dcp", str(hf), str(tmp_path / "back")]):
        code, err = run(capsys, *verb, "--mapping", "transformers", "--config", config)
        assert_one_line(code, err, "'no_such_family' is not covered")


def test_family_from_config() -> None:
    assert family_spec({"model_type": "qwen3_moe"}) == "transformers/qwen3_moe"
    assert family_spec({"model_type": "gpt_oss"}) is None  # the runtime layout is what save_pretrained writes
    assert mapping_for("transformers", {"model_type": "llama"}) is None
    mapping = mapping_for("transformers", {"model_type": "mixtral"})
    assert mapping is not None and mapping.name == "transformers-mixtral"
    assert set(FAMILIES) - {"gpt_oss"} <= set(index()["covered"])


def test_dcp_save_needs_no_transformers_at_run_time(tmp_path: Path) -> None:
    """The presets are data: resolving one reads config.json and TOML, not transformers' code."""
    code = "import sys; from ckptconv.mapping.family import mapping_for; mapping_for('transformers', "
    code += "{'model_type': 'qwen3_moe'}); print('transformers' in sys.modules)"
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=TESTS.parent, check=True
    )
    assert proc.stdout.strip() == "False"


@pytest.mark.slow
def test_presets_are_what_transformers_gives(tmp_path: Path) -> None:
    """Regenerated with the installed transformers, the presets are byte-identical: a transformers whose
    conversion mapping changed fails here (rerun scripts/gen_transformers_mappings.py)."""
    spec = importlib.util.spec_from_file_location(
        "gen", TESTS.parent / "scripts" / "gen_transformers_mappings.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen"] = gen  # its model_types are shared out over forked processes, which find it by name
    try:
        spec.loader.exec_module(gen)
        assert gen.main(["--check"]) == 0
    finally:
        del sys.modules["gen"]


# -- chosen by the reference, without --mapping --------------------------------------------------------------


def test_the_reference_calls_for_the_runtime_family(tmp_path: Path) -> None:
    """A DCP of a live Qwen3-MoE (experts fused, as transformers 5 runs it) released against its
    save_pretrained base (per expert) with no --mapping: the family's mapping is taken because the base calls
    for it, and the output is save_pretrained's files bit for bit; against a base that stores the experts
    fused, the keys are written as they are."""
    model = build("qwen3_moe")
    base, fused = tmp_path / "base", tmp_path / "fused"
    model.save_pretrained(base)
    ckpt = save_runtime(model, tmp_path / "dcp")
    proc = ckptconv("dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--copy-from", str(base))
    ok(proc)
    said = "the checkpoint holds transformers' runtime layout of qwen3_moe (--mapping transformers); "
    assert said + f"written as save_pretrained stores it, as in --copy-from {base}" in proc.stderr
    want, got = load_dir(base), load_dir(tmp_path / "out")
    assert sorted(got) == sorted(want)
    assert [k for k in want if not same_bits(got[k], want[k])] == []

    fused.mkdir()
    runtime = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(runtime, fused / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(base / "config.json", fused / "config.json")
    proc = ckptconv("dcp-to-hf", str(ckpt), str(tmp_path / "as-is"), "--reference", str(fused))
    ok(proc)
    assert "runtime layout" not in proc.stderr
    assert sorted(load_dir(tmp_path / "as-is")) == sorted(runtime)


def test_save_hf_from_a_live_model_follows_the_base(tmp_path: Path) -> None:
    """save_hf of the live model's own state dict (fused experts) with its save_pretrained base as copy_from:
    the family's mapping is taken as the base calls for it; the files are save_pretrained's, bit for bit."""
    import ckptconv as lib

    model = build("qwen3_moe")
    base = tmp_path / "base"
    model.save_pretrained(base)
    report = lib.save_hf(model.state_dict(), tmp_path / "out", copy_from=base)
    assert any("runtime layout of qwen3_moe" in note for note in report.notes), report.notes
    want, got = load_dir(base), load_dir(tmp_path / "out")
    assert sorted(got) == sorted(want)
    assert [k for k in want if not same_bits(got[k], want[k])] == []


def test_hf_to_dcp_takes_the_runtime_family_its_reference_holds(tmp_path: Path) -> None:
    """hf-to-dcp of save_pretrained's files with the training job's own checkpoint as --reference ({"model":
    the live model's state dict, "step"}) and no --mapping: the DCP is written in the job's runtime layout,
    which dcp.load reads into the model's state dict with every key, bit for bit."""
    model = build("qwen3_moe")
    base = tmp_path / "base"
    model.save_pretrained(base)
    runtime = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": runtime, "step": torch.tensor(5)}, checkpoint_id=str(tmp_path / "job"))
    proc = ckptconv(
        "hf-to-dcp",
        str(base),
        str(tmp_path / "init"),
        "--prefix",
        "model.",
        "--reference",
        str(tmp_path / "job"),
    )
    ok(proc)
    said = "written in transformers' runtime layout of qwen3_moe (--mapping transformers), as in --reference"
    assert said in proc.stderr
    state = {"model": {k: torch.zeros_like(v) for k, v in runtime.items()}}
    stored = set(dcp.FileSystemReader(str(tmp_path / "init")).read_metadata().state_dict_metadata)
    assert stored == {f"model.{k}" for k in runtime}
    dcp.load(state, checkpoint_id=str(tmp_path / "init"))
    assert [k for k in runtime if not same_bits(state["model"][k], runtime[k])] == []
