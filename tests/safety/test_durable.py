"""Durable publishing (issue #34, item 6): every output file and the directories that publish it are fsynced
before OUT is renamed into place (the data files on their own thread as each is finished, under torchrun by
every rank before rank 0 publishes), OUT's parent after; `--no-fsync` / `save_hf(fsync=False)` fsyncs
nothing; a failed fsync is a one-line error with nothing published; object storage completes an upload only
from every acknowledged part, reads each object back once committed, and never commits a discarded one."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import _env, s3_options, s3_requests
from test_bad_input import assert_one_line, run

from ckptconv.publish import outdir
from ckptconv.publish.outdir import staging_dir

Event = tuple[str, str, str]  # (what, path, more): ("fsync", path, thread), ("rename", src, dst)


class Journal:
    """os.fsync and the publishing renames of this process, in the order they completed: each fsync with
    the path its fd names (/proc/self/fd) and its thread, each rename (os.rename, or outdir's atomic
    exchange) with its two paths. `fail` makes the fsync of a path holding that text raise EIO instead."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> None:
        self.events: list[Event] = []
        lock = threading.Lock()
        real_fsync, real_rename, real_exchange = os.fsync, os.rename, outdir._exchange

        def add(*event: str) -> None:
            with lock:
                self.events.append(event)  # type: ignore[arg-type]

        def fsync(fd: Any) -> None:
            path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
            if fail is not None and fail in path:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real_fsync(fd)
            add("fsync", path, threading.current_thread().name)

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real_rename(src, dst, *args, **kwargs)
            add("rename", os.path.realpath(src), os.path.realpath(dst))

        def exchange(a: Path, b: Path) -> bool:
            done = real_exchange(a, b)
            if done:
                add("rename", os.path.realpath(a), os.path.realpath(b))
            return done

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(outdir, "_exchange", exchange)

    def synced(self) -> list[str]:
        return [path for what, path, _ in self.events if what == "fsync"]


def assert_published_durably(events: list[Event], out: Path) -> None:
    """Every file and directory of OUT was fsynced (under its staging name) before the rename that
    published OUT, each directory after the files fsynced and renamed in it, and OUT's parent after that
    rename."""
    out = Path(os.path.realpath(out))
    staging = str(staging_dir(out))
    published = [i for i, e in enumerate(events) if e == ("rename", staging, str(out))]
    assert len(published) == 1, events
    at = published[0]
    dirs = {os.path.normpath(os.path.join(staging, os.path.relpath(top, out))) for top, _, _ in os.walk(out)}
    synced: dict[str, int] = {}  # path in the staging tree -> when its (last) fsync completed
    touched: dict[str, int] = {}  # directory -> when a file in it was last fsynced or renamed into it
    for i, (what, path, more) in enumerate(events[:at]):
        if what == "fsync":
            synced[path] = i
        elif path in synced:  # fsynced under a temporary name, then renamed (torch's .metadata.tmp)
            synced[more] = synced.pop(path)
        entry = more if what == "rename" else path
        if entry not in dirs:
            touched[os.path.dirname(entry)] = i
    for directory in dirs:
        assert synced.get(directory, -1) > touched.get(directory, -1), (directory, events)
    for top, _, names in os.walk(out):
        for name in names:
            staged = os.path.normpath(os.path.join(staging, os.path.relpath(top, out), name))
            assert staged in synced, (staged, events)
    assert ("fsync", str(out.parent)) in [e[:2] for e in events[at + 1 :]], events


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six tensors of 64 KB (two bf16 files at --max-shard-size 100kB), a step and nested args (a stash)."""
    path = tmp_path_factory.mktemp("durable") / "ckpt"
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.w": torch.randn(64, 256, generator=g) for i in range(6)}
    dcp.save({"model": model, "step": 7, "args": {"lr": 0.1}}, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What --copy-from copies: a config, a tokenizer, and a directory."""
    path = tmp_path_factory.mktemp("base")
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (path / "tokenizer.json").write_text("{}")
    (path / "assets").mkdir()
    (path / "assets" / "notes.txt").write_text("notes")
    return path


@pytest.fixture(scope="module")
def hf(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptconv",
            "dcp-to-hf",
            str(ckpt),
            str(out),
            "--max-shard-size",
            "100kB",
            "-q",
        ],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    return out


def _dcp_to_hf(ckpt: Path, out: Path, model_files: Path, *flags: str) -> list[str]:
    return [
        "dcp-to-hf",
        str(ckpt),
        str(out),
        "--max-shard-size",
        "100kB",
        "--copy-from",
        str(model_files),
        *flags,
    ]


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_dcp_to_hf_fsyncs_every_file_and_directory_before_publishing(
    ckpt: Path,
    model_files: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    existing: bool,
) -> None:
    """The two data files, the index, the stash, the copied config (edited), tokenizer and directory: each
    fsynced before the rename (an atomic exchange with --overwrite), then OUT's parent."""
    out = tmp_path / "release" / "out"
    if existing:  # a previous result (--overwrite refuses one holding a directory: without --copy-from)
        code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out), "-q")
        assert code == 0, err
    journal = Journal(monkeypatch)
    code, err = run(capsys, *_dcp_to_hf(ckpt, out, model_files, "-q", "--overwrite"))
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors.index.json", "ckptconv_state.json", "config.json", "assets"} <= names
    assert_published_durably(journal.events, out)


def test_hf_to_dcp_fsyncs_every_file_and_directory_before_publishing(
    hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data files (fsynced by dcp.save's writer threads as each is written), `.metadata` (fsynced as
    `.metadata.tmp`, then renamed: the directory's fsync comes after that rename), then OUT's parent."""
    out = tmp_path / "dcp"
    journal = Journal(monkeypatch)
    code, err = run(capsys, "hf-to-dcp", str(hf), str(out), "-q")
    assert code == 0, err
    assert (out / ".metadata").is_file() and list(out.glob("*.distcp"))
    assert_published_durably(journal.events, out)
    data = [e for e in journal.events if e[0] == "fsync" and e[1].endswith(".distcp")]
    assert data and all(thread != "MainThread" for _, _, thread in data), data


def test_data_files_are_fsynced_as_each_is_finished_while_the_next_is_written(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first file's fsync is held until the second file is opened: only an fsync on a thread of its own,
    started as the first file is finished, lets the run go on (an fsync at the end, or in line, would wait
    for ever: here, 20 s, then the test fails)."""
    from ckptconv.formats import safetensors_io

    second_opened = threading.Event()
    waited: list[bool] = []
    real_init, real_fsync = safetensors_io.SafetensorsWriter.__init__, os.fsync

    def init(self: Any, path: Path, *args: Any, **kwargs: Any) -> None:
        real_init(self, path, *args, **kwargs)
        if path.name.startswith("model-00002-"):
            second_opened.set()

    def fsync(fd: int) -> None:
        if "model-00001-" in os.readlink(f"/proc/self/fd/{fd}"):
            waited.append(second_opened.wait(20))
        real_fsync(fd)

    monkeypatch.setattr(safetensors_io.SafetensorsWriter, "__init__", init)
    monkeypatch.setattr(os, "fsync", fsync)
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--max-shard-size", "100kB", "-q")
    assert code == 0, err
    assert waited == [True]


@pytest.mark.parametrize("command", ["dcp-to-hf", "hf-to-dcp"])
def test_no_fsync_fsyncs_nothing(
    command: str,
    ckpt: Path,
    hf: Path,
    model_files: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    argv = _dcp_to_hf(ckpt, out, model_files) if command == "dcp-to-hf" else ["hf-to-dcp", str(hf), str(out)]
    journal = Journal(monkeypatch)
    code, err = run(capsys, *argv, "-q", "--no-fsync")
    assert code == 0, err
    assert any(p.is_file() for p in out.iterdir())
    assert journal.synced() == []


def test_save_hf_fsyncs_unless_told_not_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptconv import save_hf

    sd = {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(64, 64)}
    journal = Journal(monkeypatch)
    save_hf(sd, tmp_path / "durable", max_shard_size="10kB", extra={"step": 3})
    assert {"model.safetensors.index.json", "ckptconv_state.json"} <= {
        p.name for p in (tmp_path / "durable").iterdir()
    }
    assert_published_durably(journal.events, tmp_path / "durable")
    journal.events.clear()
    save_hf(sd, tmp_path / "scratch", max_shard_size="10kB", extra={"step": 3}, fsync=False)
    assert (tmp_path / "scratch" / "model.safetensors.index.json").is_file()
    assert journal.synced() == []


@pytest.mark.parametrize(
    "command, failing",
    [
        ("dcp-to-hf", "model-00002-of-00002.safetensors"),  # a data file (its fsync on the syncer's thread)
        ("dcp-to-hf", "tokenizer.json"),  # a file rank 0 copies last
        ("dcp-to-hf", "assets"),  # a directory
        ("hf-to-dcp", "__0_1.distcp"),  # a file dcp.save's writer thread writes
    ],
)
def test_a_failed_fsync_is_one_line_and_nothing_is_published(
    command: str,
    failing: str,
    ckpt: Path,
    hf: Path,
    model_files: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fsync's EIO (the device lost what the page cache held) fails the run naming the file: no OUT, no
    staging directory, no lock."""
    out = tmp_path / "out"
    argv = _dcp_to_hf(ckpt, out, model_files) if command == "dcp-to-hf" else ["hf-to-dcp", str(hf), str(out)]
    Journal(monkeypatch, fail=failing)
    code, err = run(capsys, *argv, "-q")
    assert_one_line(code, err, failing, "cannot write (Input/output error)")
    assert sorted(os.listdir(tmp_path)) == []


# --- torchrun: every rank fsyncs what it wrote before rank 0 publishes --------------------------------------

AUDIT = '''
"""Test audit (test_durable.py): each fsync and rename of this process, appended to a log of its own."""
import os, time
_LOG = os.environ.get("CKPTCONV_TEST_FSYNC_LOG")
if _LOG:
    _fsync, _rename = os.fsync, os.rename

    def _note(*fields):
        with open(f"{_LOG}.{os.environ.get('RANK', '-')}.{os.getpid()}", "a") as f:
            f.write("\\t".join([str(time.monotonic_ns()), *map(str, fields)]) + "\\n")

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        _fsync(fd)
        _note("fsync", path)

    def rename(src, dst, *args, **kwargs):
        _rename(src, dst, *args, **kwargs)
        _note("rename", os.path.realpath(src), os.path.realpath(dst))

    os.fsync, os.rename = fsync, rename
'''


def _audited_torchrun(tmp_path: Path, *args: str) -> dict[str, list[tuple[int, str, str, str]]]:
    """`torchrun --nproc-per-node 2 -m ckptconv ARGS` with the audit on; {rank: [(ns, what, path, more)]}."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    log = tmp_path / "log" / "fsync"
    log.parent.mkdir()
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["CKPTCONV_TEST_FSYNC_LOG"] = str(log)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*argv, "-m", "ckptconv", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    ranks: dict[str, list[tuple[int, str, str, str]]] = {}
    for part in log.parent.iterdir():
        rank = part.name.split(".")[1]
        for line in part.read_text().splitlines():
            ns, what, path, *more = line.split("\t")
            ranks.setdefault(rank, []).append((int(ns), what, path, more[0] if more else ""))
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("command", ["dcp-to-hf", "hf-to-dcp"])
def test_under_torchrun_every_rank_fsyncs_its_files_before_rank_0_publishes(
    command: str, ckpt: Path, hf: Path, tmp_path: Path
) -> None:
    """dcp-to-hf: both ranks write ranges of the files (--write-granularity tensor) and each fsyncs every file
    it wrote; hf-to-dcp: each rank its own `.distcp` files. Every fsync of every rank (clocks: the
    machine's monotonic clock) comes before rank 0's rename of the staging directory, which comes before
    the fsync of OUT's parent; rank 0 alone renames."""
    out = tmp_path / "out"
    if command == "dcp-to-hf":
        ranks = _audited_torchrun(
            tmp_path, "dcp-to-hf", str(ckpt), str(out), "--max-shard-size", "100kB", "-q"
        )
    else:
        ranks = _audited_torchrun(tmp_path, "hf-to-dcp", str(hf), str(out), "-q")
    assert sorted(ranks) == ["0", "1"], ranks
    out = Path(os.path.realpath(out))
    staging = staging_dir(out)
    publish = [e for e in ranks["0"] if e[1:] == ("rename", str(staging), str(out))]
    assert len(publish) == 1 and not any(e[1] == "rename" and e[3] == str(out) for e in ranks["1"])
    when = publish[0][0]
    for rank, events in ranks.items():
        data = [e for e in events if e[1] == "fsync" and e[2].endswith((".safetensors", ".distcp"))]
        if command == "hf-to-dcp":
            assert data and all(Path(e[2]).name.startswith(f"__{rank}_") for e in data), (rank, data)
            assert {Path(e[2]).name for e in data} == {p.name for p in out.glob(f"__{rank}_*.distcp")}
        else:
            assert data, (rank, events)
        assert all(e[0] < when for e in events if e[1] == "fsync" and e[2] != str(out.parent)), rank
    synced = {Path(e[2]).name for events in ranks.values() for e in events if e[1] == "fsync" and e[0] < when}
    synced |= {Path(e[3]).name for e in ranks["0"] if e[1] == "rename" and Path(e[2]).name in synced}
    assert {p.name for p in out.iterdir()} <= synced and staging.name in synced
    assert any(e[1:3] == ("fsync", str(out.parent)) and e[0] > when for e in ranks["0"])


# --- object storage ----------------------------------------------------------------------------------------


def _s3(s3_endpoint: str, *argv: str) -> list[str]:
    return [*argv, "--storage-options", json.dumps(s3_options(s3_endpoint))]


@pytest.fixture(scope="module")
def two_part_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fp32 tensor of 12 MB: with 5 MiB parts, one file of two parts."""
    path = tmp_path_factory.mktemp("parts") / "ckpt"
    weight = torch.randn(1500, 2048, generator=torch.Generator().manual_seed(1))
    dcp.save({"model": {"w": weight}}, checkpoint_id=str(path), no_dist=True)
    return path


def test_an_upload_is_completed_only_with_every_part_acknowledged(
    two_part_ckpt: Path,
    s3_endpoint: str,
    s3: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A part whose acknowledgement (its ETag) never reaches rank 0: S3 would complete the object without
    it, short, and the run exit 0. It is refused instead, and nothing is left."""
    pytest.importorskip("moto", reason="moto's server is part of the test extras")
    from ckptconv.publish import multipart, parts

    monkeypatch.setattr(parts, "PART_BYTES", 5 << 20)  # S3's smallest part: a 12 MB file is two
    real_send = multipart.PartStream._send

    def send(self: Any, number: int, buf: bytearray) -> None:
        real_send(self, number, buf)
        if number == 2:
            self._tags.remove(next(t for t in self._tags if t[0] == 2))  # sent, its ETag lost

    monkeypatch.setattr(multipart.PartStream, "_send", send)
    url = "s3://ckpts/durable-parts"
    code, err = run(capsys, *_s3(s3_endpoint, "dcp-to-hf", str(two_part_ckpt), url, "--dtype", "keep", "-q"))
    assert_one_line(code, err, "model.safetensors", "1 parts acknowledged of 2")
    s3.invalidate_cache()
    assert s3.find("ckpts/durable-parts") == [] and list(s3.list_multipart_uploads("ckpts")) == []


@pytest.mark.parametrize("command", ["dcp-to-hf", "hf-to-dcp"])
def test_each_object_is_read_back_once_its_upload_is_committed(
    command: str, ckpt: Path, hf: Path, s3_endpoint: str, s3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store's own word that an object is whole: once its upload is completed (multipart, one-shot PUT
    or a held upload), a HEAD of it, before the run ends."""
    pytest.importorskip("moto", reason="moto's server is part of the test extras")
    key = f"durable-{command}"
    if command == "dcp-to-hf":
        argv = ["dcp-to-hf", str(ckpt), f"s3://ckpts/{key}", "--max-shard-size", "100kB", "-q"]
    else:
        argv = ["hf-to-dcp", str(hf), f"s3://ckpts/{key}", "-q"]
    (code, err), seen = s3_requests(s3_endpoint, lambda: run(capsys, *_s3(s3_endpoint, *argv)))
    assert code == 0, err
    s3.invalidate_cache()
    objects = [p.rsplit("/", 1)[1] for p in s3.find(f"ckpts/{key}")]
    assert len(objects) >= 3, objects
    for name in objects:
        path = f"/ckpts/{key}/{name}"
        mine = [(i, r) for i, r in enumerate(seen) if r["url"].split("?")[0].endswith(path)]
        commits = [i for i, r in mine if r["method"] == "PUT" and "partNumber" not in r["url"]]
        commits += [i for i, r in mine if r["method"] == "POST" and "uploadId" in r["url"]]
        heads = [i for i, r in mine if r["method"] == "HEAD"]
        assert commits and heads and max(heads) > max(commits), (name, mine)


def test_a_discarded_upload_is_never_committed_when_collected(
    hf: Path,
    s3_endpoint: str,
    s3: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """hf-to-dcp to S3 failing while its writer threads stream `.distcp` files: their uploads are aborted,
    and the abandoned fsspec files, once collected, neither commit what they held nor raise (an
    "Exception ignored" traceback on stderr)."""
    pytest.importorskip("moto", reason="moto's server is part of the test extras")
    from ckptconv.errors import CkptconvError
    from ckptconv.formats import safetensors_io

    reads = [0]
    real_pread = safetensors_io.RowReader._pread

    def pread(self: Any, t: Any, start: int, view: memoryview) -> None:
        reads[0] += 1
        if reads[0] > 3:
            raise CkptconvError(f"{t.file}: cannot read (test)")
        real_pread(self, t, start, view)

    unraisable: list[Any] = []
    monkeypatch.setattr(safetensors_io.RowReader, "_pread", pread)
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    code, err = run(capsys, *_s3(s3_endpoint, "hf-to-dcp", str(hf), "s3://ckpts/durable-discard", "-q"))
    assert_one_line(code, err, "cannot read (test)")
    from ckptconv.publish import remote_out, remote_run

    remote_out._run = remote_run.Run()  # the next run's: the failed run's files are garbage now
    gc.collect()
    assert unraisable == []
    s3.invalidate_cache()
    assert s3.find("ckpts/durable-discard") == [] and list(s3.list_multipart_uploads("ckpts")) == []
