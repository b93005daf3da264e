"""The huggingface_hub cache layout of one snapshot, built by hand: what `HF_HUB_OFFLINE=1` reads a hub repo
id from (the hub itself is never reached by the tests)."""

from __future__ import annotations

from pathlib import Path

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
