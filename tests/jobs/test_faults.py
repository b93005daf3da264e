"""Faults: write errors, Ctrl-C, a rank killed mid-conversion, unfinished outputs given as input."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import _env, ckptconv, tree_sha256, wait_for
from test_bad_input import assert_one_line

from ckptconv.publish.outdir import staging_dir


def _file_size_limit(limit: int):  # type: ignore[no-untyped-def]
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.lstrip(".").startswith(out.name))


@pytest.mark.parametrize("direction", ["dcp-to-hf", "hf-to-dcp"])
def test_write_error_is_exit_2_naming_the_file_and_leaves_nothing(
    fsdp2_ckpt: Path, tmp_path: Path, direction: str
) -> None:
    src = fsdp2_ckpt
    if direction == "hf-to-dcp":
        src = tmp_path / "hf"
        assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(src)).returncode == 0
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptconv", direction, str(src), str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        preexec_fn=_file_size_limit(1024),  # the lock file (< 1 kB) fits, no output file does
    )
    assert_one_line(proc.returncode, proc.stderr, "cannot write (File too large)", str(staging_dir(out)))
    assert _leftovers(out) == []


def test_ctrl_c_removes_the_staging_directory(slow_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptconv", "dcp-to-hf", str(slow_ckpt), str(out), "--bucket-size", "8MB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        # a job started in the background inherits SIGINT ignored, and Python then keeps ignoring it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for(staging_dir(out), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "ckptconv: interrupted" and "Traceback" not in err
    assert _leftovers(out) == []


def test_killed_rank_fails_the_job_in_bounded_time_then_a_rerun_works(
    slow_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "ckptconv"]
    args = ["dcp-to-hf", str(slow_ckpt), str(out), "--max-shard-size", "100MB", "--bucket-size", "8MB"]
    env = {**_env(), "CKPTCONV_TIMEOUT_S": "30"}
    pipe = subprocess.PIPE
    agent = subprocess.Popen([*cmd, *args], stdout=pipe, stderr=pipe, text=True, env=env)
    wait_for(staging_dir(out), agent)
    workers = psutil.Process(agent.pid).children()
    assert len(workers) == 2
    start = time.monotonic()
    workers[1].kill()  # SIGKILL to one rank, mid-write
    agent.communicate(timeout=120)
    assert agent.returncode != 0 and time.monotonic() - start < 90
    assert not out.exists()  # nothing that looks complete; at most the hidden staging directory
    rerun = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    single = tmp_path / "single"
    proc = ckptconv("dcp-to-hf", str(slow_ckpt), str(single), "--max-shard-size", "100MB")
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(out) == tree_sha256(single) and _leftovers(out) == ["out"]


def test_unfinished_output_is_refused_as_input(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(hf)).returncode == 0
    partial = staging_dir(tmp_path / "release")
    shutil.copytree(hf, partial)  # what a run killed after its last shard but before the rename leaves
    for args in (
        ("hf-to-dcp", str(partial), str(tmp_path / "dcp")),
        ("verify", str(fsdp2_ckpt), str(partial)),
        ("verify", str(partial / "model.safetensors"), str(hf)),
    ):
        proc = ckptconv(*args)
        assert_one_line(proc.returncode, proc.stderr, "unfinished output of an interrupted ckptconv run")
    dcp_partial = staging_dir(tmp_path / "ckpt")
    shutil.copytree(fsdp2_ckpt, dcp_partial)
    proc = ckptconv("dcp-to-hf", str(dcp_partial), str(tmp_path / "x"))
    assert_one_line(proc.returncode, proc.stderr, "unfinished output of an interrupted ckptconv run")
    assert not os.path.exists(tmp_path / "x")


def test_closing_the_reader_waits_for_reads_in_flight(
    fsdp2_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an error, reads other threads already started finish on their own while the reader is closed
    (`unshard.direct_tensors`): close() waits for them, so no descriptor is closed (and its number reused by
    the next file opened) under a read, and a read started after close is refused. This used to close the
    files under the readers, and a thread opening a file meanwhile made close() raise "dictionary changed
    size during iteration" instead of the run's own one-line error."""
    import threading

    from ckptconv.errors import CkptconvError
    from ckptconv.formats import dcp_reader
    from ckptconv.formats.dcp import open_dcp

    ckpt = open_dcp(fsdp2_ckpt)
    spec = next(iter(ckpt.tensors.values()))
    chunk = spec.chunks[0]
    reading, release = threading.Event(), threading.Event()
    real = dcp_reader.pread_exact
    seen: list[bool] = []

    def slow(fd: int, path: Path, offset: int, out: memoryview) -> None:
        reading.set()
        release.wait(10)
        seen.append(os.fstat(fd) is not None)  # still open: fstat would raise EBADF otherwise
        real(fd, path, offset, out)

    monkeypatch.setattr(dcp_reader, "pread_exact", slow)
    reader = dcp_reader.DcpReader(ckpt)
    out = memoryview(bytearray(16))
    worker = threading.Thread(target=reader.pread, args=(chunk.file, 0, out))
    worker.start()
    assert reading.wait(10)
    closer = threading.Thread(target=reader.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive(), "close() returned while a read was in flight"
    release.set()
    worker.join(10)
    closer.join(10)
    assert not closer.is_alive() and seen == [True]
    with pytest.raises(CkptconvError, match="closed"):
        reader.pread(chunk.file, 0, out)
