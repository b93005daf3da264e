"""`hf-to-dcp --resume` into S3 (moto's server): a run interrupted once it completed a data file leaves the
files it completed (each tagged with the run's fingerprint and its name) and its record, and says so; a
plain rerun, other options and another number of ranks are refused with one line; `--resume` keeps the
files completed, writes the rest (fewer bytes), and publishes the local conversion's DCP: its data files
byte for byte, its `.metadata` the same index, torch's `dcp.load` the same values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import ckptconv, s3_options
from test_bad_input import assert_one_line
from test_object_storage_resume import _run
from test_resume import _hf_source, _same_dcp, _stopped

from ckptconv.publish import upload
from ckptconv.publish.remote_resume import RECORD

s3fs = pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")

SMALL = ("--max-file-size", "50KB")  # 4 tensors of 96 KiB: 4 data files


def _interrupted_after_one_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next run is interrupted (as by Ctrl-C) right after it completed its first data file."""
    commit = upload.Stream.commit
    done: list[str] = []

    def once(self: upload.Stream) -> None:
        commit(self)
        done.append(self.url.name)
        if len(done) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(upload.Stream, "commit", once)


def _names(s3: Any, key: str) -> set[str]:
    s3.invalidate_cache()
    return {p.rsplit("/", 1)[1] for p in s3.find(f"ckpts/{key}")}


def test_an_interrupted_hf_to_dcp_resumes_in_s3_to_the_local_checkpoint(
    tmp_path: Path,
    s3_endpoint: str,
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = _hf_source(tmp_path / "hf")
    local = tmp_path / "local"
    assert ckptconv("hf-to-dcp", str(src), str(local), *SMALL, "-q").returncode == 0
    assert len(list(local.glob("*.distcp"))) == 4
    url = "s3://ckpts/dcp"
    with monkeypatch.context() as m:
        _interrupted_after_one_file(m)
        code, _, err = _run(capsys, s3_endpoint, "hf-to-dcp", str(src), url, *SMALL)
    assert code != 0 and "rerun with --resume" in err, err
    left = _names(s3, "dcp")
    assert RECORD in left and ".metadata" not in left
    kept = sorted(n for n in left if n.endswith(".distcp"))
    assert kept and len(kept) < 4, left
    tag = s3.call_s3("head_object", Bucket="ckpts", Key=f"dcp/{kept[0]}")["Metadata"]
    assert set(tag) == {"ckptconv-fingerprint"}

    # without --resume; with other options; at another number of ranks: one line each, nothing changed
    code, _, err = _run(capsys, s3_endpoint, "hf-to-dcp", str(src), url, *SMALL)
    assert_one_line(code, err, url, "interrupted run", "--resume", "--overwrite")
    argv = ("hf-to-dcp", str(src), url, *SMALL, "--resume")
    code, _, err = _run(capsys, s3_endpoint, *argv, "--dtype", "bf16")
    assert_one_line(code, err, url, "the options changed", "--overwrite")
    options = json.dumps(s3_options(s3_endpoint))
    proc = ckptconv("hf-to-dcp", str(src), url, *SMALL, "--resume", "--storage-options", options, nproc=2)
    line = f"ckptconv: error: {url}: --resume: written by 1 rank(s) and this run has 2"  # (torchrun's own
    assert proc.returncode != 0 and line in proc.stderr, proc.stderr  # traceback follows it)
    assert _names(s3, "dcp") == left

    for _ in range(2):  # two uploads in progress on one key (a killed run's, say): both aborted
        s3.call_s3("create_multipart_upload", Bucket="ckpts", Key="dcp/__0_3.distcp")
    code, out, err = _run(capsys, s3_endpoint, "hf-to-dcp", str(src), url, *SMALL, "--resume", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["resumed"] == kept
    full = sum(p.stat().st_size for p in local.glob("*.distcp"))
    assert sum(r["bytes_written"] for r in report["ranks"]) <= full - sum(
        (local / n).stat().st_size for n in kept
    )
    published = tmp_path / "published"
    s3.get("ckpts/dcp/", str(published), recursive=True)
    assert not (published / RECORD).exists()
    _same_dcp(published, local)
    assert s3.call_s3("list_multipart_uploads", Bucket="ckpts", Prefix="dcp/").get("Uploads", []) == []

    # a complete result: nothing to resume (one line), left as it is
    code, _, err = _run(capsys, s3_endpoint, "hf-to-dcp", str(src), url, *SMALL, "--resume")
    assert_one_line(code, err, url, "nothing to resume", "--overwrite")


@pytest.mark.slow
def test_a_killed_rank_resumes_hf_to_dcp_in_s3(tmp_path: Path, s3_endpoint: str, s3: Any) -> None:
    """2 ranks, 4 data files each: rank 1 SIGKILLed once each rank completed one; --resume at 2 ranks keeps
    those and publishes the uninterrupted 2-rank checkpoint."""
    src = _hf_source(tmp_path / "hf")
    ref = tmp_path / "ref"
    assert ckptconv("hf-to-dcp", str(src), str(ref), *SMALL, "-q", nproc=2).returncode == 0
    assert len(list(ref.glob("*.distcp"))) == 8
    options = json.dumps(s3_options(s3_endpoint))
    url = "s3://ckpts/killed-dcp"
    _stopped(src, url, tmp_path / "pause", "kill", ("hf-to-dcp", *SMALL, "--storage-options", options))
    left = _names(s3, "killed-dcp")
    assert RECORD in left and ".metadata" not in left
    argv = ("hf-to-dcp", str(src), url, *SMALL, "--resume", "--json", "--storage-options", options)
    proc = ckptconv(*argv, nproc=2)
    assert proc.returncode == 0, proc.stderr
    kept = json.loads(proc.stdout)["resumed"]
    assert {k.split("_")[2] for k in kept} == {"0", "1"}, kept  # a file of each rank at least
    published = tmp_path / "published"
    s3.get("ckpts/killed-dcp/", str(published), recursive=True)
    assert not (published / RECORD).exists()
    _same_dcp(published, ref)
