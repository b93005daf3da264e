"""`--resume`: a 2-rank dcp-to-hf run stopped (one rank SIGKILLed; torchrun SIGTERMed) once every rank
recorded a file, then resumed at 2 ranks and at 1: the output is byte-identical to an uninterrupted run's and
the resumed run reads and writes less; a changed source or --dtype is refused with one line, a corrupted kept
file is written again."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import _env, ckptconv, tree_sha256
from test_bad_input import assert_one_line

from ckptconv.publish.outdir import staging_dir
from ckptconv.publish.resume import RECORDS

WORKER = Path(__file__).parents[1] / "support" / "workers" / "paused_cli.py"
ARGS = ["--max-shard-size", "300KB", "--bucket-size", "1MB"]


def _save(path: Path, seed: int) -> Path:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(seed)
    state = {"model": {f"layers.{i}.w": torch.randn(256, 512, generator=g) for i in range(8)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _stopped(src: Path, out: Path, pause: Path, how: str) -> subprocess.CompletedProcess[str]:
    """A 2-rank run of `paused_cli`, stopped (`how`: "kill" rank 1, "term" torchrun) once each rank has
    recorded a file."""
    pause.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    env = {**_env(), "PAUSE_DIR": str(pause), "CKPTCONV_TIMEOUT_S": "30"}
    pipe = subprocess.PIPE
    args = [*cmd, "dcp-to-hf", str(src), str(out), *ARGS]
    agent = subprocess.Popen(args, stdout=pipe, stderr=pipe, text=True, env=env)
    deadline = time.monotonic() + 120
    while not ((pause / "0").exists() and (pause / "1").exists()):
        assert agent.poll() is None, agent.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if how == "kill":
        workers = sorted(psutil.Process(agent.pid).children(), key=lambda p: p.create_time())
        workers[1].kill()
    else:
        agent.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    for flag in pause.iterdir():
        flag.unlink()
    stdout, stderr = agent.communicate(timeout=120)
    assert agent.returncode != 0 and not out.exists()
    return subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr)


def _json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _moved(doc: dict) -> tuple[int, int]:
    return sum(r["bytes_read"] for r in doc["ranks"]), sum(r["bytes_written"] for r in doc["ranks"])


def _copy_staging(out: Path, to: Path) -> None:
    shutil.copytree(staging_dir(out), staging_dir(to), symlinks=True)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_stopped_run_resumes_at_any_world_size_to_the_same_bytes(tmp_path: Path) -> None:
    src = _save(tmp_path / "src", 0)
    ref = tmp_path / "ref"
    full = _json(ckptconv("dcp-to-hf", str(src), str(ref), *ARGS, "--json"))
    assert len(full["files"]) >= 4

    # SIGKILL of rank 1: staging and its records stay; copies of it resume at 2 ranks, at 1, corrupted, ...
    out = tmp_path / "out"
    _stopped(src, out, tmp_path / "pause1", "kill")
    records = list((staging_dir(out) / RECORDS).iterdir())
    assert records
    copies = {name: tmp_path / name for name in ("one", "flipped", "dtype", "changed")}
    for to in copies.values():
        _copy_staging(out, to)

    resumed = _json(ckptconv("dcp-to-hf", str(src), str(out), *ARGS, "--resume", "--json", nproc=2))
    assert tree_sha256(out) == tree_sha256(ref) and not (out / RECORDS).exists()
    read, written = _moved(resumed)
    assert written < _moved(full)[1] and read < _moved(full)[0]
    assert resumed["resumed"]

    one = copies["one"]
    resumed1 = _json(ckptconv("dcp-to-hf", str(src), str(one), *ARGS, "--resume", "--json"))
    assert tree_sha256(one) == tree_sha256(ref) and _moved(resumed1)[1] < _moved(full)[1]

    # a byte of a kept file flipped in staging: that file is written again
    flipped = copies["flipped"]
    kept = sorted(p for p in staging_dir(flipped).glob("*.safetensors"))
    victim = next(p for p in kept if any(r.name.startswith(p.name) for r in records))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc = _json(ckptconv("dcp-to-hf", str(src), str(flipped), *ARGS, "--resume", "--json"))
    assert tree_sha256(flipped) == tree_sha256(ref) and victim.name not in proc["resumed"]

    # another --dtype, or a source rewritten since: one line, exit 2, staging and OUT untouched
    before = tree_sha256(staging_dir(copies["dtype"]))
    proc = ckptconv("dcp-to-hf", str(src), str(copies["dtype"]), *ARGS, "--resume", "--dtype", "fp16")
    where = str(staging_dir(copies["dtype"]))
    assert_one_line(proc.returncode, proc.stderr, "the options changed since", where)
    assert not copies["dtype"].exists() and tree_sha256(staging_dir(copies["dtype"])) == before
    _save(src, 1)
    proc = ckptconv("dcp-to-hf", str(src), str(copies["changed"]), *ARGS, "--resume")
    assert_one_line(proc.returncode, proc.stderr, "the source changed since", "rerun without --resume")
    assert not copies["changed"].exists()


@pytest.mark.slow
def test_sigterm_keeps_the_recorded_files_and_says_so(tmp_path: Path) -> None:
    src = _save(tmp_path / "src", 2)
    ref = tmp_path / "ref"
    assert ckptconv("dcp-to-hf", str(src), str(ref), *ARGS).returncode == 0
    out = tmp_path / "out"
    stopped = _stopped(src, out, tmp_path / "pause", "term")
    assert "rerun with --resume" in stopped.stderr and str(staging_dir(out)) in stopped.stderr
    again = tmp_path / "again"
    _copy_staging(out, again)
    resumed = _json(ckptconv("dcp-to-hf", str(src), str(out), *ARGS, "--resume", "--json"))
    assert resumed["resumed"] and tree_sha256(out) == tree_sha256(ref)
    # without --resume a kept staging directory is removed and every file written
    assert ckptconv("dcp-to-hf", str(src), str(again), *ARGS).returncode == 0
    assert tree_sha256(again) == tree_sha256(ref) and not staging_dir(again).exists()
