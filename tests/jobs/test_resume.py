"""`--resume`: a 2-rank dcp-to-hf run stopped (one rank SIGKILLed; torchrun SIGTERMed) once every rank
recorded a file, then resumed at 2 ranks and at 1: the output is byte-identical to an uninterrupted run's and
the resumed run reads and writes less; a changed source or --dtype is refused with one line, a corrupted kept
file is written again. hf-to-dcp the same, resumed at 2 ranks only (another number: one line); an OUT in
an object store other than S3 with --resume, where it cannot resume: one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from conftest import _env, ckptconv, s3_options, tree_sha256
from test_bad_input import assert_one_line

from ckptconv.publish.outdir import staging_dir
from ckptconv.publish.records import RECORDS

WORKER = Path(__file__).parents[1] / "support" / "workers" / "paused_cli.py"
ARGS = ["--max-shard-size", "300KB", "--bucket-size", "1MB"]


def _save(path: Path, seed: int) -> Path:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(seed)
    state = {"model": {f"layers.{i}.w": torch.randn(256, 512, generator=g) for i in range(8)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _stopped(
    src: Path, out: Path | str, pause: Path, how: str, args: tuple[str, ...] = ("dcp-to-hf", *ARGS)
) -> subprocess.CompletedProcess[str]:
    """A 2-rank run of `paused_cli` (`args`: the command and its flags), stopped (`how`: "kill" rank 1,
    "term" torchrun) once each rank has recorded a file (into S3, `out` a URL: sent a part)."""
    pause.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    env = {**_env(), "PAUSE_DIR": str(pause), "CKPTCONV_TIMEOUT_S": "30"}
    pipe = subprocess.PIPE
    argv = [*cmd, args[0], str(src), str(out), *args[1:]]
    agent = subprocess.Popen(argv, stdout=pipe, stderr=pipe, text=True, env=env)
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
    assert agent.returncode != 0 and (isinstance(out, str) or not out.exists())
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


def _hf_source(path: Path) -> Path:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    path.mkdir()
    for k in range(2):
        tensors = {f"layers.{2 * k + i}.w": torch.randn(96, 256, generator=g) for i in range(2)}
        save_file(tensors, str(path / f"model-0000{k + 1}-of-00002.safetensors"), metadata={"format": "pt"})
    return path


def _same_dcp(a: Path, b: Path) -> None:
    """The same checkpoint: data files byte for byte, `.metadata` read back alike (but its save id), and
    torch's own dcp.load of both equal."""
    from test_hf_to_dcp import load_plain
    from torch.distributed.checkpoint import FileSystemReader

    data = {p.name: p.read_bytes() for p in sorted(a.glob("*.distcp"))}
    assert data and data == {p.name: p.read_bytes() for p in sorted(b.glob("*.distcp"))}
    ma, mb = (FileSystemReader(str(x)).read_metadata() for x in (a, b))
    assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
    la, lb = load_plain(a), load_plain(b)
    assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)  # type: ignore[arg-type]


@pytest.mark.slow
def test_hf_to_dcp_resumes_at_the_same_number_of_ranks(tmp_path: Path) -> None:
    """Each rank's 4 rows of tensors in 4 files (--max-file-size), written 2 at a time: killed once each
    rank finished one, the files finished are kept and the rest written, to the uninterrupted bytes."""
    src = _hf_source(tmp_path / "hf")
    ref = tmp_path / "ref"
    small = ("--max-file-size", "50KB")
    full = _json(ckptconv("hf-to-dcp", str(src), str(ref), *small, "--json", nproc=2))
    assert len(list(ref.glob("*.distcp"))) == 8
    out = tmp_path / "out"
    _stopped(src, out, tmp_path / "pause", "kill", ("hf-to-dcp", *small))
    assert list((staging_dir(out) / RECORDS).iterdir())
    other = tmp_path / "other"
    _copy_staging(out, other)

    before = tree_sha256(staging_dir(other))
    proc = ckptconv("hf-to-dcp", str(src), str(other), *small, "--resume")
    assert_one_line(proc.returncode, proc.stderr, "written by 2 rank(s)", str(staging_dir(other)))
    assert not other.exists() and tree_sha256(staging_dir(other)) == before

    resumed = _json(ckptconv("hf-to-dcp", str(src), str(out), *small, "--resume", "--json", nproc=2))
    assert len(resumed["resumed"]) >= 2 and not (out / RECORDS).exists()  # one file of each rank at least
    _same_dcp(out, ref)
    read, written = _moved(resumed)
    assert written < _moved(full)[1] and read < _moved(full)[0]


def test_resume_into_a_store_without_s3s_api_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT in an object store other than S3 (fsspec's in-memory one here), where a run cannot be resumed
    (no listing of uploads in progress, no user metadata): one line naming it for either command; nothing
    written. (In S3: tests/object_storage.)"""
    import fsspec

    from ckptconv.cli.app import main

    for command, source in (
        ("dcp-to-hf", _save(tmp_path / "src", 4)),
        ("hf-to-dcp", _hf_source(tmp_path / "hf")),
    ):
        try:
            main([command, str(source), "memory://ckpts/resumed", "--resume"])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        err = capsys.readouterr().err
        where = "--resume: OUT memory://ckpts/resumed is in object storage"
        assert_one_line(code, err, where, "only a run into S3")
    assert not fsspec.filesystem("memory").exists("ckpts/resumed")


def test_an_object_rewritten_with_the_same_size_changes_the_source_stamps(s3_endpoint: str, s3: Any) -> None:
    """A source in object storage: its listing's version (ETag, ...) is in the fingerprint, not the size
    alone."""
    pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")
    from ckptconv.publish.resume import object_stamps
    from ckptconv.remote.files import forget
    from ckptconv.remote.urls import url_path, use_options

    root = url_path("s3://ckpts/stamped")
    assert root is not None
    s3.pipe_file("ckpts/stamped/__0_0.distcp", b"abc")
    use_options(s3_options(s3_endpoint))
    try:
        before = object_stamps(root)
        s3.pipe_file("ckpts/stamped/__0_0.distcp", b"abd")
        forget(root)  # a new run lists afresh; this process has the listing cached
        after = object_stamps(root)
    finally:
        use_options({})
    assert list(before) == list(after) == ["__0_0.distcp"] and before != after
    assert before["__0_0.distcp"][0] == after["__0_0.distcp"][0] == "3"


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The CLI in this process: (exit code, stderr)."""
    from ckptconv.cli.app import main

    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def _mapped_source(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A tiny 2-layer DCP, a mapping TOML naming its keys and the config.json it reads its layers from."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(7)
    state = {"model": {f"layers.{i}.attention.wq.weight": torch.randn(64, 64, generator=g) for i in range(2)}}
    src = tmp_path / "src"
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    toml = tmp_path / "map.toml"
    toml.write_text(
        '[mapping]\nname = "mine"\n[mapping.ranges]\nlayer = "num_hidden_layers"\n[[rule]]\n'
        'runtime = "layers.{layer}.attention.wq.weight"\n'
        'hf = "model.layers.{layer}.self_attn.q_proj.weight"\n'
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2}))
    return src, toml, config


def _edit_in_place(path: Path, old: str, new: str) -> None:
    """Rewrite `path` with `old` replaced by `new` (the same length), its size and mtime set back."""
    st = path.stat()
    text = path.read_text()
    assert len(old) == len(new) and old in text
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_an_option_file_edited_with_its_size_and_mtime_set_back_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run stopped (Ctrl-C) once a file is recorded; the mapping TOML, then --config, then a source data
    file, each written in place with its size and mtime set back: --resume refuses it with one line, naming
    what changed."""
    from ckptconv.publish.resume import Recorder

    src, toml, config = _mapped_source(tmp_path)
    out = tmp_path / "out"
    args = ("dcp-to-hf", str(src), str(out), "--mapping", str(toml), "--config", str(config))
    args += ("--max-shard-size", "20KB", "--no-fsync")
    done = Recorder.done

    def stop(self: Recorder, *a: Any, **k: Any) -> None:
        done(self, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(Recorder, "done", stop)
    code, err = _main(capsys, *args)
    monkeypatch.undo()
    assert code != 0 and staging_dir(out).is_dir() and list((staging_dir(out) / RECORDS).iterdir()), err
    _edit_in_place(toml, "q_proj", "k_proj")
    code, err = _main(capsys, *args, "--resume")
    assert_one_line(code, err, "--resume: the options changed")
    _edit_in_place(toml, "k_proj", "q_proj")
    _edit_in_place(config, "2", "2")  # the same bytes written again: the ctime alone tells
    code, err = _main(capsys, *args, "--resume")
    assert_one_line(code, err, "--resume: the options changed")
    data = src / "__0_0.distcp"  # the source's data file, written again as it was: its ctime tells
    st = data.stat()
    data.write_bytes(data.read_bytes())
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, err = _main(capsys, *args, "--resume")
    assert_one_line(code, err, "--resume: the source changed")
    assert not out.exists() and staging_dir(out).is_dir()


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_symlinked_staging_is_refused_by_resume_and_unlinked_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`.OUT.ckptconv-partial` a symlink to another directory: --resume refuses it with one line, touching
    neither; without --resume the link itself is removed (its target kept whole), OUT a new directory."""
    src, toml, config = _mapped_source(tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x").write_text("mine")
    out = tmp_path / "out"
    staging_dir(out).symlink_to(victim)
    args = ("dcp-to-hf", str(src), str(out), "--mapping", str(toml), "--config", str(config), "--no-fsync")
    code, err = _main(capsys, *args, "--resume")
    assert_one_line(code, err, str(staging_dir(out)), "not a directory this user made (a symlink)")
    assert staging_dir(out).is_symlink() and [p.name for p in victim.iterdir()] == ["x"] and not out.exists()
    code, err = _main(capsys, *args)
    assert code == 0, err
    assert not os.path.lexists(staging_dir(out)) and [p.name for p in victim.iterdir()] == ["x"]
    assert (victim / "x").read_text() == "mine" and out.is_dir() and not out.is_symlink()
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask  # what it was before staging was made 0700
