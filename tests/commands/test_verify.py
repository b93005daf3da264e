"""verify across formats, --verify in both converters, --json on every command, the README's CI script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, _env, ckptconv
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line

from ckptconv.errors import VerifyMismatch
from ckptconv.run.verify import Tolerance, compare


@pytest.fixture(scope="module")
def converted(fsdp2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fixture checkpoint converted both ways: bf16 HF (fp32 A_log) and back to DCP, and an fp32 HF."""
    root = tmp_path_factory.mktemp("verify")
    paths = {"dcp": fsdp2_ckpt, "hf": root / "hf", "hf32": root / "hf32", "back": root / "back"}
    for args in (
        ("dcp-to-hf", str(fsdp2_ckpt), str(paths["hf"]), "--fp32", "A_log$"),
        ("dcp-to-hf", str(fsdp2_ckpt), str(paths["hf32"]), "--dtype", "keep"),
        ("hf-to-dcp", str(paths["hf32"]), str(paths["back"]), "--prefix", "model."),
    ):
        proc = ckptconv(*args)
        assert proc.returncode == 0, proc.stderr
    return paths


def edited(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the HF directory `src` with its tensors passed through `edit(dict)`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            edit(tensors)
            save_file(tensors, dst / f.name, metadata={"format": "pt"})
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def one_ulp(tensors: dict[str, torch.Tensor]) -> None:
    t = tensors["layers.0.up.weight"]
    bits = {2: torch.int16, 4: torch.int32}[t.element_size()]
    t.view(bits).view(-1)[3] += 1


@pytest.mark.parametrize(
    ("a", "b"),
    [("dcp", "hf"), ("hf32", "hf"), ("dcp", "hf32"), ("hf32", "dcp"), ("hf32", "back"), ("back", "dcp")],
)
def test_correct_conversions_match_in_every_direction(converted: dict[str, Path], a: str, b: str) -> None:
    proc = ckptconv("verify", str(converted[a]), str(converted[b]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("match: 16 tensors equal bit for bit")


def test_single_safetensors_file_against_dcp(converted: dict[str, Path]) -> None:
    proc = ckptconv("verify", str(converted["hf32"] / "model.safetensors"), str(converted["dcp"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_one_ulp_is_a_mismatch_naming_the_key_and_tolerance_accepts_it(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    bad = edited(converted["hf"], tmp_path / "ulp", one_ulp)
    proc = ckptconv("verify", str(converted["dcp"]), str(bad))
    assert proc.returncode == 1
    assert "layers.0.up.weight: 1 of 60 elements differ" in proc.stdout
    assert proc.stderr.splitlines()[-1].startswith("ckptconv: error: 1 mismatch(es) between")
    ok = ckptconv("verify", str(converted["dcp"]), str(bad), "--rtol", "0.01")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "within atol 0.0, rtol 0.01" in ok.stdout


def test_sign_flip_is_rejected_even_with_tolerance(converted: dict[str, Path], tmp_path: Path) -> None:
    def flip(tensors: dict[str, torch.Tensor]) -> None:
        tensors["layers.1.norm.weight"][0] *= -1

    bad = edited(converted["hf"], tmp_path / "flip", flip)
    proc = ckptconv("verify", str(converted["dcp"]), str(bad), "--rtol", "0.01", "--atol", "1e-3")
    assert proc.returncode == 1
    assert "layers.1.norm.weight: 1 of 6 elements differ" in proc.stdout


def test_removed_key_and_changed_dtype_are_mismatches(converted: dict[str, Path], tmp_path: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["layers.1.down.weight"]
        tensors["embed.weight"] = tensors["embed.weight"].float()  # bf16 values in fp32: not the fp32 source

    bad = edited(converted["hf"], tmp_path / "changed", change)
    proc = ckptconv("verify", str(converted["dcp"]), str(bad), "--json")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document
    assert not doc["match"]
    kinds = {m["key"]: m for m in doc["mismatches"]}
    assert kinds["layers.1.down.weight"]["kind"] == "only_in_a"
    assert kinds["embed.weight"]["kind"] == "values"
    assert (
        kinds["embed.weight"]["b"]["dtype"] == "float32" and kinds["embed.weight"]["a"]["dtype"] == "float32"
    )
    assert kinds["embed.weight"]["max_abs_diff"] > 0


def test_shape_change_is_a_mismatch(converted: dict[str, Path], tmp_path: Path) -> None:
    def reshape(tensors: dict[str, torch.Tensor]) -> None:
        tensors["embed.weight"] = tensors["embed.weight"][:-1].clone()

    bad = edited(converted["hf"], tmp_path / "shape", reshape)
    proc = ckptconv("verify", str(converted["dcp"]), str(bad))
    assert proc.returncode == 1
    assert "embed.weight: shape differs, A float32[11, 6] vs B bfloat16[10, 6]" in proc.stdout


def test_same_verdict_on_one_and_two_ranks(converted: dict[str, Path], tmp_path: Path) -> None:
    def two(tensors: dict[str, torch.Tensor]) -> None:
        one_ulp(tensors)
        tensors["layers.1.up.bias"][1] += 1

    bad = edited(converted["hf"], tmp_path / "two", two)
    docs = []
    for nproc in (0, 2):
        proc = ckptconv("verify", str(converted["dcp"]), str(bad), "--json", nproc=nproc)
        assert proc.returncode == 1, proc.stderr
        doc = json.loads(proc.stdout)
        docs.append((doc["mismatches"], doc["compared"], doc["compared_bytes"]))
        assert proc.stderr.count("mismatch(es)") == 1  # rank 0 reports, once
    assert docs[0] == docs[1]
    assert [m["key"] for m in docs[0][0]] == ["layers.0.up.weight", "layers.1.up.bias"]
    ok = ckptconv("verify", str(converted["dcp"]), str(converted["hf"]), nproc=2)
    assert ok.returncode == 0 and ok.stdout.count("match: 16 tensors") == 1, ok.stderr


def test_bad_inputs_exit_2(converted: dict[str, Path], tmp_path: Path) -> None:
    proc = ckptconv("verify", str(tmp_path / "nope"), str(converted["hf"]))
    assert_one_line(proc.returncode, proc.stderr, "no such file or directory")
    truncated = tmp_path / "trunc.safetensors"
    data = (converted["hf"] / "model.safetensors").read_bytes()
    truncated.write_bytes(data[: len(data) - 40])
    proc = ckptconv("verify", str(converted["dcp"]), str(truncated))
    assert_one_line(proc.returncode, proc.stderr, "trunc.safetensors")
    proc = ckptconv("verify", str(converted["dcp"]), str(converted["hf"]), "--atol", "-1")
    assert_one_line(proc.returncode, proc.stderr, "--atol -1.0: must be a number >= 0")
    proc = ckptconv("verify", str(converted["hf"]), str(converted["hf32"]), "--mapping", "torchtitan-llama3")
    assert_one_line(proc.returncode, proc.stderr, "--mapping applies to DCP checkpoints")


def test_compare_rules() -> None:
    a = torch.tensor([1.0, float("nan"), 0.0, float("inf")])
    assert compare("k", a, a.clone()) is None  # NaN with the same bits is equal
    neg_zero = torch.tensor([1.0, float("nan"), -0.0, float("inf")])
    finding = compare("k", a, neg_zero)
    assert finding is not None and finding.differing == 1  # bit for bit: -0.0 is not 0.0
    assert compare("k", a, neg_zero, Tolerance(0.0, 0.0)) is None  # by value it is
    assert compare("k", torch.tensor(3, dtype=torch.int64), torch.tensor(3, dtype=torch.int32)) is None
    flags = torch.tensor([True, False])
    got = compare("k", flags, ~flags)
    assert got is not None and got.differing == 2 and got.max_abs_diff == 1.0
    assert compare("k", torch.ones(2, 3), torch.ones(3, 2)) is not None


def corrupt_one_element(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """A simulated writer bug: the first element of tensor `key` is written one too high."""
    from ckptconv.formats.safetensors_io import SafetensorsWriter

    real_write = SafetensorsWriter.write

    def corrupting_write(self: SafetensorsWriter, name: str, tensor: torch.Tensor, start: int = 0) -> None:
        if name == key:
            tensor = tensor.clone()
            tensor.view(-1)[0] += 1
        real_write(self, name, tensor, start)

    monkeypatch.setattr(SafetensorsWriter, "write", corrupting_write)


def test_verify_flag_refuses_to_publish_a_wrong_output(
    converted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion whose written bytes differ from the source (a simulated writer bug) is caught by --verify:
    exit 1, and OUT does not exist."""
    from ckptconv.job.ui import Ui
    from ckptconv.job.world import World
    from ckptconv.options import DcpToHfOptions, OutputOptions
    from ckptconv.run import dcp_to_hf as convert

    corrupt_one_element(monkeypatch, "layers.0.up.weight")
    out = tmp_path / "out"
    with pytest.raises(VerifyMismatch, match=r"layers\.0\.up\.weight: 1 of 60 elements differ"):
        verified = DcpToHfOptions(output=OutputOptions(verify=True))
        convert.dcp_to_hf(converted["dcp"], out, verified, world=World(), ui=Ui(quiet=True))
    assert not out.exists() and not list(tmp_path.iterdir())
    convert.dcp_to_hf(converted["dcp"], out, world=World(), ui=Ui(quiet=True))
    assert (out / "model.safetensors").exists()  # without --verify the same bug goes unnoticed


def test_converters_verify_and_report_json(converted: dict[str, Path], tmp_path: Path) -> None:
    proc = ckptconv(
        "dcp-to-hf", str(converted["dcp"]), str(tmp_path / "hf"), "--verify", "--json", "--fp32", "nothing$"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["command"] == "dcp-to-hf" and doc["verified"] is True and doc["num_tensors"] == 16
    assert doc["files"][0]["name"] == "model.safetensors" and doc["total_size"] > 0
    assert any("nothing$" in w for w in doc["warnings"]) and doc["seconds"] > 0
    assert "verified: 16 tensors" in proc.stderr
    proc = ckptconv("hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--verify", "--json", nproc=2)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["command"] == "hf-to-dcp" and doc["verified"] is True and ".metadata" in doc["written_files"]
    doc = json.loads(ckptconv("inspect", str(tmp_path / "dcp"), "--json").stdout)
    assert doc["format"] == "dcp" and doc["num_tensors"] == 16


def test_progress_lines_when_not_a_terminal(converted: dict[str, Path], tmp_path: Path) -> None:
    env = {**_env(), "CKPTCONV_LOG_EVERY_S": "0"}
    cmd = [sys.executable, "-m", "ckptconv", "verify", str(converted["dcp"]), str(converted["hf"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0
    assert "rank 0 of 1: verifying: 100% (" in proc.stderr
    quiet = subprocess.run(
        [*cmd, "--quiet"], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL
    )
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_readme_ci_script_converts_verifies_and_fails_on_mismatch(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    script = ROOT / "examples" / "ci-convert.sh"
    assert "examples/ci-convert.sh" in (ROOT / "README.md").read_text()
    env = {**_env(), "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    out = tmp_path / "release"
    proc = subprocess.run(
        ["bash", str(script), str(converted["dcp"]), str(out)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "model.safetensors").exists() and (tmp_path / "release.report.json").exists()
    bad = edited(out, tmp_path / "bad", one_ulp)
    proc = subprocess.run(
        ["bash", str(script), str(converted["dcp"]), str(bad), "--check-only"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "layers.0.up.weight" in proc.stdout + proc.stderr
