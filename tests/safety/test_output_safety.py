"""Output safety (issue #14): OUT is never an input; `--overwrite` replaces only checkpoints; a symlink at OUT
is written through; one writer per OUT (a lock naming the other run, stale locks taken over); every write
error (index, stash, `.metadata`, copied files, the lock) is exit 2 naming the file, nothing left behind."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import _env, ckptconv, random_dcp, start, wait_for
from test_bad_input import assert_one_line, run

from ckptconv.errors import CkptconvError
from ckptconv.publish.outdir import staging_dir


def lock_path(out: Path) -> Path:
    """Where ckptconv keeps the lock of OUT (ckptconv.publish.outlock.lock_path)."""
    return out.parent / f".{out.name}.ckptconv-lock"


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` (hidden ones too): file hashes, link targets, directories."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def leftovers(out: Path) -> list[str]:
    """Names beside OUT that a run made: staging, old, lock (and OUT itself)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.lstrip(".").startswith(out.name))


@pytest.fixture(scope="module")
def hf_dir(fsdp2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def medium_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~100 MB of fp32 in 2 tensors: its conversion lasts long enough to be caught holding its lock."""
    return random_dcp(tmp_path_factory.mktemp("medium") / "ckpt", 2, seed=1)


# --- OUT is never an input ---------------------------------------------------------------------------------


MAPPING = '[mapping]\nname = "test"\n\n[[rule]]\nruntime = "none.{layer}.x"\nhf = "none.{layer}.y"\n'


def _layout(
    tmp_path: Path, fsdp2_ckpt: Path, hf_dir: Path, direction: str, case: str
) -> tuple[list[str], str]:
    """Inputs under tmp_path/work laid out for `case`; (the command's arguments, the expected phrase)."""
    work = tmp_path / "work"
    src = work / "models" / "src"
    shutil.copytree(fsdp2_ckpt if direction == "dcp-to-hf" else hf_dir, src)
    base = [direction, str(src)]
    aside = work / "aside"
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    (aside / "map.toml").write_text(MAPPING)
    cases = {
        "out is src": ([*base, str(src)], "itself"),
        "out is src through a symlink": ([*base, str(work / "link")], "itself"),
        "out is the parent of src": ([*base, str(src.parent)], "contains SRC"),
        "out is an ancestor of src": ([*base, str(work)], "contains SRC"),
        "out is inside src": ([*base, str(src / "sub")], "inside SRC"),
        "out contains --config": (
            [*base, str(aside), "--config", str(aside / "config.json")],
            "contains --config",
        ),
        "out contains the mapping file": (
            [*base, str(aside), "--mapping", str(aside / "map.toml"), "--allow-unmapped"],
            "--mapping",
        ),
        "out is --copy-from": ([*base, str(aside), "--copy-from", str(aside)], "--copy-from"),
    }
    (work / "link").symlink_to(src)
    return list(cases[case][0]), cases[case][1]


CASES = [
    "out is src",
    "out is src through a symlink",
    "out is the parent of src",
    "out is an ancestor of src",
    "out is inside src",
    "out contains --config",
    "out contains the mapping file",
]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(
    ("direction", "case"),
    [("dcp-to-hf", c) for c in [*CASES, "out is --copy-from"]] + [("hf-to-dcp", c) for c in CASES],
)
def test_out_is_never_an_input(
    fsdp2_ckpt: Path,
    hf_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    direction: str,
    case: str,
    overwrite: bool,
) -> None:
    args, phrase = _layout(tmp_path, fsdp2_ckpt, hf_dir, direction, case)
    before = tree(tmp_path)
    code, err = run(capsys, *args, *(["--overwrite"] if overwrite else []), "--quiet")
    assert_one_line(code, err, phrase)
    assert tree(tmp_path) == before  # the sources byte for byte, and nothing new anywhere


def test_out_inside_the_hub_cache_of_a_repo_id_is_refused(hf_dir: Path, tmp_path: Path) -> None:
    """A repo id resolves to its snapshot in the HF cache: OUT may be neither inside that repo's folder nor
    contain it."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    blobs = cache / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in hf_dir.iterdir():  # the cache's layout: blobs, and snapshot entries linking to them
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f.name)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    before = tree(tmp_path)
    for out, phrase in ((blobs / "x", "inside the cache folder"), (cache, "contains")):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptconv", "hf-to-dcp", "org/tiny", str(out), "--overwrite"],
            capture_output=True,
            text=True,
            env={**_env(), **env},
        )
        assert_one_line(proc.returncode, proc.stderr, phrase)
        assert tree(tmp_path) == before


# --- what --overwrite replaces -----------------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("direction", ["dcp-to-hf", "hf-to-dcp"])
def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(
    fsdp2_ckpt: Path,
    hf_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    direction: str,
    overwrite: bool,
) -> None:
    src = fsdp2_ckpt if direction == "dcp-to-hf" else hf_dir
    home = tmp_path / "home"
    (home / "photos").mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    repo = tmp_path / "repo"  # weights beside a hidden entry a conversion never writes
    (repo / ".git").mkdir(parents=True)
    (repo / "model.safetensors").write_bytes(b"x")
    before = tree(tmp_path)
    flags = ["--overwrite"] if overwrite else []
    for out, names in ((home, ["notes.txt", "photos"]), (repo, [".git"])):
        code, err = run(capsys, direction, str(src), str(out), *flags, "--quiet")
        assert_one_line(code, err, str(out), "not a checkpoint", "remove it yourself", *names)
    assert tree(tmp_path) == before


def test_overwrite_replaces_a_previous_output(fsdp2_ckpt: Path, hf_dir: Path, tmp_path: Path) -> None:
    """A previous HF output (with a copied config) and a previous DCP output are replaced; nothing stale
    survives."""
    out = tmp_path / "hf"
    shutil.copytree(hf_dir, out)
    (out / "config.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), "--overwrite", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert tree(out) == tree(hf_dir) and leftovers(out) == ["hf"]
    back = tmp_path / "dcp"
    assert ckptconv("hf-to-dcp", str(hf_dir), str(back), "--quiet").returncode == 0
    first = tree(back)
    (back / "__9_0.distcp").write_bytes(b"stale")
    proc = ckptconv("hf-to-dcp", str(hf_dir), str(back), "--overwrite", "--quiet")
    assert proc.returncode == 0, proc.stderr
    again = tree(back)
    assert sorted(again) == sorted(first) and leftovers(back) == ["dcp"]
    for name in (n for n in first if n != ".metadata"):  # .metadata holds a fresh save id each time
        assert again[name] == first[name]


def test_publish_without_an_atomic_swap_and_recovery_of_a_moved_aside_out(
    fsdp2_ckpt: Path,
    hf_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the file system cannot swap directories, OUT is moved aside and the result moved in; a run
    killed between the two leaves `.OUT.ckptconv-old`, which the next run puts back before it checks OUT."""
    from ckptconv.publish import outdir

    monkeypatch.setattr(outdir, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    shutil.copytree(hf_dir, out)
    (out / "model.safetensors").write_bytes(b"stale")
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--overwrite", "--quiet")
    assert code == 0, err
    assert tree(out) == tree(hf_dir) and leftovers(out) == ["out"]
    out.rename(outdir.old_dir(out))  # what a run killed after moving OUT aside leaves (with its staging)
    shutil.copytree(hf_dir, staging_dir(out))
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--quiet")
    assert_one_line(code, err, "not empty", "--overwrite")
    assert tree(out) == tree(hf_dir) and leftovers(out) == ["out"]  # the stale staging is gone too
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--overwrite", "--quiet")
    assert code == 0, err
    assert tree(out) == tree(hf_dir) and leftovers(out) == ["out"]


def test_out_in_new_directories(fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a" / "b" / "out"
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--quiet")
    assert code == 0, err
    assert leftovers(out) == ["out"] and (out / "model.safetensors").is_file()


# --- a symlink at OUT --------------------------------------------------------------------------------------


def test_symlink_at_out_is_written_through(fsdp2_ckpt: Path, hf_dir: Path, tmp_path: Path) -> None:
    """OUT a symlink to a directory: the result goes to its target (said on stderr), the link stays a link."""
    real = tmp_path / "disk" / "release"
    real.mkdir(parents=True)
    link = tmp_path / "release"
    link.symlink_to(real)
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(link))
    assert proc.returncode == 0, proc.stderr
    assert "is a symlink: writing into its target" in proc.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert tree(real) == tree(hf_dir)
    (real / "model.safetensors").write_bytes(b"stale")
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(link), "--overwrite", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert link.is_symlink() and tree(real) == tree(hf_dir)
    assert sorted(p.name for p in real.parent.iterdir()) == ["release"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "release"]


def test_dangling_symlink_at_out_is_refused(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    link = tmp_path / "release"
    link.symlink_to(tmp_path / "missing")
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(link))
    assert_one_line(proc.returncode, proc.stderr, str(link), "does not exist")
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["release"]


# --- one writer per OUT ------------------------------------------------------------------------------------


def _popen(*args: str) -> subprocess.Popen[str]:
    return start([sys.executable, "-m", "ckptconv", *args])


@pytest.mark.slow
def test_second_run_fails_at_once_naming_the_run_that_holds_out(medium_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _popen("dcp-to-hf", str(medium_ckpt), str(out), "--bucket-size", "8MB", "--quiet")
    wait_for(staging_dir(out), first)
    os.kill(first.pid, signal.SIGSTOP)  # caught writing, for as long as the second run takes
    try:
        t0 = time.monotonic()
        second = ckptconv("dcp-to-hf", str(medium_ckpt), str(out), "--overwrite", "--quiet")
        assert time.monotonic() - t0 < 30
        assert_one_line(
            second.returncode, second.stderr, str(out), "another ckptconv run", f"pid {first.pid}"
        )
        assert not out.exists()
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    ref = tmp_path / "ref"
    assert ckptconv("dcp-to-hf", str(medium_ckpt), str(ref), "--quiet").returncode == 0
    assert tree(out) == tree(ref) and leftovers(out) == ["out"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_runs_started_together_leave_one_complete_result(
    fsdp2_ckpt: Path, tmp_path: Path, overwrite: bool
) -> None:
    """Different outputs (bf16, fp32) into one OUT at once: OUT is exactly one of them, whatever the
    timing."""
    refs = {}
    for dtype in ("bf16", "fp32"):
        refs[dtype] = tmp_path / f"ref-{dtype}"
        assert (
            ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(refs[dtype]), "--dtype", dtype, "-q").returncode == 0
        )
    out = tmp_path / "out"
    flags = ["--overwrite"] if overwrite else []
    runs = {d: _popen("dcp-to-hf", str(fsdp2_ckpt), str(out), "--dtype", d, *flags, "-q") for d in refs}
    done = {d: p.communicate(timeout=120) for d, p in runs.items()}
    ok = [d for d, p in runs.items() if p.returncode == 0]
    assert ok, done
    for d, p in runs.items():
        if p.returncode != 0:
            assert_one_line(p.returncode, done[d][1], str(out))
            assert "another ckptconv run" in done[d][1] or "not empty" in done[d][1], done[d][1]
    assert tree(out) in [tree(refs[d]) for d in ok]
    assert leftovers(out) == ["out"]


@pytest.mark.slow
def test_stale_lock_of_a_killed_run_is_taken_over(medium_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _popen("dcp-to-hf", str(medium_ckpt), str(out), "--bucket-size", "8MB", "--quiet")
    wait_for(staging_dir(out), first)
    first.kill()
    first.communicate(timeout=60)
    assert lock_path(out).exists() and not out.exists()  # what SIGKILL leaves: the lock and the staging
    proc = ckptconv("dcp-to-hf", str(medium_ckpt), str(out))
    assert proc.returncode == 0, proc.stderr
    assert "took over the lock" in proc.stderr and f"pid {first.pid}" in proc.stderr
    ref = tmp_path / "ref"
    assert ckptconv("dcp-to-hf", str(medium_ckpt), str(ref), "--quiet").returncode == 0
    assert tree(out) == tree(ref) and leftovers(out) == ["out"]


def test_lock_in_process(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """A live holder (this process) is named; a garbage lock file nobody holds is taken over; released
    locks leave nothing."""
    from ckptconv.publish import outlock

    out = tmp_path / "out"
    held = outlock.take(out)
    info = json.loads(lock_path(out).read_text())
    assert info["pid"] == os.getpid() and info["command"]
    with pytest.raises(CkptconvError, match=f"another ckptconv run is writing it \\(pid {os.getpid()} "):
        outlock.take(out)
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out))
    assert_one_line(proc.returncode, proc.stderr, f"pid {os.getpid()}", "wait for it to finish")
    held.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    lock_path(out).write_text("garbage")
    again = outlock.take(out)
    assert again.note() is not None
    again.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_lock_without_flock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without flock: the lock file alone holds OUT, and the error says how to clear it."""
    import errno

    from ckptconv.publish import outlock

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(outlock.fcntl, "flock", no_flock)
    out = tmp_path / "out"
    held = outlock.take(out)
    with pytest.raises(CkptconvError, match=r"if it is gone, remove .*ckptconv-lock"):
        outlock.take(out)
    held.release()
    outlock.take(out).release()
    assert list(tmp_path.iterdir()) == []


def test_save_hf_output_safety(tmp_path: Path) -> None:
    """save_hf (inside a training job) follows the same rules: no foreign directory, one writer per path."""
    from ckptconv import save_hf
    from ckptconv.publish import outlock

    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(CkptconvError, match="not a checkpoint"):
        save_hf(sd, home)
    assert [p.name for p in home.iterdir()] == ["notes.txt"]
    out = tmp_path / "out"
    held = outlock.take(out)
    with pytest.raises(CkptconvError, match="another ckptconv run"):
        save_hf(sd, out)
    held.release()
    save_hf(sd, out)
    save_hf(sd, out)  # overwrite=True by default: its own previous output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "out"]


# --- write errors: disk full, permissions ------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 small tensors (an index of ~5 pages) and a 20 kB non-tensor item (a stash of ~5 pages)."""
    path = tmp_path_factory.mktemp("many") / "ckpt"
    g = torch.Generator().manual_seed(2)
    model = {
        f"layers.{i}.attention.output_projection.weight": torch.randn(16, 64, generator=g) for i in range(200)
    }
    dcp.save({"model": model, "args": {"note": "x" * 20000}}, checkpoint_id=str(path), no_dist=True)
    return path


PAGE = 4096


def _pages(directory: Path, keep: Callable[[str], bool]) -> int:
    return sum(-(-p.stat().st_size // PAGE) for p in directory.iterdir() if keep(p.name))


def _record_pages(ref: Path) -> int:
    """The pages of the resume records a run writing `ref` again makes: one per safetensors file, and per
    DCP data file its record as written, listing where each of its items lies (from `.metadata`)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckptconv.publish.records import record_bytes

    pages = sum(1 for p in ref.glob("*.safetensors"))
    if (ref / ".metadata").exists():
        storage = FileSystemReader(str(ref)).read_metadata().storage_data
        for data in ref.glob("*.distcp"):
            items = sorted(
                (info.offset, (i.fqn, tuple(i.offset or ()), i.index, info.offset, info.length))
                for i, info in storage.items()
                if info.relative_path == data.name
            )
            size = data.stat().st_size
            ranges = [[0, size, 2**32 - 1]]
            raw = record_bytes(("f" * 64,) * 3, data.name, size, ranges, [x for _, x in items])
            pages += -(-len(raw) // PAGE)
    return pages


@pytest.fixture
def small_disk() -> Iterator[Callable[[int], Path]]:
    """A factory of tmpfs mounts of N pages (root only; skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts: list[Path] = []

    def mount(pages: int) -> Path:
        where = Path(tempfile.mkdtemp(prefix="ckptconv-disk-"))
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", str(where)])
        if proc.returncode != 0:
            where.rmdir()
            pytest.skip("cannot mount a tmpfs here")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", str(where)])
        where.rmdir()


@pytest.mark.parametrize(
    "what",
    [
        "index",
        "stash",
        "copied file",
        "metadata",
        pytest.param("metadata on 2 ranks", marks=pytest.mark.slow),
    ],
)
def test_disk_full_is_exit_2_naming_the_file(
    many_keys: Path, tmp_path: Path, small_disk: Callable[[int], Path], what: str
) -> None:
    """A tmpfs where the weights fit (with the lock and a page to spare) but `what` does not."""
    ref = tmp_path / "ref"
    extra: list[str] = []
    nproc = 0
    if what == "copied file":
        copy_from = tmp_path / "base"
        copy_from.mkdir()
        (copy_from / "tokenizer.json").write_text("t" * 40000)
        extra = ["--copy-from", str(copy_from)]
    if what == "index":
        extra = ["--max-shard-size", "100kB"]
    if what.startswith("metadata"):
        nproc = 2 if what.endswith("2 ranks") else 0
        hf = tmp_path / "hf"
        assert ckptconv("dcp-to-hf", str(many_keys), str(hf), "-q").returncode == 0
        args = ["hf-to-dcp", str(hf)]
        failing = ".metadata"
        fits = lambda name: name.endswith(".distcp")  # noqa: E731
    else:
        args = ["dcp-to-hf", str(many_keys)]
        failing = {"index": "model.safetensors.index.json", "stash": "ckptconv_state.json"}.get(
            what, "tokenizer.json"
        )
        fits = {  # what is written before the file that must not fit
            "index": lambda name: name.endswith(".safetensors"),
            "stash": lambda name: name.endswith(".safetensors"),
            "copied file": lambda name: name != "tokenizer.json",
        }[what]
    assert ckptconv(*args, str(ref), *extra, "-q", nproc=nproc).returncode == 0
    needed = sum(-(-p.stat().st_size // PAGE) for p in ref.iterdir() if p.name == failing)
    assert needed >= 3, f"{failing} is too small to make the test meaningful"
    # + each written file's resume record and their directory (in the staging directory until it is
    # published), the lock's page and one to spare
    disk = small_disk(_pages(ref, fits) + _record_pages(ref) + 1 + 2)
    out = disk / "out"
    proc = ckptconv(*args, str(out), *extra, "-q", nproc=nproc)
    if nproc:
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if "ckptconv: error:" in line]
        assert len(errors) == 1 and "cannot write (No space left on device)" in errors[0], proc.stderr
        assert failing in errors[0]
        # torchrun's launcher prints its own ChildFailedError summary; the workers print no traceback
        assert "ckptconv/" not in proc.stderr.replace(str(disk), "").replace(str(tmp_path), "")
    else:
        assert_one_line(proc.returncode, proc.stderr, "cannot write (No space left on device)", failing)
    assert sorted(os.listdir(disk)) == []  # no OUT, no staging, no lock


def _without_dac_override() -> None:
    """Drop root's power to ignore file modes (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) for this process and
    what it runs: the test's own files stay readable (root owns them), modes are enforced."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(97)


def test_unwritable_parent_is_exit_2_naming_the_lock(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping privileges needs root")
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    out = parent / "out"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptconv", "dcp-to-hf", str(fsdp2_ckpt), str(out)],
            capture_output=True,
            text=True,
            env=_env(),
            preexec_fn=_without_dac_override,
        )
        if proc.returncode == 97:
            pytest.skip("cannot drop CAP_DAC_OVERRIDE here")
        assert_one_line(proc.returncode, proc.stderr, str(lock_path(out)), "cannot write (Permission denied)")
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


# --- review fixes: what --overwrite replaces, reserved names, the lock file, moving OUT aside ---------------


def test_overwrite_refuses_a_work_directory_holding_weights(
    fsdp2_ckpt: Path, hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One `*.safetensors` (or `.metadata`) beside code and a subdirectory does not make a checkpoint."""
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    (work / "runs" / "log.txt").write_text("loss 1.0")
    (work / "model.safetensors").write_bytes(b"x")
    (work / "train.py").write_text("print('mine')")
    dcp_like = tmp_path / "dcp"
    dcp_like.mkdir()
    (dcp_like / ".metadata").write_bytes(b"x")
    (dcp_like / "config.json").symlink_to(work / "train.py")
    before = tree(tmp_path)
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(work), "--overwrite", "--quiet")
    assert_one_line(code, err, str(work), "not a checkpoint", "runs/", "train.py")
    assert "model.safetensors" not in err
    code, err = run(capsys, "hf-to-dcp", str(hf_dir), str(dcp_like), "--overwrite", "--quiet")
    assert_one_line(code, err, str(dcp_like), "not a checkpoint", "config.json@")
    assert tree(tmp_path) == before


def test_overwrite_replaces_an_output_with_copied_model_files(
    fsdp2_ckpt: Path, hf_dir: Path, tmp_path: Path
) -> None:
    """A previous output made with `--copy-from` of a transformers `save_pretrained` directory."""
    base = tmp_path / "base"
    base.mkdir()
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    names += ["special_tokens_map.json", "tokenizer.model", "merges.txt", "chat_template.jinja", "README.md"]
    for name in names:
        (base / name).write_text("{}" if name.endswith(".json") else name)
    out = tmp_path / "out"
    for _ in range(2):
        proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), "--copy-from", str(base), "--overwrite", "-q")
        assert proc.returncode == 0, proc.stderr
    assert set(names) <= set(tree(out)) and leftovers(out) == ["out"]


@pytest.mark.parametrize("suffix", [".ckptconv-old", ".ckptconv-partial", ".ckptconv-lock"])
def test_out_named_like_a_file_ckptconv_keeps_is_refused(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    """`.X.ckptconv-old` as OUT would be removed by a later run to X; so would anything inside it."""
    for out in (tmp_path / f".x{suffix}", tmp_path / ".y.ckptconv-partial" / "out"):
        code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--quiet")
        assert_one_line(code, err, str(out), "ckptconv keeps for its own files", "choose another OUT")
    link = tmp_path / "release"
    link.symlink_to(tmp_path / f".x{suffix}")
    (tmp_path / f".x{suffix}").mkdir()
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(link), "--quiet")
    assert_one_line(code, err, "ckptconv keeps for its own files")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".x{suffix}", "release"])


def test_a_fifo_at_the_lock_path_is_refused_at_once(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    os.mkfifo(lock_path(out))
    proc = ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), timeout=60)
    assert_one_line(proc.returncode, proc.stderr, str(lock_path(out)), "not a regular file", "remove it")
    from ckptconv.publish import outlock

    with pytest.raises(CkptconvError, match="not a regular file"):
        outlock.take(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock_path(out).name]


def _foreign_lock(out: Path, **info: object) -> None:
    """A lock file no process flocks, naming the run `info`."""
    lock_path(out).write_text(json.dumps({"started": time.time(), "command": "ckptconv x", **info}))


def test_a_lock_of_another_host_is_never_taken_over_on_flock_alone(tmp_path: Path) -> None:
    """With NFS `local_lock=flock` a flock is only seen on its host: a free flock says nothing there."""
    from ckptconv.publish import outlock

    out = tmp_path / "out"
    _foreign_lock(out, pid=4242, host="node-b.example")
    with pytest.raises(CkptconvError, match=r"host node-b\.example \(pid 4242\).*remove .*ckptconv-lock"):
        outlock.take(out)
    proc = ckptconv("dcp-to-hf", "missing-src", str(out))
    assert_one_line(proc.returncode, proc.stderr)
    assert [p.name for p in tmp_path.iterdir()] == [lock_path(out).name]


def test_a_lock_of_a_live_process_on_this_host_is_not_taken_over(tmp_path: Path) -> None:
    """A free flock and a live pid (a lock file left by hand, or on a file system that lost its flock)."""
    import socket

    from ckptconv.publish import outlock

    out = tmp_path / "out"
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        _foreign_lock(out, pid=sleeper.pid, host=socket.gethostname())
        with pytest.raises(CkptconvError, match=f"process is still there \\(pid {sleeper.pid} "):
            outlock.take(out)
    finally:
        sleeper.kill()
        sleeper.wait()
    taken = outlock.take(out)  # its process is gone now
    assert taken.note() is not None and f"pid {sleeper.pid}" in taken.note()
    taken.release()
    assert list(tmp_path.iterdir()) == []


def test_a_deeply_nested_lock_file_is_taken_over(tmp_path: Path) -> None:
    from ckptconv.publish import outlock

    out = tmp_path / "out"
    lock_path(out).write_text("[" * 200000)
    outlock.take(out).release()
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_once_the_lock_is_in_place_removes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal let through by another thread, between placing the lock file and returning it."""
    from ckptconv.publish import outlock

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(outlock, "OutLock", interrupted)
    with pytest.raises(KeyboardInterrupt):
        outlock.take(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_move_into_place_puts_out_back(
    fsdp2_ckpt: Path,
    hf_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an atomic swap: OUT moved aside, then moving the result in fails: OUT is moved back."""
    from ckptconv.publish import outdir

    monkeypatch.setattr(outdir, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    shutil.copytree(hf_dir, out)
    before = tree(out)
    rename = Path.rename

    def failing(self: Path, target: str | Path) -> Path:
        if self == staging_dir(out):
            raise OSError(13, "Permission denied", str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--overwrite", "--quiet")
    assert_one_line(code, err, str(out), str(staging_dir(out)), "previous OUT is back")
    assert tree(out) == before and leftovers(out) == ["out"]


def test_an_empty_out_beside_a_moved_aside_one_gets_it_back(
    fsdp2_ckpt: Path, hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed after moving OUT aside, then `mkdir OUT`: the next run must not remove the only copy."""
    from ckptconv.publish import outdir

    out = tmp_path / "out"
    shutil.copytree(hf_dir, outdir.old_dir(out))
    out.mkdir()
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), "--quiet")
    assert_one_line(code, err, "not empty", "--overwrite")
    assert tree(out) == tree(hf_dir) and leftovers(out) == ["out"]
