"""Hostile checkpoints (issue #14, reading side): only regular files inside the checkpoint are read, every
read error and every header safetensors refuses is exit 2 with one line naming the file, never a hang or a
traceback."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import _env, ckptconv
from safetensors.torch import load as st_load
from safetensors.torch import save_file
from test_bad_input import assert_one_line, run

from ckptconv.errors import CkptconvError

HANG = 60  # seconds: a command that blocks on a FIFO fails the test instead of blocking the suite


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 with exactly one `ckptconv: error:` line on stderr, naming `needles`, and no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_one_line(proc.returncode, proc.stderr, *needles)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(8, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(8, 4, generator=g),
    }


def hf_dir(path: Path, sharded: bool = False) -> Path:
    """A real HF directory: one `model.safetensors`, or two shards with an index, saved by safetensors."""
    path.mkdir(parents=True)
    state = tensors()
    if not sharded:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    keys = sorted(state)
    parts = [keys[:1], keys[1:]]
    for name, part in zip(names, parts, strict=True):
        save_file({k: state[k] for k in part}, str(path / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in zip(names, parts, strict=True) for k in part}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- only regular files: FIFOs never block ------------------------------------------------------------------


def test_fifo_named_model_safetensors(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    os.mkfifo(hf / "model.safetensors")
    for command in (["inspect", str(hf)], ["hf-to-dcp", str(hf), str(tmp_path / "out")]):
        assert_refused(ckptconv(*command, timeout=HANG), "model.safetensors", "FIFO")
    assert_refused(
        ckptconv("inspect", str(hf / "model.safetensors"), timeout=HANG), "model.safetensors", "FIFO"
    )
    assert not (tmp_path / "out").exists()


def test_fifo_shard_named_by_an_index(tmp_path: Path) -> None:
    hf = hf_dir(tmp_path / "hf", sharded=True)
    shard = hf / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    assert_refused(ckptconv("inspect", str(hf), timeout=HANG), shard.name, "FIFO")


def test_fifo_named_config_json(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """config.json is read by mappings: beside the weights, or named by --config."""
    hf = hf_dir(tmp_path / "hf")
    os.mkfifo(hf / "config.json")
    out = tmp_path / "out"
    for command in (
        ["hf-to-dcp", str(hf), str(out)],
        ["inspect", str(hf), "--mapping", "torchtitan-llama3"],
        ["dcp-to-hf", str(fsdp2_ckpt), str(out), "--config", str(hf / "config.json")],
    ):
        assert_refused(ckptconv(*command, timeout=HANG), "config.json", "FIFO")
    assert not out.exists()


def _point_item_at(ckpt: Path, fqn: str, rel: str, length: int | None = None) -> None:
    """Rewrite `.metadata` (with torch's own classes) so the stored bytes of `fqn` are in file `rel`."""
    import torch.distributed.checkpoint as dcp  # noqa: F401 (unpickles the real metadata classes)

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            info.relative_path = rel
            if length is not None:
                info.offset, info.length = 0, length
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def test_fifo_named_like_a_distcp_file(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """A non-tensor item stored in 0 bytes of a FIFO: opening it would block; it is refused by name."""
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    os.mkfifo(ckpt / "__9_0.distcp")
    _point_item_at(ckpt, "step", "__9_0.distcp", length=0)
    for command in (["inspect", str(ckpt)], ["dcp-to-hf", str(ckpt), str(tmp_path / "out")]):
        assert_refused(ckptconv(*command, timeout=HANG), "__9_0.distcp", "FIFO")


def test_open_regular_refuses_a_fifo_and_a_device_without_blocking(tmp_path: Path) -> None:
    from ckptconv.formats.files import open_regular, read_regular

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CkptconvError, match="fifo: is a FIFO, not a regular file"):
        open_regular(tmp_path / "fifo", tmp_path)
    with pytest.raises(CkptconvError, match="is a character device"):
        read_regular(Path("/dev/zero"))
    with pytest.raises(CkptconvError, match="is a directory"):
        open_regular(tmp_path)


# -- only files inside the checkpoint -----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_index_naming_a_file_outside_the_directory(tmp_path: Path, where: str) -> None:
    other = hf_dir(tmp_path / "other")
    hf = hf_dir(tmp_path / "hf", sharded=True)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = "../other/model.safetensors" if where == "relative" else str(other / "model.safetensors")
    index["weight_map"] = dict.fromkeys(tensors(), name)
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    for command in (["inspect", str(hf)], ["hf-to-dcp", str(hf), str(tmp_path / "out")]):
        assert_refused(ckptconv(*command), "model.safetensors", "outside the checkpoint directory")
    assert not (tmp_path / "out").exists()


def test_symlinked_directory_leading_out_of_an_hf_checkpoint(tmp_path: Path) -> None:
    outside = hf_dir(tmp_path / "outside", sharded=True)
    hf = hf_dir(tmp_path / "hf", sharded=True)
    (hf / "model-00002-of-00002.safetensors").unlink()
    (hf / "sub").symlink_to(outside)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k: ("sub/" + v if v.startswith("model-00002") else v) for k, v in index["weight_map"].items()
    }
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = ckptconv("inspect", str(hf))
    assert_refused(proc, "sub/model-00002-of-00002.safetensors", "outside the checkpoint directory")


def test_symlinked_file_out_of_an_hf_checkpoint_and_one_inside(tmp_path: Path) -> None:
    outside = hf_dir(tmp_path / "outside")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").symlink_to(outside / "model.safetensors")
    assert_refused(ckptconv("inspect", str(hf)), "model.safetensors", "outside the checkpoint directory")
    (hf / "model.safetensors").unlink()
    (hf / "weights").mkdir()
    shutil.copy(outside / "model.safetensors", hf / "weights" / "real.safetensors")
    (hf / "model.safetensors").symlink_to("weights/real.safetensors")  # inside: fine
    shutil.rmtree(hf / "weights")
    (hf / "weights").symlink_to(outside)  # the link's target now leads out through a directory link
    assert_refused(ckptconv("inspect", str(hf)), "model.safetensors", "outside the checkpoint directory")


def test_symlinks_inside_the_checkpoint_keep_working(tmp_path: Path) -> None:
    hf = hf_dir(tmp_path / "hf")
    (hf / "weights").mkdir()
    (hf / "model.safetensors").rename(hf / "weights" / "real.bin")
    (hf / "model.safetensors").symlink_to("weights/real.bin")
    proc = ckptconv("hf-to-dcp", str(hf), str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert ckptconv("inspect", str(tmp_path / "out")).returncode == 0


def test_distcp_symlinked_out_of_a_dcp_checkpoint(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(ckpt / "__1_0.distcp", outside / "__1_0.distcp")
    (ckpt / "__1_0.distcp").symlink_to(outside / "__1_0.distcp")
    for command in (["inspect", str(ckpt)], ["dcp-to-hf", str(ckpt), str(tmp_path / "out")]):
        assert_refused(ckptconv(*command), "__1_0.distcp", "outside the checkpoint directory")


def test_metadata_path_through_a_symlinked_directory(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """`.metadata` names `shards/__1_0.distcp` (no `..`), but `shards` is a symlink out of the checkpoint."""
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(ckpt / "__1_0.distcp", outside / "__1_0.distcp")
    (ckpt / "shards").symlink_to(outside)
    import torch.distributed.checkpoint as dcp  # noqa: F401

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        if info.relative_path == "__1_0.distcp":
            info.relative_path = "shards/__1_0.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    for command in (["inspect", str(ckpt)], ["dcp-to-hf", str(ckpt), str(tmp_path / "out")]):
        assert_refused(ckptconv(*command), "shards/__1_0.distcp", "outside the checkpoint directory")
    os.unlink(ckpt / "shards")
    (ckpt / "shards").mkdir()  # the same path inside the checkpoint: fine
    shutil.move(outside / "__1_0.distcp", ckpt / "shards" / "__1_0.distcp")
    assert ckptconv("inspect", str(ckpt)).returncode == 0


def _hub_cache(home: Path, files: dict[str, bytes]) -> tuple[Path, str]:
    """huggingface_hub's cache layout for repo `org/name` at one commit, as snapshot_download leaves it:
    `models--org--name/snapshots/<commit>/<file>` -> `../../blobs/<sha>`, `refs/main` holding the commit."""
    import hashlib

    repo = home / "hub" / "models--org--name"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / sha)
    return snapshot, commit


def _hub_env(home: Path) -> dict[str, str]:
    env = _env()
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return env


def test_hub_cache_snapshot_links_into_blobs_keep_working(tmp_path: Path) -> None:
    hf = hf_dir(tmp_path / "hf", sharded=True)
    files = {p.name: p.read_bytes() for p in hf.iterdir()}
    snapshot, _ = _hub_cache(tmp_path / "home", files)
    env = _hub_env(tmp_path / "home")
    for args in (["inspect", "org/name", "--json"], ["hf-to-dcp", "org/name", str(tmp_path / "out"), "-q"]):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptconv", *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
    assert ckptconv("inspect", str(snapshot)).returncode == 0  # the snapshot directory named as a path
    # a "blob" link that leaves the repo's cache folder is refused like any other
    victim = snapshot / "model-00002-of-00002.safetensors"
    victim.unlink()
    victim.symlink_to(hf / victim.name)
    assert_refused(ckptconv("inspect", str(snapshot)), victim.name, "outside the checkpoint directory")


@pytest.mark.parametrize("repo_id", ["org/na..me", "org/name--x", "org/name-", "org/" + "x" * 100])
def test_repo_ids_huggingface_hub_refuses_are_one_line(tmp_path: Path, repo_id: str) -> None:
    env = _hub_env(tmp_path / "home")
    for args in (["inspect", repo_id], ["hf-to-dcp", repo_id, str(tmp_path / "out")]):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptconv", *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert_refused(proc, repo_id[:20], "not a valid hub repo id")


# -- every read error is one line ---------------------------------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory outside pytest's 0700 tmp tree, so a process without root's powers can walk it."""
    path = Path(tempfile.mkdtemp(prefix="ckptconv-eacces-"))
    path.chmod(0o755)
    yield path
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(path)


def unprivileged(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process that file modes apply to: as root, with CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH dropped (setpriv; the venv lives under /root, which user nobody cannot reach)."""
    cmd = [sys.executable, "-m", "ckptconv", *args]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop the capability to read any file")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=HANG)


def _require_modes_enforced(directory: Path) -> None:
    probe = directory / "probe.safetensors"
    probe.write_text("x")
    probe.chmod(0)
    proc = unprivileged("inspect", str(probe))
    probe.unlink()
    if "Permission denied" not in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip("file modes are not enforced here (cannot drop privileges)")


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp", "dir"])
def test_unreadable_dcp_files(fsdp2_ckpt: Path, shared_dir: Path, victim: str) -> None:
    _require_modes_enforced(shared_dir)
    ckpt = copy_ckpt(fsdp2_ckpt, shared_dir / "ckpt")
    (ckpt if victim == "dir" else ckpt / victim).chmod(0)
    needle = str(ckpt) if victim == "dir" else victim
    for command in (["inspect", str(ckpt)], ["dcp-to-hf", str(ckpt), str(shared_dir / "out")]):
        proc = unprivileged(*command)
        assert_refused(proc, needle)
        assert "Permission denied" in proc.stderr or "is not readable" in proc.stderr, proc.stderr


@pytest.mark.parametrize("victim", ["model.safetensors.index.json", "model-00002-of-00002.safetensors"])
def test_unreadable_hf_files(shared_dir: Path, victim: str) -> None:
    _require_modes_enforced(shared_dir)
    hf = hf_dir(shared_dir / "hf", sharded=True)
    (hf / victim).chmod(0)
    for command in (["inspect", str(hf)], ["hf-to-dcp", str(hf), str(shared_dir / "out")]):
        assert_refused(unprivileged(*command), victim, "Permission denied")


# -- a source that shrinks or changes while it is read ------------------------------------------------------


def _after_planning(monkeypatch: pytest.MonkeyPatch, damage) -> None:  # type: ignore[no-untyped-def]
    """Run `damage()` once hf-to-dcp has planned (headers read), right before it starts writing."""
    from ckptconv.formats import dcp_writer

    real = dcp_writer.write_dcp

    def write_dcp(*args, **kwargs):  # type: ignore[no-untyped-def]
        damage()
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_writer, "write_dcp", write_dcp)


def test_hf_source_truncated_during_hf_to_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = hf_dir(tmp_path / "hf", sharded=True)
    victim = hf / "model-00002-of-00002.safetensors"
    _after_planning(monkeypatch, lambda: os.truncate(victim, victim.stat().st_size - 20))
    code, err = run(capsys, "hf-to-dcp", str(hf), str(tmp_path / "out"))
    assert_one_line(code, err, victim.name, "changed or shrank")
    assert not (tmp_path / "out").exists()


def test_hf_source_rewritten_during_hf_to_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same size, other bytes (another model copied over it): refused, not half of each model."""
    hf = hf_dir(tmp_path / "hf")
    victim = hf / "model.safetensors"

    def rewrite() -> None:
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0xFF
        victim.write_bytes(bytes(raw))
        os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))

    _after_planning(monkeypatch, rewrite)
    code, err = run(capsys, "hf-to-dcp", str(hf), str(tmp_path / "out"))
    assert_one_line(code, err, victim.name, "changed or shrank")


def test_hf_to_dcp_in_process_with_a_shrinking_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptconv.job.ui import Ui
    from ckptconv.job.world import World
    from ckptconv.run.hf_to_dcp import hf_to_dcp

    hf = hf_dir(tmp_path / "hf")
    victim = hf / "model.safetensors"
    _after_planning(monkeypatch, lambda: os.truncate(victim, 100))
    with pytest.raises(CkptconvError, match=r"model\.safetensors: changed or shrank"):
        hf_to_dcp(str(hf), tmp_path / "out", world=World(0, 1), ui=Ui(quiet=True))


def test_distcp_replaced_after_metadata_was_read(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    from ckptconv.formats.dcp import open_dcp
    from ckptconv.formats.dcp_reader import DcpReader

    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    opened = open_dcp(ckpt)
    victim = ckpt / "__0_0.distcp"
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data)  # another file (inode) with the same bytes: not the one that was measured
    spec = next(t for t in opened.tensors.values() if any(c.file == victim.name for c in t.chunks))
    chunk = next(c for c in spec.chunks if c.file == victim.name)
    with DcpReader(opened) as reader, pytest.raises(CkptconvError, match="changed or shrank"):
        reader.read_chunk(spec, chunk)


# -- safetensors headers: what the safetensors library accepts, and nothing else ----------------------------

_A = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
HEADERS: dict[str, tuple[object, int]] = {  # name: (header JSON text or object, data bytes)
    "valid": ({"a": _A}, 16),
    "trailing bytes after the data": ({"a": _A}, 20),
    "empty key": ({"": _A}, 16),
    "float dim": ('{"a":{"dtype":"F32","shape":[4.0],"data_offsets":[0,16]}}', 16),
    "exponent dim": ('{"a":{"dtype":"F32","shape":[4e0],"data_offsets":[0,16]}}', 16),
    "string dim": ({"a": {**_A, "shape": ["4"]}}, 16),
    "bool dim": ({"a": {**_A, "shape": [True], "data_offsets": [0, 4]}}, 4),
    "negative dim": ({"a": {**_A, "shape": [-4]}}, 16),
    "NaN dim": ('{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,16]}}', 16),
    "Infinity dim": ('{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,16]}}', 16),
    "dim of 2**64": ({"a": {**_A, "shape": [2**64, 0], "data_offsets": [0, 0]}}, 0),
    "dims overflowing u64": ({"a": {**_A, "shape": [2**63, 2, 0], "data_offsets": [0, 0]}}, 0),
    "dim too large for torch": ({"a": {**_A, "shape": [0, 2**63], "data_offsets": [0, 0]}}, 0),
    "bits overflowing u64": ({"a": {**_A, "shape": [2**61], "data_offsets": [0, 0]}}, 0),
    "huge int": ('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,' + "9" * 400 + "]}}", 16),
    "float offset": ({"a": {**_A, "data_offsets": [0, 16.0]}}, 16),
    "three offsets": ({"a": {**_A, "data_offsets": [0, 16, 16]}}, 16),
    "gap before the first tensor": ({"a": {**_A, "data_offsets": [4, 20]}}, 20),
    "gap between tensors": (
        {
            "a": {**_A, "shape": [1], "data_offsets": [0, 4]},
            "b": {**_A, "shape": [1], "data_offsets": [8, 12]},
        },
        12,
    ),
    "end before begin": ({"a": {**_A, "shape": [0], "data_offsets": [16, 0]}}, 16),
    "extra field": ({"a": {**_A, "x": [1, {"y": None}]}}, 16),
    "metadata value not a string": ({"__metadata__": {"a": 1}, "a": _A}, 16),
    "metadata null": ({"__metadata__": None, "a": _A}, 16),
    "metadata a list": ({"__metadata__": [], "a": _A}, 16),
    "nested 127 deep": (
        '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"x":' + "[" * 125 + "]" * 125 + "}}",
        16,
    ),
    "nested 128 deep": (
        '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"x":' + "[" * 126 + "]" * 126 + "}}",
        16,
    ),
    "nested 100000 deep": (
        '{"__metadata__":' + "[" * 100000 + "]" * 100000 + ',"a":' + json.dumps(_A) + "}",
        16,
    ),
    "not an object": ("[]", 0),
    "whitespace around": (" \t\n" + json.dumps({"a": _A}) + "\r\n  ", 16),
    "trailing NUL": (json.dumps({"a": _A}) + "\0", 16),
    "UTF-16": (json.dumps({"a": _A}).encode("utf-16"), 16),
    "byte order mark": ("\ufeff" + json.dumps({"a": _A}), 16),
    "lone surrogate": ('{"\\ud800":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 16),
    "control character": ('{"a\x01":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 16),
    "duplicate __metadata__": ('{"__metadata__":{},"__metadata__":{},"a":' + json.dumps(_A) + "}", 16),
    "duplicate field": ('{"a":{"dtype":"F32","dtype":"F32","shape":[4],"data_offsets":[0,16]}}', 16),
    "missing dtype": ({"a": {"shape": [4], "data_offsets": [0, 16]}}, 16),
    "lowercase dtype": ({"a": {**_A, "dtype": "f32"}}, 16),
    "entry not an object": ({"a": [1, 2]}, 16),
    "no tensors": ({}, 0),
    "no tensors, data": ({}, 4),
    "zero-size tensors": (
        {
            "a": {**_A, "shape": [0], "data_offsets": [0, 0]},
            "b": {**_A, "shape": [0, 3], "data_offsets": [0, 0]},
        },
        0,
    ),
    "scalar": ({"a": {**_A, "shape": [], "data_offsets": [0, 4]}}, 4),
}


def crafted(path: Path, header: object, data: int) -> bytes:
    text = header if isinstance(header, (str, bytes)) else json.dumps(header)
    raw = text.encode() if isinstance(text, str) else text
    blob = struct.pack("<Q", len(raw)) + raw + b"\0" * data
    path.write_bytes(blob)
    return blob


def library_accepts(blob: bytes) -> bool:
    """Whether the safetensors library loads these bytes into torch tensors."""
    try:
        st_load(blob)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("name", sorted(HEADERS))
def test_headers_are_held_to_what_safetensors_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = tmp_path / "crafted.safetensors"
    blob = crafted(path, *HEADERS[name])
    code, err = run(capsys, "inspect", str(path), "--json")
    if library_accepts(blob):
        assert code == 0, err
    else:
        assert_one_line(code, err, "crafted.safetensors")


def test_duplicate_keys_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """safetensors 0.8 keeps the last of two equal keys; ckptconv refuses them: a file two readers could read
    differently (first wins / last wins) is not one to convert. Escapes count: `\\u0061` is `a`."""
    cases = {
        "tensor": '{"a":' + json.dumps(_A) + ',"a":' + json.dumps(_A) + "}",
        "escaped": '{"a":' + json.dumps(_A) + ',"\\u0061":' + json.dumps(_A) + "}",
        "metadata": '{"__metadata__":{"k":"1","k":"2"},"a":' + json.dumps(_A) + "}",
    }
    for case, text in cases.items():
        path = tmp_path / f"{case}.safetensors"
        crafted(path, text, 16)
        for command in (["inspect", str(path)], ["hf-to-dcp", str(path), str(tmp_path / "out")]):
            code, err = run(capsys, *command)
            assert_one_line(code, err, path.name, "appears twice")


@pytest.mark.parametrize("name", ["whitespace around", "extra field", "metadata null", "zero-size tensors"])
def test_unusual_but_valid_headers_convert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = tmp_path / "odd.safetensors"
    crafted(path, *HEADERS[name])
    code, err = run(capsys, "hf-to-dcp", str(path), str(tmp_path / "out"), "--quiet")
    assert code == 0, err


# -- --copy-from and the stash: only the source's own regular files ---------------------------------------


def test_copy_from_refuses_a_fifo_and_a_link_leading_out(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "tokenizer").mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("not the model's")
    out = tmp_path / "out"
    os.mkfifo(base / "tokenizer" / "vocab.txt")
    args = ("dcp-to-hf", str(fsdp2_ckpt), str(out), "--copy-from", str(base))
    assert_refused(ckptconv(*args, timeout=HANG), "vocab.txt", "FIFO")
    (base / "tokenizer" / "vocab.txt").unlink()
    (base / "tokenizer" / "vocab.txt").symlink_to(tmp_path / "secret.txt")
    assert_refused(ckptconv(*args, timeout=HANG), "vocab.txt", "outside the checkpoint directory")
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    (base / "tokenizer" / "vocab.txt").unlink()
    (base / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    (base / "tokenizer.json").symlink_to("tokenizer/vocab.txt")  # a link inside: copied as a file
    proc = ckptconv(*args)
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer" / "vocab.txt").read_text() == "a\nb\n"
    assert (out / "tokenizer.json").read_text() == "a\nb\n" and not (out / "tokenizer.json").is_symlink()


def test_copy_from_a_hub_snapshot_follows_its_links_into_blobs(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    snapshot, _ = _hub_cache(tmp_path / "home", {"config.json": b"{}", "tokenizer.json": b'{"v": 1}'})
    out = tmp_path / "out"
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), "--copy-from", str(snapshot))
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer.json").read_bytes() == b'{"v": 1}' and not (out / "tokenizer.json").is_symlink()


def test_fifo_named_like_the_stash(tmp_path: Path) -> None:
    hf = hf_dir(tmp_path / "hf")
    os.mkfifo(hf / "ckptconv_state.json")
    assert_refused(ckptconv("hf-to-dcp", str(hf), str(tmp_path / "out"), timeout=HANG), "ckptconv_state.json")
    assert not (tmp_path / "out").exists()


# -- review findings: parse time, NUL bytes, deep JSON, unreachable paths -----------------------------------


def test_an_unterminated_header_string_of_escapes_is_refused_at_once(tmp_path: Path) -> None:
    """A header of `"` then 500,000 `\\"`: a regex skipping strings backtracked quadratically (hours)."""
    body = b'"' + b'\\"' * 500_000
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(body).to_bytes(8, "little") + body)
    assert_refused(ckptconv("inspect", str(path), timeout=HANG), "model.safetensors", "not valid JSON")


def test_an_index_naming_a_file_with_a_nul_byte(tmp_path: Path) -> None:
    hf = hf_dir(tmp_path / "hf", sharded=True)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "a\u0000.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(ckptconv("inspect", str(hf)), "NUL byte")


def test_deeply_nested_config_and_mapping_files_are_one_line(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text("[" * 100_000)
    out = tmp_path / "out"
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), "--config", str(config))
    assert_refused(proc, "config.json", "more than 100 levels of nesting", "CKPTCONV_READ_DEPTH")
    mapping = tmp_path / "m.toml"
    mapping.write_text("a = " + "[" * 100_000)
    inspect = ("inspect", str(fsdp2_ckpt), "--mapping", str(mapping))
    assert_refused(ckptconv(*inspect), "m.toml", "more than 100 levels of nesting", "CKPTCONV_READ_DEPTH")
    mapping.write_bytes(b"\xff\xfe")
    assert_refused(ckptconv(*inspect), "m.toml", "not UTF-8")
    mapping.unlink()
    os.mkfifo(mapping)
    assert_refused(ckptconv(*inspect, timeout=HANG), "FIFO")
    assert not out.exists()


def test_paths_under_an_unreachable_directory_are_one_line(fsdp2_ckpt: Path, shared_dir: Path) -> None:
    """pathlib's exists()/is_dir() raise PermissionError for a path under a directory without x."""
    _require_modes_enforced(shared_dir)
    closed = shared_dir / "closed"
    closed.mkdir()
    closed.chmod(0)
    for args in (
        ("dcp-to-hf", str(fsdp2_ckpt), str(closed / "out")),
        ("dcp-to-hf", str(fsdp2_ckpt), str(shared_dir / "out"), "--config", str(closed / "config.json")),
        ("verify", str(fsdp2_ckpt), str(closed / "hf")),
    ):
        proc = unprivileged(*args)
        assert_refused(proc, "closed", "Permission denied")
