"""Values (issue #34 item 4): a non-finite or out-of-range value is one line and exit 2, or a stated
behaviour; nothing becomes NaN or inf from finite inputs without a word.

- LoRA: a non-finite alpha (flag or adapter_config.json), rank-0 factors, factors that do not fit their weight
  or each other, a merge that overflows fp32 or the written dtype;
- a tied output head (`tie_word_embeddings: true`) that differs from the embedding: refused unless
  `--drop-untied-head`, which `--verify` then reports; one equal to it is dropped silently, as before;
- the stash (`ckptconv_state.json`): items that do not decode, keys twice, empty keys, values a tensor of
  their dtype cannot hold; JSON objects with a key twice in any JSON file ckptconv reads; empty tensor names;
- block FP8: a block too small for its scale to be a normal fp32 number quantizes to zeros, not NaN;
  an fp16 release of values beyond fp16's range is refused.

Checkpoints are real: a tiny transformers Llama (support/families.py), a PEFT LoRA model of it saved with
torch's own `dcp.save`, the torchtitan layout written by ckptconv's hf-to-dcp through its preset.
"""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv
from families import tiny
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run

from ckptconv.quant import fp8

MAPPING = ("--mapping", "torchtitan-llama3")


def save_dcp(state: dict[str, Any], path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def cli(*argv: str) -> None:
    """The CLI in this process, for fixtures (no capsys): it must succeed."""
    from ckptconv.cli.app import main

    try:
        main(list(argv))
    except SystemExit as e:
        assert not e.code, e


def ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, err = run(capsys, *argv)
    assert code == 0, err
    return err


# --- LoRA -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peft(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path]:
    """A PEFT LoRA model of a tiny Llama (B not zero): its state dict, the adapter_config.json PEFT's
    `save_pretrained` writes for it, and where the base model (`base/`) and that adapter (`adapter/`) are."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("peft")
    base = tiny("llama", root / "base")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(root / "adapter")
    state = {k: v.detach().clone() for k, v in peft_model.state_dict().items()}
    return state, json.loads((root / "adapter" / "adapter_config.json").read_text()), root


Q = "base_model.model.model.layers.0.self_attn.q_proj"


def lora_ckpt(
    peft: tuple[dict[str, torch.Tensor], dict[str, Any]],
    path: Path,
    config: dict[str, Any] | None = None,
    **tensors: torch.Tensor,
) -> Path:
    """The PEFT model saved with dcp.save in `path`, some tensors replaced (`a` / `b`: layer 0 q_proj's
    factors, `w`: its base weight), and the trainer's adapter_config.json beside it unless `config` is {}."""
    state = dict(peft[0])
    names = {
        "a": f"{Q}.lora_A.default.weight",
        "b": f"{Q}.lora_B.default.weight",
        "w": f"{Q}.base_layer.weight",
    }
    for role, value in tensors.items():
        state[names[role]] = value
    save_dcp({"model": state}, path)
    if config != {}:
        (path / "adapter_config.json").write_text(json.dumps({**peft[1], **(config or {})}))
    return path


@pytest.mark.parametrize("alpha", ["inf", "nan", "1e400"])
def test_a_non_finite_lora_alpha_flag_is_refused(peft, tmp_path: Path, capsys, alpha: str) -> None:
    """Today `--lora-alpha inf` (or nan) merges every adapted weight to inf / NaN, exit 0."""
    src = lora_ckpt(peft, tmp_path / "ckpt", config={})
    for mode in ("merge", "adapter"):
        code, err = run(
            capsys, "dcp-to-hf", str(src), str(tmp_path / "out"), "--lora", mode, "--lora-alpha", alpha
        )
        assert_one_line(code, err, "--lora-alpha", "finite")
        assert not (tmp_path / "out").exists()


BAD_CONFIG = [
    ({"lora_alpha": math.nan}, "'lora_alpha'"),
    ({"lora_alpha": math.inf}, "'lora_alpha'"),
    ({"lora_alpha": True}, "'lora_alpha'"),
    ({"use_rslora": "false"}, "'use_rslora'"),
    ({"use_dora": 0}, "'use_dora'"),
    ({"rank_pattern": "q_proj"}, "'rank_pattern'"),
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern['q_proj']"),
    ({"alpha_pattern": {"q_proj": math.nan}}, "alpha_pattern['q_proj']"),
    ({"target_parameters": 5}, "'target_parameters'"),
]


@pytest.mark.parametrize(("field", "needle"), BAD_CONFIG, ids=[str(f) for f, _ in BAD_CONFIG])
def test_a_malformed_adapter_config_field_is_one_line(peft, tmp_path: Path, capsys, field, needle) -> None:
    """Today `"lora_alpha": NaN` merges to NaN with exit 0, a string rank_pattern is a ValueError traceback, a
    string alpha_pattern value a TypeError one, `"use_rslora": "false"` turns rsLoRA on."""
    src = lora_ckpt(peft, tmp_path / "ckpt", config=field)
    for mode in ("merge", "adapter"):
        code, err = run(capsys, "dcp-to-hf", str(src), str(tmp_path / "out"), "--lora", mode)
        assert_one_line(code, err, "adapter_config.json", needle)
        assert not (tmp_path / "out").exists()


def test_rank_zero_factors_are_refused(peft, tmp_path: Path, capsys) -> None:
    """A [0, in] and B [out, 0]: today a ZeroDivisionError traceback (r = 0 in alpha / r) merging with
    --lora-alpha, and an adapter whose rank_pattern says 0 written with exit 0."""
    w = peft[0][f"{Q}.base_layer.weight"]
    src = lora_ckpt(peft, tmp_path / "ckpt", {}, a=torch.zeros(0, w.shape[1]), b=torch.zeros(w.shape[0], 0))
    for mode in ("merge", "adapter"):
        args = ("--lora", mode, "--lora-alpha", "8")
        code, err = run(capsys, "dcp-to-hf", str(src), str(tmp_path / "out"), *args)
        assert_one_line(code, err, f"{Q}.lora_A.default.weight", "[0, 32]", "r >= 1")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("a", "b"),
    [((4, 33), (32, 4)), ((4, 32), (32, 5)), ((4, 32), (31, 4)), ((4,), (32, 4)), ((), (32, 4))],
    ids=["A wider than W", "B's r differs", "B taller than W", "A 1-d", "A 0-d"],
)
def test_factors_that_do_not_fit_their_weight_or_each_other_are_refused(
    peft, tmp_path: Path, capsys, a: tuple[int, ...], b: tuple[int, ...]
) -> None:
    """A must be [r, in] and B [out, r] of W [out, in]: today adapter mode writes such factors with exit 0
    (a 0-d A is an IndexError traceback), and merge mode checks them only after settings are made."""
    src = lora_ckpt(peft, tmp_path / "ckpt", {}, a=torch.ones(a), b=torch.ones(b))
    for mode in ("adapter", "merge"):
        code, err = run(
            capsys, "dcp-to-hf", str(src), str(tmp_path / "out"), "--lora", mode, "--lora-alpha", "8"
        )
        assert_one_line(code, err, f"{Q}.lora_A.default.weight", f"{Q}.lora_B.default.weight", "do not fit")
        assert not (tmp_path / "out").exists()


def test_a_merge_that_overflows_is_refused_and_an_inf_of_w_is_kept(peft, tmp_path: Path, capsys) -> None:
    """A finite alpha so large that W + scaling * B @ A overflows fp32 (alpha 1e45), or a merge that is finite
    in fp32 but not in the written fp16: today inf written with exit 0; now one line, nothing written. An inf
    W holds already is no such case: it stays, as a plain conversion keeps it."""
    src = lora_ckpt(peft, tmp_path / "ckpt", config={})
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(src), str(out), "--lora", "merge", "--lora-alpha", "1e45")
    assert_one_line(code, err, "model.layers.0.self_attn.q_proj.weight", "not finite")
    assert not out.exists()
    code, err = run(
        capsys, "dcp-to-hf", str(src), str(out), "--lora", "merge", "--lora-alpha", "1e8", "--dtype", "fp16"
    )
    assert_one_line(code, err, "model.layers.0.self_attn.q_proj.weight", "overflows float16", "--dtype fp32")
    assert not out.exists()
    ok(
        capsys,
        "dcp-to-hf",
        str(src),
        str(out),
        "--lora",
        "merge",
        "--lora-alpha",
        "1e8",
        "--dtype",
        "fp32",
        "-q",
    )
    w = peft[0][f"{Q}.base_layer.weight"].clone()
    w[3, 5] = math.inf
    src = lora_ckpt(peft, tmp_path / "inf", config={}, w=w)
    ok(capsys, "dcp-to-hf", str(src), str(tmp_path / "out2"), "--lora", "merge", "--lora-alpha", "8", "-q")
    merged = load_file(tmp_path / "out2" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert merged[3, 5] == math.inf and int(torch.isinf(merged).sum()) == 1


@pytest.mark.parametrize("shape", [(0, 32), (4, 33)], ids=["rank 0", "A wider than W"])
def test_a_published_adapter_that_does_not_fit_the_base_is_refused(
    peft, tmp_path: Path, capsys, shape
) -> None:
    """hf-to-dcp --lora-adapter: today written into the DCP under the wrapped names with exit 0."""
    shutil.copytree(peft[2] / "adapter", tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(file)
    tensors[f"{Q}.lora_A.weight"] = torch.ones(shape)
    save_file(tensors, file)
    code, err = run(
        capsys,
        "hf-to-dcp",
        str(peft[2] / "base"),
        str(tmp_path / "out"),
        "--lora-adapter",
        str(tmp_path / "adapter"),
    )
    assert_one_line(code, err, "--lora-adapter", f"{Q}.lora_A.default.weight", "do not fit")
    assert not (tmp_path / "out").exists()


def test_a_weight_twice_once_unwrapped_is_refused(peft, tmp_path: Path, capsys) -> None:
    """`M.base_layer.weight` beside `M.weight` are one parameter once PEFT's wrapper is off: today the last
    one silently wins."""
    state = dict(peft[0])
    state[f"{Q}.weight"] = state[f"{Q}.base_layer.weight"] + 1
    save_dcp({"model": state}, tmp_path / "ckpt")
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--lora", "drop")
    assert_one_line(code, err, f"{Q}.base_layer.weight", f"{Q}.weight", "two weights")


# --- a tied output head -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torchtitan-layout DCPs of a tiny Llama: `untied` (a trained lm_head of its own) with a config.json that
    ties (`tied.json`), and `tied` (tie_word_embeddings: the head is the embedding)."""

    root = tmp_path_factory.mktemp("titan")
    out = {}
    for name, tie in (("untied", False), ("tied", True)):
        hf = tiny("llama", root / f"hf-{name}", tie=tie)
        cli("hf-to-dcp", str(hf), str(root / name), *MAPPING, "-q")
        out[name], out[f"hf-{name}"] = root / name, hf
    config = json.loads((root / "untied" / "config.json").read_text())
    (root / "tied.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    out["tied.json"] = root / "tied.json"
    return out


def test_a_trained_head_a_tied_config_would_drop_is_refused(titan, tmp_path: Path, capsys) -> None:
    """Today: exit 0, "verified bit for bit", and the trained lm_head is gone."""
    out = tmp_path / "out"
    args = ("dcp-to-hf", str(titan["untied"]), str(out), *MAPPING, "--config", str(titan["tied.json"]))
    code, err = run(capsys, *args, "--verify")
    assert_one_line(code, err, "'lm_head.weight'", "'tok_embeddings.weight'", "--drop-untied-head")
    assert not out.exists()
    code, err = run(capsys, *args, "--dry-run")  # the plan reads no tensor data: it says nothing yet
    assert code == 0, err


def test_drop_untied_head_drops_it_and_verify_says_so(titan, tmp_path: Path, capsys) -> None:
    """With the flag the head is left out, with a warning; --verify passes, saying it was left out, the kept
    embedding being the source's; verify of the checkpoint against that release is a mismatch (the release
    lacks the head the checkpoint holds), verify against an untied release a match. A head equal to its
    embedding is dropped without a word, as before."""
    out = tmp_path / "out"
    tied = ("--config", str(titan["tied.json"]))
    err = ok(
        capsys, "dcp-to-hf", str(titan["untied"]), str(out), *MAPPING, *tied, "--drop-untied-head", "--verify"
    )
    assert "warning: --drop-untied-head: left out 'lm_head.weight'" in err, err
    verified = next(line for line in err.splitlines() if line.startswith("verified:"))
    assert "match the source bit for bit" in verified and "left out 'lm_head.weight'" in verified, err
    written = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in written
    source = load_file(titan["hf-untied"] / "model.safetensors")
    assert torch.equal(written["model.embed_tokens.weight"], source["model.embed_tokens.weight"].bfloat16())
    proc = ckptconv("verify", str(titan["untied"]), str(out), *MAPPING, *tied)
    assert proc.returncode == 1 and "lm_head.weight: only in A" in proc.stdout, proc.stdout + proc.stderr
    ok(capsys, "verify", str(titan["untied"]), str(titan["hf-untied"]), *MAPPING, *tied)
    err = ok(capsys, "dcp-to-hf", str(titan["tied"]), str(tmp_path / "tied"), *MAPPING, "--verify")
    assert "warning" not in err and "left out" not in err, err
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")


def test_the_tied_head_check_reads_slabs(titan, tmp_path: Path, capsys, monkeypatch) -> None:
    """Both tensors are read a slab of rows at a time, never whole."""
    import ckptconv.stream.tied as tied

    windows: list[tuple[str, Any]] = []
    assemble = tied.assemble

    def spy(t, rows, reader=None, window=None, pool=None):  # type: ignore[no-untyped-def]
        windows.append((t.hf_key, window))
        return assemble(t, rows, reader, window, pool)

    monkeypatch.setattr(tied, "assemble", spy)
    monkeypatch.setattr(tied, "SLAB_BYTES", 32 * 4 * 5)  # 5 rows of 32 fp32 values
    args = (str(titan["tied"]), str(tmp_path / "out"), *MAPPING)
    ok(capsys, "dcp-to-hf", *args, "-q")
    assert windows and all(w is not None and w[1] - w[0] <= 5 for _, w in windows), windows
    assert {k for k, _ in windows} == {"lm_head.weight", "model.embed_tokens.weight"}
    assert sorted(w for k, w in windows if k == "lm_head.weight")[-1][1] == 64  # every row of the head


@pytest.mark.slow
def test_a_drop_untied_head_run_on_two_ranks(titan, tmp_path: Path) -> None:
    """The comparison is collective: under torchrun, the same refusal, and with the flag the same release."""
    tied = ("--config", str(titan["tied.json"]))
    proc = ckptconv("dcp-to-hf", str(titan["untied"]), str(tmp_path / "a"), *MAPPING, *tied, nproc=2)
    assert proc.returncode != 0, proc.stderr  # torchrun exits 1 when its ranks exit 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ckptconv: error:")]
    assert len(errors) == 1 and "--drop-untied-head" in errors[0], proc.stderr  # once, rank 0's
    assert not re.search(r'File ".*/ckptconv/\w+\.py"', proc.stderr) and not (tmp_path / "a").exists()
    args = (*MAPPING, *tied, "--drop-untied-head", "--verify", "-q")
    proc = ckptconv("dcp-to-hf", str(titan["untied"]), str(tmp_path / "b"), *args, nproc=2)
    assert proc.returncode == 0, proc.stderr
    proc = ckptconv("dcp-to-hf", str(titan["untied"]), str(tmp_path / "c"), *args)
    assert proc.returncode == 0, proc.stderr
    for name in ("model.safetensors",):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes()


def test_tie_word_embeddings_must_be_true_or_false(titan, tmp_path: Path, capsys) -> None:
    """Today `"tie_word_embeddings": "false"` ties (a non-empty string is truthy) and drops the head silently.
    null is read as absent (false): the head is written."""
    config = json.loads(titan["tied.json"].read_text())
    args = ("dcp-to-hf", str(titan["untied"]), str(tmp_path / "out"), *MAPPING, "--config")
    for value in ("false", "true", 1, None):
        (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": value}))
        code, err = run(capsys, *args, str(tmp_path / "config.json"), "-q")
        if value is None:
            assert code == 0, err
            assert "lm_head.weight" in load_file(tmp_path / "out" / "model.safetensors")
        else:
            assert_one_line(code, err, "tie_word_embeddings", repr(value), "true or false")


# --- the stash --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF release with a ckptconv_state.json dcp-to-hf wrote: a step, nested args, a 0-d step tensor, and
    an argparse.Namespace kept as its torch.save bytes."""
    import argparse

    root = tmp_path_factory.mktemp("stash")
    state = {
        "model": {"w": torch.randn(8, 8)},
        "step": 7,
        "args": {"lr": 0.1, "name": "x"},
        "train_state": {"step": torch.tensor(5)},
        "ns": argparse.Namespace(lr=0.1),
    }
    save_dcp(state, root / "dcp")
    cli("dcp-to-hf", str(root / "dcp"), str(root / "hf"), "-q")
    return root / "hf"


def _items(hf: Path) -> list[dict[str, Any]]:
    return json.loads((hf / "ckptconv_state.json").read_text())["items"]


def _with_items(stashed: Path, path: Path, items: list[dict[str, Any]] | str) -> Path:
    shutil.copytree(stashed, path)
    doc = json.loads((path / "ckptconv_state.json").read_text())
    text = items if isinstance(items, str) else json.dumps({**doc, "items": items})
    (path / "ckptconv_state.json").write_text(text)
    return path


def _edit(items: list[dict[str, Any]], name: str, **fields: Any) -> list[dict[str, Any]]:
    return [{**e, **fields} if e["key"] == name else e for e in items]


def _not_a_zip() -> str:
    return base64.b64encode(b"hello, not torch.save").decode()


STASH_CASES = {
    "base64 that is not torch.save": (
        lambda i: _edit(i, "ns", torch_save_b64=_not_a_zip()),
        "torch_save_b64",
    ),
    "no value and no bytes": (
        lambda i: [{k: v for k, v in e.items() if k != "value"} for e in i],
        "torch_save_b64",
    ),
    "a key twice": (lambda i: [*i, i[0]], "appears twice"),
    "an empty key": (lambda i: _edit(i, "step", key="", path=[""]), "'key'"),
    "an empty path": (lambda i: _edit(i, "step", path=[]), "'path'"),
    "a path that is a string": (lambda i: _edit(i, "step", path="step"), "'path'"),
    "a key that is not its path": (lambda i: _edit(i, "step", key="stepp"), "dotted 'path'"),
    "an item inside another": (lambda i: [*i, {"key": "step.x", "path": ["step", "x"], "value": 1}], "holds"),
    "a value its dtype overflows": (
        lambda i: _edit(i, "train_state.step", value=1e10, tensor="float16"),
        "float16",
    ),
    "a value of another type": (lambda i: _edit(i, "train_state.step", value="x"), "int64"),
    "an int beyond int64": (lambda i: _edit(i, "train_state.step", value=2**70), "int64"),
}


@pytest.mark.parametrize("case", list(STASH_CASES))
def test_a_stash_item_that_does_not_decode_is_one_line(stashed, tmp_path: Path, capsys, case: str) -> None:
    """Today: written into the DCP with exit 0 (bytes torch.load cannot read, a key's last copy winning, a
    path read as its letters, 1e10 as an fp16 inf), or a traceback (an empty path, a nested item, a string
    value)."""
    edit, needle = STASH_CASES[case]
    src = _with_items(stashed, tmp_path / "hf", edit(_items(stashed)))
    code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert_one_line(code, err, "ckptconv_state.json", needle)
    assert not (tmp_path / "out").exists()


def test_a_stash_round_trips_and_its_json_may_not_repeat_a_key(stashed, tmp_path: Path, capsys) -> None:
    """What dcp-to-hf wrote reads back (the checks refuse none of it); an object with a key twice, or a NaN
    (which dcp-to-hf never writes as a value), is refused: today the last "value" wins silently."""
    ok(capsys, "hf-to-dcp", str(stashed), str(tmp_path / "back"), "-q")
    from ckptconv.formats.dcp import open_dcp

    assert {"step", "args.lr", "args.name", "train_state.step", "ns"} <= set(
        open_dcp(tmp_path / "back").items
    ) | set(open_dcp(tmp_path / "back").tensors)
    text = (stashed / "ckptconv_state.json").read_text()
    twice = text.replace('"value": 7', '"value": 7, "value": 8', 1)
    assert twice != text
    src = _with_items(stashed, tmp_path / "twice", twice)
    code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert_one_line(code, err, "ckptconv_state.json", "'value' appears twice")
    src = _with_items(stashed, tmp_path / "nan", text.replace('"value": 7', '"value": NaN', 1))
    code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert_one_line(code, err, "ckptconv_state.json", "NaN")


# --- keys: twice in a JSON object, empty ------------------------------------------------------------------


def test_json_objects_with_a_key_twice_are_refused(titan, peft, tmp_path: Path, capsys) -> None:
    """config.json, adapter_config.json, a safetensors index: today the last value wins, silently (another
    reader may take the first)."""
    config = titan["tied.json"].read_text()
    twice = config.replace('"num_attention_heads": 4', '"num_attention_heads": 4, "num_attention_heads": 2')
    assert twice != config
    (tmp_path / "config.json").write_text(twice)
    args = (str(titan["untied"]), str(tmp_path / "out"), *MAPPING, "--config", str(tmp_path / "config.json"))
    code, err = run(capsys, "dcp-to-hf", *args)
    assert_one_line(code, err, "config.json", "'num_attention_heads' appears twice")

    src = lora_ckpt(peft, tmp_path / "lora")
    text = (src / "adapter_config.json").read_text()
    (src / "adapter_config.json").write_text(
        text.replace('"lora_alpha": 8', '"lora_alpha": 8, "lora_alpha": 80')
    )
    code, err = run(capsys, "dcp-to-hf", str(src), str(tmp_path / "out"), "--lora", "merge")
    assert_one_line(code, err, "adapter_config.json", "'lora_alpha' appears twice")

    hf = tmp_path / "sharded"
    hf.mkdir()
    save_file({"a": torch.ones(2)}, hf / "one.safetensors")
    save_file({"b": torch.ones(2)}, hf / "two.safetensors")
    index = '{"weight_map": {"a": "one.safetensors", "b": "two.safetensors", "a": "two.safetensors"}}'
    (hf / "model.safetensors.index.json").write_text(index)
    code, err = run(capsys, "hf-to-dcp", str(hf), str(tmp_path / "out"))
    assert_one_line(code, err, "model.safetensors.index.json", "'a' appears twice")


def test_empty_tensor_names_are_refused(tmp_path: Path, capsys) -> None:
    """An HF file naming a tensor '' converted with exit 0 today; a DCP one was refused as if --prefix had
    emptied it."""
    (tmp_path / "hf").mkdir()
    save_file({"": torch.ones(2), "a": torch.ones(2)}, tmp_path / "hf" / "model.safetensors")
    for src in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors"):
        code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
        assert_one_line(code, err, "model.safetensors", "empty name")
    save_dcp({"": torch.ones(2), "a": torch.ones(3)}, tmp_path / "dcp")
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "out"))
    assert_one_line(code, err, str(tmp_path / "dcp"), "empty name")
    assert "--prefix" not in err


# --- casts and FP8 ----------------------------------------------------------------------------------------


def test_fp8_blocks_too_small_for_a_normal_scale_quantize_to_zeros_not_nan() -> None:
    """s = amax / 448 underflows to 0 for amax below about 6e-43: today 0 / 0 gives NaN for the block's zeros
    (and the dequantized block is all NaN). The scale of such a block is now the smallest normal fp32, and
    every other block keeps the reference's bytes."""
    w = torch.zeros(256, 128)
    w[0, 0] = 1e-44
    w[128:] = torch.randn(128, 128)
    q, scale = fp8.quantize(w)
    assert not torch.isnan(q.float()).any()
    assert scale[0, 0] == torch.finfo(torch.float32).smallest_normal
    assert torch.equal(fp8.dequantize(q, scale, torch.float32)[:128], torch.zeros(128, 128))
    amax = w[128:].abs().amax()
    assert scale[1, 0] == amax / fp8.FP8_MAX


def test_an_fp16_release_of_values_beyond_its_range_is_refused(tmp_path: Path, capsys) -> None:
    """fp32 1e5 cast to fp16 is inf: today written with exit 0, by dcp-to-hf and by hf-to-dcp. Values within
    range still convert."""
    save_dcp({"model": {"big": torch.full((4, 4), 1e5), "small": torch.ones(4)}}, tmp_path / "dcp")
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "out"), "--dtype", "fp16")
    assert_one_line(code, err, "'big'", "float16")
    assert not (tmp_path / "out").exists()
    ok(
        capsys,
        "dcp-to-hf",
        str(tmp_path / "dcp"),
        str(tmp_path / "ok"),
        "--dtype",
        "fp16",
        "--fp32",
        "big",
        "-q",
    )
    written = load_file(tmp_path / "ok" / "model.safetensors")
    assert written["big"].dtype == torch.float32 and written["small"].dtype == torch.float16
    code, err = run(capsys, "hf-to-dcp", str(tmp_path / "ok"), str(tmp_path / "back"), "--dtype", "fp16")
    assert_one_line(code, err, "'big'", "float16")
    assert not (tmp_path / "back").exists()


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    """A DCP's tensors, loaded by torch's own dcp.load."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_save_hf_refuses_a_differing_tied_head_too(titan, tmp_path: Path) -> None:
    """The library's save_hf of a live state dict: the same refusal (naming its keyword), the same drop with
    drop_untied_head=True; a head that is the embedding's own tensor (weights tied in the model) is equal."""
    import ckptconv
    from ckptconv.errors import CkptconvError

    config = json.loads(titan["tied.json"].read_text())
    state = _loaded(titan["untied"])
    with pytest.raises(CkptconvError, match=r"'lm_head\.weight' differs from .*drop_untied_head=True"):
        ckptconv.save_hf(state, tmp_path / "a", mapping="torchtitan-llama3", config=config)
    assert not (tmp_path / "a").exists()
    ckptconv.save_hf(state, tmp_path / "b", mapping="torchtitan-llama3", config=config, drop_untied_head=True)
    assert "lm_head.weight" not in load_file(tmp_path / "b" / "model.safetensors")
    tied_state = {**state, "lm_head.weight": state["tok_embeddings.weight"]}
    ckptconv.save_hf(tied_state, tmp_path / "c", mapping="torchtitan-llama3", config=config)
    assert (
        load_file(tmp_path / "c" / "model.safetensors").keys()
        == load_file(tmp_path / "b" / "model.safetensors").keys()
    )
