"""Malformed fields (issue #34 item 5): every malformed field of a file ckptconv reads is one line and exit 2,
never an IndexError, TypeError, ZeroDivisionError or KeyError traceback; CKPTCONV_DEBUG=0 means off; a closed
stdout is neither a verify mismatch nor a traceback.

The fields come from real files: PEFT's own adapter_config.json, the stash dcp-to-hf writes, ckptconv's
mapping presets (a rule changed by text), config.json of a transformers model; each is replaced in turn by
values of the wrong type or range and the CLI run on it, in this process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT
from families import tiny
from safetensors.torch import save_file
from test_bad_input import assert_one_line, run

WRONG: list[Any] = [
    None,
    [],
    {},
    "x",
    "",
    -1,
    0,
    10**30,
    1.5,
    True,
    [1, 2],
    {"q_proj": "x"},
    math.nan,
    math.inf,
]


def cli(*argv: str) -> None:
    """The CLI in this process, for fixtures: it must succeed."""
    from ckptconv.cli.app import main

    try:
        main(list(argv))
    except SystemExit as e:
        assert not e.code, e


def one_line_or_ok(code: int, err: str) -> None:
    """Exit 0, or exit 2 with one line: never a traceback (an exception would have left `run` already)."""
    if code != 0:
        assert_one_line(code, err)


# --- adapter_config.json --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A PEFT LoRA model of a tiny Llama saved with dcp.save, and PEFT's adapter_config.json for it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny("llama", root / "base"), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(root / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": peft_model.state_dict()}, checkpoint_id=str(root / "dcp"), no_dist=True)
    return root / "dcp", json.loads((root / "adapter" / "adapter_config.json").read_text())


FLAGS = ("use_rslora", "use_dora", "fan_in_fan_out")


def refused(field: str, value: Any) -> bool:
    """Whether dcp-to-hf must refuse `value` as the adapter config's `field` (the others are fine values)."""
    number = type(value) in (int, float) and math.isfinite(value)
    if field == "r":
        return True  # the factors have rank 4: any other r is another run's config
    if field == "lora_alpha":
        return not number
    if field in FLAGS:  # True: rsLoRA is merged; DoRA without magnitudes, Conv1D merges are refused
        return not (value is None or value is False or (value is True and field == "use_rslora"))
    if field.endswith("_pattern"):
        return value not in (None, {})
    if field == "target_parameters":
        return value not in (None, [])
    return True  # peft_type: LORA only


def test_every_adapter_config_field_read_wrong_is_one_line(lora, tmp_path: Path, capsys) -> None:
    """Each field ckptconv reads, replaced by values of every wrong type: exit 2 with one line where the value
    is not one PEFT's config holds, else a conversion. Today a string rank_pattern or alpha_pattern is a
    ValueError traceback, a string alpha_pattern value a TypeError one, `"use_rslora": "x"` turns rsLoRA
    on."""
    src, config = lora
    fields = ["r", "lora_alpha", *FLAGS, "rank_pattern", "alpha_pattern", "target_parameters", "peft_type"]
    for field in fields:
        for value in WRONG:
            (tmp_path / "adapter_config.json").write_text(json.dumps({**config, field: value}))
            flags = ("--lora-config", str(tmp_path / "adapter_config.json"), "-q")
            code, err = run(capsys, "dcp-to-hf", str(src), str(tmp_path / "out"), "--lora", "merge", *flags)
            one_line_or_ok(code, err)
            assert (code == 2) == refused(field, value), (field, value, err)
            shutil.rmtree(tmp_path / "out", ignore_errors=True)


# --- the stash ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF release whose ckptconv_state.json dcp-to-hf wrote: a step, a nested value, a 0-d tensor."""
    root = tmp_path_factory.mktemp("stash")
    state = {
        "model": {"w": torch.ones(2, 2)},
        "step": 7,
        "args": {"lr": 0.1},
        "train_state": {"step": torch.tensor(5)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    cli("dcp-to-hf", str(root / "dcp"), str(root / "hf"), "-q")
    return root / "hf"


def test_every_stash_field_wrong_is_one_line(stashed, tmp_path: Path, capsys) -> None:
    """Each field of each item, replaced by values of every wrong type: exit 0 or one line. Today an empty
    path is an IndexError traceback, a path under another item's a TypeError one, a string as a 0-d tensor's
    value a TypeError one."""
    doc = json.loads((stashed / "ckptconv_state.json").read_text())
    src = tmp_path / "hf"
    shutil.copytree(stashed, src)
    for index in range(len(doc["items"])):
        for field in ("key", "path", "value", "tensor"):
            for value in [*WRONG, ["args"], ["step", "x"]]:
                items = [dict(e) for e in doc["items"]]
                items[index][field] = value
                (src / "ckptconv_state.json").write_text(json.dumps({**doc, "items": items}))
                code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"), "-q")
                one_line_or_ok(code, err)
                shutil.rmtree(tmp_path / "out", ignore_errors=True)


# --- mapping files --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (HF), and it as a torchtitan DCP and a Megatron-Core one, through ckptconv's presets."""
    root = tmp_path_factory.mktemp("models")
    hf = tiny("llama", root / "hf")
    cli("hf-to-dcp", str(hf), str(root / "titan"), "--mapping", "torchtitan-llama3", "-q")
    cli("hf-to-dcp", str(hf), str(root / "megatron"), "--mapping", "megatron-gpt", "-q")
    return {"hf": hf, "titan": root / "titan", "megatron": root / "megatron"}


def preset(name: str, old: str, new: str, path: Path) -> Path:
    """The preset `name` with its first `old` text replaced by `new`, as a mapping file."""
    text = resources.files("ckptconv.mapping").joinpath("presets", f"{name}.toml").read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


EMBED = 'hf = "model.embed_tokens.weight"'
GROUPS = 'groups = "num_key_value_heads"'
NARROW = 'narrow = "vocab_size"'
MAPPING_CASES = {  # name: (preset, old text, new text, source, command, needles); each a traceback today
    "dim beyond a rename": ("torchtitan-llama3", EMBED, EMBED + "\ndim = 2", "titan", "dcp-to-hf", ["dim 2"]),
    "transpose beyond, to HF": (
        "torchtitan-llama3",
        EMBED,
        EMBED + "\ntranspose = [0, 5]",
        "titan",
        "dcp-to-hf",
        ["transpose [0, 5]"],
    ),
    "transpose beyond, to DCP": (
        "megatron-gpt",
        EMBED,
        EMBED + "\ntranspose = [0, 5]",
        "hf",
        "hf-to-dcp",
        ["transpose [0, 5]"],
    ),
    "dim beyond a narrow, to DCP": ("megatron-gpt", EMBED, EMBED + "\ndim = 2", "hf", "hf-to-dcp", ["dim 2"]),
    "groups 0, to DCP": ("megatron-gpt", GROUPS, "groups = 0", "hf", "hf-to-dcp", ["0 groups"]),
    "groups 0, to HF": ("megatron-gpt", GROUPS, "groups = 0", "megatron", "dcp-to-hf", ["0 groups"]),
    "dim beyond a split": (
        "megatron-gpt",
        "dim = 1\n" + GROUPS,
        "dim = 5\n" + GROUPS,
        "hf",
        "hf-to-dcp",
        ["dim 5"],
    ),
    "narrow -1": ("megatron-gpt", NARROW, "narrow = -1", "megatron", "dcp-to-hf", ["narrow keeps -1"]),
    "narrow '-5'": ("megatron-gpt", NARROW, 'narrow = "-5"', "megatron", "dcp-to-hf", ["narrow keeps -5"]),
    "a placeholder one side lacks": (
        "megatron-gpt",
        'runtime = "embedding.word_embeddings.weight"',
        'runtime = "embedding.{layer}.weight"',
        "hf",
        "hf-to-dcp",
        ["{layer}", "fix the mapping"],
    ),
}


@pytest.mark.parametrize("case", list(MAPPING_CASES))
def test_malformed_mapping_fields_are_one_line(models, tmp_path: Path, capsys, case: str) -> None:
    """Today: IndexError (a dim or transpose beyond the tensor's dims), ZeroDivisionError (groups 0),
    AssertionError or RuntimeError (a negative narrow), KeyError (a placeholder only one side has)."""
    name, old, new, source, command, needles = MAPPING_CASES[case]
    path = preset(name, old, new, tmp_path / "m.toml")
    code, err = run(capsys, command, str(models[source]), str(tmp_path / "out"), "--mapping", str(path))
    assert_one_line(code, err, *needles)
    assert not (tmp_path / "out").exists()


# --- CKPTCONV_DEBUG and a closed stdout -----------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTCONV_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ckptconv", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), timeout=120)


def test_ckptconv_debug_0_means_off(tmp_path: Path) -> None:
    """Today CKPTCONV_DEBUG=0 (a non-empty string) shows a traceback; "yes" did too, unchecked."""
    missing = str(tmp_path / "missing")
    for off in ("0", "false", "FALSE", ""):
        proc = _cli("inspect", missing, CKPTCONV_DEBUG=off)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (off, proc.stderr)
        assert proc.stderr.startswith("ckptconv: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for on in ("1", "true"):
        proc = _cli("inspect", missing, CKPTCONV_DEBUG=on)
        assert "Traceback" in proc.stderr and "CkptconvError" in proc.stderr, (on, proc.stderr)
    proc = _cli("inspect", missing, CKPTCONV_DEBUG="yes")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr == "ckptconv: error: CKPTCONV_DEBUG='yes': must be 1 or true (on), 0 or false (off); "
        "fix or unset it\n"
    )


def _closed_stdout(*args: str) -> tuple[int, str]:
    """Run the CLI with its stdout a pipe whose reader is gone before it writes (as `| head` leaves it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptconv", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=_env(),
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away at once: every write of the command meets EPIPE
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


def test_a_closed_stdout_is_not_a_mismatch_nor_a_traceback(tmp_path: Path) -> None:
    """Today a match whose stdout is closed exits 1 (click's code for EPIPE, which reads as a mismatch).
    Now the command's own code: 0 for a match, 1 (with its one line) for a mismatch, 0 for inspect."""
    for name, value in (("a", 0.0), ("b", 1.0)):
        (tmp_path / name).mkdir()
        save_file(
            {f"w{i}": torch.full((2,), value) for i in range(300)}, tmp_path / name / "model.safetensors"
        )
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for args in (("verify", a, a), ("verify", a, a, "--json"), ("inspect", a, "--json"), ("inspect", a)):
        code, err = _closed_stdout(*args)
        assert code == 0 and err == "", (args, code, err)
    code, err = _closed_stdout("verify", a, b)
    assert code == 1 and err == f"ckptconv: error: 300 mismatch(es) between {a} and {b}\n", err
