"""One writer per OUT prefix in object storage (moto's S3 server): the lock object beside OUT, taken with
S3's create-only put, refused to a second run, taken over from a dead run of this host, and never left by a
finished, failed or interrupted run. An interrupted run keeps what it sent for --resume (without its
completing object), and the resume publishes what an uninterrupted run does."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from conftest import s3_options, start
from test_bad_input import assert_one_line
from test_object_storage_out import _in_process, _objects, _uploads_in_progress

from ckptconv.publish.remote_resume import RECORD

s3fs = pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")


def _lock(s3: s3fs.S3FileSystem, name: str, **info: object) -> str:
    key = f"ckpts/.{name}.ckptconv-lock"
    s3.pipe_file(
        key, json.dumps({"started": time.time(), "command": "ckptconv dcp-to-hf ...", **info}).encode()
    )
    return key


def test_a_live_run_elsewhere_holds_the_prefix(
    fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lock of a run on another host (or of a live process here): exit 2 before any work, naming the run
    and, for another host, the object to remove once it is gone; OUT untouched."""
    key = _lock(s3, "held", host="node-17", pid=4242)
    argv = ("dcp-to-hf", str(fsdp2_ckpt), "s3://ckpts/held", "-q")
    code, err = _in_process(capsys, s3_endpoint, *argv)
    assert_one_line(code, err, "s3://ckpts/held", "another ckptconv run", "node-17", f"remove s3://{key}")
    assert _objects(s3, "held") == {} and s3.exists(key)
    _lock(s3, "held", host=socket.gethostname(), pid=os.getppid())  # alive: the test runner's parent
    code, err = _in_process(capsys, s3_endpoint, *argv, "--overwrite")
    assert_one_line(code, err, "another ckptconv run", f"pid {os.getppid()}")
    assert _objects(s3, "held") == {}


def test_a_dead_runs_lock_is_taken_over_and_every_run_removes_its_own(
    fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = start([sys.executable, "-c", "pass"])
    dead.communicate()
    key = _lock(s3, "stale", host=socket.gethostname(), pid=dead.pid)  # a run killed with SIGKILL, say
    argv = ("dcp-to-hf", str(fsdp2_ckpt), "s3://ckpts/stale", "-q")
    assert _in_process(capsys, s3_endpoint, *argv)[0] == 0
    assert "model.safetensors" in _objects(s3, "stale") and not s3.exists(key)
    code, err = _in_process(capsys, s3_endpoint, *argv)  # refused (exists): its lock is gone too
    assert_one_line(code, err, "--overwrite")
    assert not s3.exists(key)


@pytest.mark.slow
def test_two_runs_at_once_one_writes(
    slow_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """A second run on the same OUT while the first is writing: exit 2 naming the first; the first finishes
    and its result is whole. Then a run interrupted (SIGTERM) midway leaves no lock, object or upload."""
    options = json.dumps(s3_options(s3_endpoint))
    argv = ["dcp-to-hf", str(slow_ckpt), "s3://ckpts/busy", "--storage-options", options]
    first = start([sys.executable, "-m", "ckptconv", *argv, "-q"])
    deadline = time.monotonic() + 60
    while not s3.exists("ckpts/.busy.ckptconv-lock"):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = start([sys.executable, "-m", "ckptconv", *argv, "--overwrite"])
    _, err = second.communicate(timeout=120)
    assert_one_line(second.returncode, err, "s3://ckpts/busy", "another ckptconv run", f"pid {first.pid}")
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert "model.safetensors" in _objects(s3, "busy") and not s3.exists("ckpts/.busy.ckptconv-lock")

    third = start([sys.executable, "-m", "ckptconv", *argv, "--overwrite", "--bucket-size", "8MB"])
    deadline = time.monotonic() + 60
    while not s3.exists("ckpts/.busy.ckptconv-lock") or not s3.exists(f"ckpts/busy/{RECORD}"):
        assert third.poll() is None, third.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    third.send_signal(signal.SIGTERM)
    _, err = third.communicate(timeout=60)
    assert third.returncode == 143, err
    # no lock; what it sent is kept for --resume (remote_resume), with no completing object
    assert not s3.exists("ckpts/.busy.ckptconv-lock") and "rerun with --resume" in err, err
    assert s3.exists(f"ckpts/busy/{RECORD}") and "model.safetensors" not in _objects(s3, "busy")


@pytest.mark.parametrize(
    ("method", "target", "shards"),
    [
        ("put_object", ".ckptconv-lock", "400"),
        ("create_multipart_upload", "/model.safetensors", "5GB"),
        ("complete_multipart_upload", "/model-00001-of-", "400"),
        ("complete_multipart_upload", "/model.safetensors", "5GB"),  # the one file: the completing object
        ("put_object", "/ckptconv_state.json", "400"),
        ("put_object", "/model.safetensors.index.json", "400"),  # the completing object
    ],
)
def test_a_signal_while_a_store_call_is_in_flight_leaves_nothing(
    method: str,
    target: str,
    shards: str,
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM arriving while a call that makes something (an upload started or completed, an object put)
    is on its way: fsspec's I/O thread still lands the call after the main thread is interrupted, so the run
    waits for it. Exit 143, no lock left; before any upload started, nothing; after, what was sent stays
    for --resume, which then publishes what an uninterrupted run does."""
    from fsspec.asyn import sync_wrapper

    from ckptconv.job import signals

    real = s3fs.S3FileSystem._call_s3
    sent: list[str] = []

    async def late(self: s3fs.S3FileSystem, name: str, *args: object, **kwargs: object) -> object:
        if name == method and target in str(kwargs.get("Key")) and not sent:
            sent.append(name)
            os.kill(os.getpid(), signal.SIGTERM)  # interrupts the main thread, waiting on this call
            await asyncio.sleep(0.5)  # the call lands after the interrupt
        return await real(self, name, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", late)
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(late))
    monkeypatch.setattr(signals, "_received", [])
    key = f"cut-{method}-{target.strip('/.').split('.')[0].rstrip('-')}-{shards}"
    code, err = _in_process(
        capsys, s3_endpoint, "dcp-to-hf", str(fsdp2_ckpt), f"s3://ckpts/{key}", "--max-shard-size", shards
    )
    assert sent == [method] and code == 143, err
    time.sleep(1)  # anything still on its way has landed
    assert not s3.exists(f"ckpts/.{key}.ckptconv-lock")
    uploads = [u["Key"] for u in _uploads_in_progress(s3) if u["Key"].startswith(f"{key}/")]
    if method in ("put_object", "complete_multipart_upload") and "lock" not in target:
        # uploads started: what was sent stays for --resume, but no completing object; the resume
        # publishes the bytes of a run never interrupted and leaves no upload
        assert "rerun with --resume" in err and s3.exists(f"ckpts/{key}/{RECORD}"), err
        assert not {"model.safetensors", "model.safetensors.index.json"} & set(_objects(s3, key))
        argv = ("dcp-to-hf", str(fsdp2_ckpt), f"s3://ckpts/{key}", "--max-shard-size", shards)
        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", real)
        monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(real))
        code, err = _in_process(capsys, s3_endpoint, *argv, "--resume")
        assert code == 0, err
        whole = f"whole-{key}"
        again = ("dcp-to-hf", str(fsdp2_ckpt), f"s3://ckpts/{whole}", "--max-shard-size", shards)
        assert _in_process(capsys, s3_endpoint, *again)[0] == 0
        assert _objects(s3, key) == _objects(s3, whole) and not s3.exists(f"ckpts/{key}/{RECORD}")
        uploads = [u["Key"] for u in _uploads_in_progress(s3) if u["Key"].startswith(f"{key}/")]
        assert uploads == []
        return
    assert _objects(s3, key) == {} and uploads == [], err
