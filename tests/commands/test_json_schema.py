"""The --json reports against their published schema (ckptconv/cli/report.schema.json, issue #22 point 3):
every command and outcome (success, dry run, exit 2, verify mismatch) validated with the jsonschema package,
every field a report has named by the schema, and the schema strict enough to reject a broken report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import WORKERS, ckptconv, torchrun

from ckptconv.cli.schema import SCHEMA_VERSION, load

SCHEMA = load()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
BRANCH = {"dcp-to-hf": "dcp_to_hf", "hf-to-dcp": "hf_to_dcp", "inspect": "inspect", "verify": "verify"}


def report(*args: str, code: int = 0, nproc: int = 0) -> dict[str, Any]:
    proc = ckptconv(*args, "--json", nproc=nproc)
    assert proc.returncode == code, proc.stderr
    doc = json.loads(proc.stdout)  # exactly one document: json.loads refuses anything after it
    VALIDATOR.validate(doc)
    assert doc["schema_version"] == SCHEMA_VERSION
    if "error" not in doc:  # the schema names every field the report has (no undocumented field)
        assert set(doc) <= set(SCHEMA["$defs"][BRANCH[doc["command"]]]["properties"]) | {"schema_version"}
    return doc


def test_the_schema_is_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_every_command_and_outcome_validates(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    out, dcp_out = tmp_path / "hf", tmp_path / "dcp"
    dry = report("dcp-to-hf", str(fsdp2_ckpt), str(out), "--dry-run")
    assert dry["dry_run"] is True and dry["ranks"] == [] and dry["lora"] is None
    done = report("dcp-to-hf", str(fsdp2_ckpt), str(out), "--verify")
    assert done["verified"] is True and done["files"]
    report("hf-to-dcp", str(out), str(dcp_out), "--dry-run")
    assert report("hf-to-dcp", str(out), str(dcp_out))["written_files"]
    assert report("inspect", str(fsdp2_ckpt))["format"] == "dcp"
    assert report("inspect", str(out))["format"] == "safetensors"
    assert report("verify", str(fsdp2_ckpt), str(out))["match"] is True
    mismatch = report("verify", str(out), str(fsdp2_ckpt), code=1)  # bf16 cast back to fp32: values differ
    assert mismatch["match"] is False and mismatch["mismatches"]


@pytest.mark.parametrize(
    "args",
    [
        ("dcp-to-hf", "/nonexistent", "/tmp/out"),
        ("hf-to-dcp", "/nonexistent", "/tmp/out"),
        ("inspect", "/nonexistent"),
        ("verify", "/nonexistent", "/nonexistent"),
        ("dcp-to-hf", "--no-such-flag"),
        ("no-such-command",),
    ],
)
def test_exit_2_is_an_error_report(args: tuple[str, ...]) -> None:
    doc = report(*args, code=2)
    assert doc["error"]["exit_code"] == 2 and doc["error"]["message"].startswith("ckptconv: error: ")
    assert doc["command"] == (args[0] if args[0] != "no-such-command" else None)


def test_the_schema_rejects_a_broken_report(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    doc = report("dcp-to-hf", str(fsdp2_ckpt), str(tmp_path / "hf"), "--dry-run")
    for broken in (
        {k: v for k, v in doc.items() if k != "files"},
        {**doc, "schema_version": 2},
        {**doc, "num_tensors": "12"},
        {**doc, "files": [{**doc["files"][0], "tensors": [{"key": "x"}]}]},
    ):
        assert not VALIDATOR.is_valid(broken)
    verify_doc = report("verify", str(fsdp2_ckpt), str(fsdp2_ckpt))
    assert not VALIDATOR.is_valid({**verify_doc, "match": False})  # a mismatch names what differs


@pytest.mark.slow
def test_one_error_report_under_torchrun(tmp_path: Path) -> None:
    """Every rank fails alike; rank 0 alone writes the report (torchrun itself then exits 1)."""
    proc = ckptconv("dcp-to-hf", "/nonexistent", str(tmp_path / "out"), "--json", nproc=2)
    assert proc.returncode != 0
    doc = json.loads(proc.stdout)  # one document, not one per rank
    VALIDATOR.validate(doc)
    assert doc["command"] == "dcp-to-hf" and doc["error"]["exit_code"] == 2


@pytest.mark.slow
def test_a_slow_rank_0_still_writes_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun stops every other rank (SIGTERM) once one ends with an error: the ranks wait until rank 0
    has said the error they all raised (a CI run lost the report when rank 1 ended first)."""
    monkeypatch.setenv("SLOW_REPORT_S", "2")
    worker = str(WORKERS / "slow_report_cli.py")
    proc = torchrun(2, worker, "dcp-to-hf", "/nonexistent", str(tmp_path / "out"), "--json", check=False)
    assert proc.returncode != 0
    doc = json.loads(proc.stdout)
    assert doc["error"]["message"] == "ckptconv: error: /nonexistent: no such file or directory"
    assert proc.stderr.count("ckptconv: error:") == 1  # rank 0 alone says it
