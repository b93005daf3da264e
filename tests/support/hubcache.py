"""The huggingface_hub cache layout of one snapshot, built by hand: what `HF_HUB_OFFLINE=1` reads a hub repo
id from (the hub itself is never reached by the tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, repo: str, files: dict[str, bytes]) -> Path:
    """The huggingface_hub cache layout for one snapshot of `repo` under `home` (HF_HOME), main at
    `COMMIT`; returns the snapshot folder."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_bytes(data)
    return snap


def hub_client(files: dict[str, bytes], seen: list[tuple[str, str]]) -> Callable[[], Any]:
    """A huggingface_hub client factory (`set_client_factory`) whose client answers the Hub's file reads
    (`/{org}/{name}/resolve/{revision}/{file}`, whole or a `range: bytes=A-B`) from `files` (name -> bytes),
    404 `EntryNotFound` for a name it lacks; each read's (repo id, revision) is appended to `seen`."""
    import httpx2

    def answer(request: httpx2.Request) -> httpx2.Response:
        org, name, resolve, revision, file = request.url.path.lstrip("/").split("/", 4)
        assert resolve == "resolve", request.url
        seen.append((f"{org}/{name}", revision))
        if file not in files:
            return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"}, request=request)
        data, ranged = files[file], request.headers.get("range")
        if ranged is None:
            return httpx2.Response(200, content=data, request=request)
        start, _, stop = ranged.removeprefix("bytes=").partition("-")
        return httpx2.Response(206, content=data[int(start) : int(stop) + 1], request=request)

    return lambda: httpx2.Client(transport=httpx2.MockTransport(answer), follow_redirects=True)
