"""dcp-to-hf opens its source before torch is imported, on the process that reads `.metadata`, and reads it
once (ckptconv/source/early.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import WORKERS, _env, tree_sha256
from test_bad_input import assert_one_line

from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import open_dcp
from ckptconv.source.early import open_early


def _audited(
    tmp_path: Path, *args: str, nproc: int = 0
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The command in fresh interpreters, and the `.metadata` opens they made ("RANK TORCH-IMPORTED")."""
    log = tmp_path / "opens.log"
    log.unlink(missing_ok=True)
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []
    cmd = [sys.executable, *launch, str(WORKERS / "audited_cli.py"), *args]
    env = {**_env(), "AUDIT_LOG": str(log)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    return proc, (log.read_text().splitlines() if log.exists() else [])


def test_the_early_checkpoint_is_open_dcps(fsdp2_ckpt: Path, mesh2d_ckpt: Path) -> None:
    for path in (fsdp2_ckpt, mesh2d_ckpt):
        early = open_early(path)
        assert early is not None and early.path == path
        assert early.take() == open_dcp(path)
        with pytest.raises(RuntimeError, match="taken already"):
            early.take()  # given up: not held for the rest of the run


def test_what_is_not_opened_early(fsdp2_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert open_early(tmp_path / "missing") is None  # the conversion says what is wrong, in its order
    assert open_early(Path("s3://bucket/ckpt")) is None  # fetched once, by the conversion
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun rank 0 reads .metadata for all
    assert open_early(fsdp2_ckpt) is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "zero")  # refused by the run before it reads anything
    assert open_early(fsdp2_ckpt) is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a RANK with no job around it: this process reads it
    early = open_early(fsdp2_ckpt)
    assert early is not None and early.take() == open_dcp(fsdp2_ckpt)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "0")
    bad = tmp_path / "bad"
    shutil.copytree(fsdp2_ckpt, bad)
    (bad / ".metadata").write_bytes((bad / ".metadata").read_bytes()[:100])
    early = open_early(bad)
    assert early is not None  # its error is kept, to be raised where the conversion reads .metadata
    with pytest.raises(CkptconvError, match="not a readable DCP metadata file"):
        early.take()


@pytest.mark.parametrize("nproc", [0, 2])
def test_metadata_is_read_once_before_torch(fsdp2_ckpt: Path, tmp_path: Path, nproc: int) -> None:
    out = tmp_path / "out"
    proc, opens = _audited(tmp_path, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--fp32", "A_log$", nproc=nproc)
    assert proc.returncode == 0, proc.stderr
    assert opens == ["0 0"]  # rank 0 alone, once, with torch not imported yet
    run = tmp_path / "run"  # a training run's save directory: the one checkpoint in it is found first
    shutil.copytree(fsdp2_ckpt, run / "step-10")
    proc, opens = _audited(
        tmp_path, "dcp-to-hf", str(run), str(tmp_path / "from-run"), "--fp32", "A_log$", nproc=nproc
    )
    assert proc.returncode == 0, proc.stderr
    assert opens == ["0 0"]
    assert tree_sha256(tmp_path / "from-run") == tree_sha256(out)
    plain = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptconv",
            "dcp-to-hf",
            str(fsdp2_ckpt),
            str(tmp_path / "plain"),
            "--fp32",
            "A_log$",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        stdin=subprocess.DEVNULL,
    )
    assert plain.returncode == 0, plain.stderr
    assert tree_sha256(out) == tree_sha256(tmp_path / "plain")


def test_an_early_error_is_raised_in_its_place_and_read_once(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(fsdp2_ckpt, bad)
    (bad / ".metadata").write_bytes((bad / ".metadata").read_bytes()[:100])
    proc, opens = _audited(tmp_path, "dcp-to-hf", str(bad), str(tmp_path / "out"))
    assert_one_line(proc.returncode, proc.stderr, str(bad / ".metadata"), "not a readable DCP metadata file")
    assert opens == ["0 0"]  # not read again to say so
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [(["--max-shard-size", "5XB"], ["--max-shard-size"]), (["--bucket-size", "0"], ["--bucket-size"])],
)
def test_a_refused_flag_or_out_comes_first_with_nothing_read(
    fsdp2_ckpt: Path, tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    """What the conversion refuses before reading `.metadata` is refused before the early read too."""
    proc, opens = _audited(tmp_path, "dcp-to-hf", str(fsdp2_ckpt), str(tmp_path / "out"), *args)
    assert_one_line(proc.returncode, proc.stderr, *needles)
    assert opens == []
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    proc, opens = _audited(tmp_path, "dcp-to-hf", str(fsdp2_ckpt), str(taken))
    assert_one_line(proc.returncode, proc.stderr, str(taken), "not a checkpoint")
    assert opens == [] and (taken / "notes.txt").read_text() == "mine"


def test_trusted_metadata_is_loaded_once(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """Under --trust-pickle what `.metadata` holds runs (the user trusts it), and only once."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fsdp2_ckpt, ckpt)
    marker = tmp_path / "ran"
    import pickle

    (ckpt / ".metadata").write_bytes(pickle.dumps(_Append(marker)))
    proc, opens = _audited(tmp_path, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--trust-pickle")
    assert_one_line(proc.returncode, proc.stderr, "not DCP Metadata")
    assert marker.read_text() == "x\n" and opens == ["0 0"]


class _Append:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (f"echo x >> {self.marker}",))
