"""`dcp-to-hf --push-to-hub`: huggingface_hub's `HfApi` replaced at its boundary by a recorder that checks
what would be uploaded, to where, and raises the errors the real one raises."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import huggingface_hub
import pytest
from huggingface_hub import errors as hub_errors
from test_bad_input import assert_one_line

from ckptconv.cli.app import main
from ckptconv.publish import hub_push


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """The CLI in this process (so the replaced HfApi is the one it uses): exit code and stderr; stdout stays
    in `capsys` for `report`."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    run.out = captured.out  # type: ignore[attr-defined]
    return code, captured.err


def report() -> dict[str, Any]:
    return json.loads(run.out)  # type: ignore[attr-defined,no-any-return]


class FakeApi:
    """Records each call; `fail` maps a method name to the exception it raises."""

    endpoint = "https://hub.example"
    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    fail: ClassVar[dict[str, BaseException]] = {}
    uploaded: ClassVar[dict[str, str]] = {}

    def _call(self, name: str, **kw: Any) -> None:
        FakeApi.calls.append((name, kw))
        if name in FakeApi.fail:
            raise FakeApi.fail[name]

    def create_repo(self, repo_id: str, **kw: Any) -> None:
        self._call("create_repo", repo_id=repo_id, **kw)

    def create_branch(self, repo_id: str, **kw: Any) -> None:
        self._call("create_branch", repo_id=repo_id, **kw)

    def upload_folder(self, **kw: Any) -> Any:
        self._call("upload_folder", **kw)
        FakeApi.uploaded = _digests(Path(kw["folder_path"]))
        pr = "https://hub.example/org/model/discussions/3" if kw.get("create_pr") else None
        return SimpleNamespace(commit_url="https://hub.example/org/model/commit/abc123", pr_url=pr)

    def upload_large_folder(self, **kw: Any) -> None:
        self._call("upload_large_folder", **kw)
        FakeApi.uploaded = _digests(Path(kw["folder_path"]))


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


@pytest.fixture(autouse=True)
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeApi.calls, FakeApi.fail, FakeApi.uploaded = [], {}, {}
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)


def test_uploads_the_published_result_in_one_commit(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "release"
    code, _ = run(
        capsys,
        "dcp-to-hf",
        str(fsdp2_ckpt),
        str(out),
        "--push-to-hub",
        "org/model",
        "--revision",
        "exp-1",
        "--private",
        "--commit-message",
        "step 1000",
        "--json",
    )
    assert code == 0
    doc = report()
    names = [name for name, _ in FakeApi.calls]
    assert names == ["create_repo", "create_branch", "upload_folder"]
    assert FakeApi.calls[0][1] == {
        "repo_id": "org/model",
        "repo_type": "model",
        "private": True,
        "exist_ok": True,
    }
    assert FakeApi.calls[1][1]["branch"] == "exp-1"
    upload = FakeApi.calls[2][1]
    assert Path(upload["folder_path"]) == out.resolve()
    assert (upload["repo_id"], upload["revision"], upload["commit_message"]) == (
        "org/model",
        "exp-1",
        "step 1000",
    )
    assert upload["create_pr"] is False
    assert (
        FakeApi.uploaded == _digests(out) and "model.safetensors" in FakeApi.uploaded
    )  # complete, published
    assert doc["hub"]["commit_url"] == "https://hub.example/org/model/commit/abc123"
    assert doc["hub"]["commits"] == "one"


def test_pull_request_and_large_folder(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "pr"
    args = ("dcp-to-hf", str(fsdp2_ckpt), str(out), "--push-to-hub", "org/model", "--json")
    assert run(capsys, *args, "--create-pr")[0] == 0
    assert report()["hub"]["pr_url"].endswith("/discussions/3")
    assert FakeApi.calls[-1][1]["create_pr"] is True
    monkeypatch.setattr(hub_push, "LARGE_FOLDER_FILES", 1)  # more files than that: the resumable upload
    FakeApi.calls = []
    assert run(capsys, *args, "--overwrite")[0] == 0
    assert [name for name, _ in FakeApi.calls] == ["create_repo", "upload_large_folder"]
    assert report()["hub"]["commits"].startswith("several")


def _http_error(cls: type[BaseException], status: int) -> BaseException:
    """One of huggingface_hub's HTTP errors as its client raises it, with the response's status code."""
    error = cls.__new__(cls)
    OSError.__init__(error, f"{status} Client Error")
    error.response = SimpleNamespace(status_code=status, headers={})  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize(
    ("method", "error", "words"),
    [
        ("create_repo", hub_errors.LocalTokenNotFoundError("no token"), "no valid token"),
        ("create_repo", _http_error(hub_errors.HfHubHTTPError, 401), "no valid token"),
        ("upload_folder", _http_error(hub_errors.HfHubHTTPError, 403), "no write access"),
        ("create_branch", _http_error(hub_errors.RepositoryNotFoundError, 404), "does not exist"),
        ("upload_folder", ConnectionError("Name or service not known"), "cannot reach the Hub"),
    ],
)
def test_failures_keep_the_result_and_say_where(
    method: str,
    error: BaseException,
    words: str,
    fsdp2_ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    FakeApi.fail = {method: error}
    out = tmp_path / "kept"
    argv = ["dcp-to-hf", str(fsdp2_ckpt), str(out), "--push-to-hub", "org/model", "--revision", "b"]
    code, err = run(capsys, *argv)
    assert_one_line(code, err, "--push-to-hub org/model", words, f"kept in {out.resolve()}", "hf upload")
    assert (out / "model.safetensors").is_file()  # the conversion's result stays, complete


def test_bad_repo_id_fails_before_any_work(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for repo in ("not a repo id", "model-without-owner"):
        code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(tmp_path / "o"), "--push-to-hub", repo)
        assert_one_line(code, err, "--push-to-hub")
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(tmp_path / "o"), "--private")
    assert_one_line(code, err, "--private", "--push-to-hub")
    assert not (tmp_path / "o").exists() and FakeApi.calls == []
