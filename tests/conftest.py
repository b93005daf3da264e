"""Shared fixtures: real DCP checkpoints written by FSDP2 jobs under torchrun (gloo, CPU), built once."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SUPPORT = TESTS / "support"  # the helper modules, the pinned requirements and the workers
WORKERS = SUPPORT / "workers"

# Tests import the helpers and one another by bare name (`from families import tiny`, `from test_bad_input
# import run`), whichever folder holds them: support/ and every folder with a test module go on sys.path here,
# since pytest's default ("prepend") import mode puts a folder there only when it collects a test from it.
FOLDERS = [SUPPORT, *sorted({path.parent for path in TESTS.rglob("test_*.py")})]
sys.path[:0] = [str(folder) for folder in FOLDERS if str(folder) not in sys.path]

from forkserver import ForkServer  # noqa: E402

# The modules that take longest (seconds of one run, summed over their tests), started first: with
# `--dist loadfile` each module runs whole on one worker, in collection order, so a long module collected
# last would run alone at the end while the other worker idles (longest first is the classic fix).
LONGEST_FIRST = (
    "test_presets_v2.py",  # 416 s
    "test_transformers_layouts.py",  # 310 s (regenerating the presets: 210 s)
    "test_output_safety.py",  # 186 s
    "test_megatron_harness.py",  # 153 s
    "test_hostile_inputs.py",  # 151 s
    "test_live.py",  # 123 s
    "test_docs_examples.py",  # 134 s
    "test_verify.py",  # 112 s
    "test_megatron_gpt.py",  # 111 s
    "test_object_storage.py",  # 110 s
    "test_mapping.py",  # 96 s
    "test_dcp_to_hf.py",  # 94 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with tests/ and FOLDERS in front of its PYTHONPATH: for a process that imports test modules by
    name (`python -m test_bounded_readers`, or the fork server that runs it)."""
    folders = [str(TESTS), *map(str, FOLDERS)]
    return {**env, "PYTHONPATH": os.pathsep.join([*folders, env.get("PYTHONPATH", "")])}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CKPTCONV_DEBUG", None)
    return env


def torchrun(
    nproc: int, *args: str, check: bool = True, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """Run `python -m torch.distributed.run --standalone --nproc-per-node nproc ARGS...` (its launcher forked
    from `forkserver`'s zygote, unless CKPTCONV_TEST_FORKSERVER=0; its workers are new interpreters)."""
    argv = ["--standalone", f"--nproc-per-node={nproc}", *args]
    if _forked():
        proc = _forkserver[0].run("torch.distributed.run", argv, _env(), timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{proc.args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


_forkserver: list[ForkServer] = []


def _forked() -> bool:
    """Whether commands go through the fork server (started on first use)."""
    if os.environ.get("CKPTCONV_TEST_FORKSERVER", "1") != "1":
        return False
    if not _forkserver:
        _forkserver.append(ForkServer(on_path(_env())))
    return True


def ckptconv(*args: str, nproc: int = 0, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh process: `python -m ckptconv` forked from a process that has imported torch
    already (`forkserver`; CKPTCONV_TEST_FORKSERVER=0: `python -m ckptconv` itself), or under torchrun
    (nproc > 0)."""
    if nproc:
        return torchrun(nproc, "-m", "ckptconv", *args, check=False, timeout=timeout)
    if _forked():
        return _forkserver[0].run("ckptconv", list(args), _env(), timeout)
    cmd = [sys.executable, "-m", "ckptconv", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=_env(), timeout=timeout, stdin=subprocess.DEVNULL
    )


def start(argv: list[str], env: dict[str, str] | None = None, **kwargs: object) -> subprocess.Popen[str]:
    """`argv` started in the background (stdout and stderr piped, no stdin); `ckptconv` for the CLI itself."""
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or _env(),
        stdin=subprocess.DEVNULL,
        **kwargs,
    )


def wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 60) -> None:
    """Until `path` exists (a run's staging directory: it is writing); fails if `proc` ends first."""
    import time

    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.002)


def two_nodes(*args: str, timeout: int = 300) -> list[subprocess.CompletedProcess[str]]:
    """`torchrun --nnodes 2 --nproc-per-node 1 -m ckptconv ARGS` started twice, as two "nodes" of one machine
    meeting through torchrun's c10d rendezvous on 127.0.0.1 (the first hosts the store)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "ckptconv-test",
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                "-m",
                "ckptconv",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            stdin=subprocess.DEVNULL,
        )
        for node in (0, 1)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def make_dcp(path: Path, nproc: int, layout: str, fmt: str = "torch_save") -> Path:
    """Build a fixture checkpoint. This generates test data (ckptconv is not running), so a gloo teardown
    abort of torch's own (see workers/_finish.py) gets one retry instead of failing an unrelated test."""
    proc = torchrun(nproc, str(WORKERS / "make_dcp.py"), str(path), layout, fmt, check=False)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        shutil.rmtree(path, ignore_errors=True)
        proc = torchrun(nproc, str(WORKERS / "make_dcp.py"), str(path), layout, fmt, check=False)
    assert proc.returncode == 0, f"make_dcp {layout} on {nproc} ranks failed:\n{proc.stdout}\n{proc.stderr}"
    return path


def reference(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(str(path) + ".ref.pt", weights_only=True)


def tree_sha256(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()
    }


@pytest.fixture(scope="session")
def fsdp2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks, uneven shards, fp32 A_log, int and bool buffers, optimizer state, step and nested args."""
    return make_dcp(tmp_path_factory.mktemp("fsdp2") / "ckpt", 2, "fsdp2")


@pytest.fixture(scope="session")
def mesh2d_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks, a 2x2 (dp, tp) mesh: FSDP2 x TP blocks and strided rows, in the safetensors serialization."""
    return make_dcp(tmp_path_factory.mktemp("mesh2d") / "ckpt", 4, "mesh2d", "safetensors")


def random_dcp(path: Path, tensors: int, seed: int = 0) -> Path:
    """`tensors` fp32 tensors of 3000 x 4096 (47 MiB each) saved by dcp.save in one process."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(seed)
    state = {"model": {f"layers.{i}.w": torch.randn(3000, 4096, generator=g) for i in range(tensors)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="session")
def slow_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~400 MB of fp32 in 8 tensors: a conversion slow enough to signal or kill midway."""
    return random_dcp(tmp_path_factory.mktemp("slow") / "ckpt", 8)


SECRET = "not-a-real-secret-but-one-that-must-not-leak"


def s3_options(endpoint: str, secret: str = SECRET) -> dict[str, str]:
    """--storage-options for the test's S3 server."""
    return {"key": "test-key", "secret": secret, "endpoint_url": endpoint}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server (as s3fs's own test suite runs it) in its own process, on a free port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    recording = tempfile.mkdtemp(prefix="ckptconv-moto-")  # its request log (s3_requests), not the cwd
    atexit.register(shutil.rmtree, recording, True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "MOTO_RECORDER_FILEPATH": os.path.join(recording, "requests.jsonl")},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto's server did not start") from None
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def s3_requests(endpoint: str, run: Callable[[], T]) -> tuple[T, list[dict[str, Any]]]:
    """`run()`'s result and every request the S3 server got meanwhile (moto's recorder: method, url)."""
    import requests

    api = f"{endpoint}/moto-api/recorder"
    requests.post(f"{api}/reset-recording", timeout=10)
    requests.post(f"{api}/start-recording", timeout=10)
    try:
        result = run()
    finally:
        requests.post(f"{api}/stop-recording", timeout=10)
    log = requests.get(f"{api}/download-recording", timeout=10).text
    # moto's threaded server can write two records on one line: read them one JSON value at a time
    decoder, records, at = json.JSONDecoder(), [], 0
    while at < len(log):
        if log[at].isspace():
            at += 1
            continue
        record, at = decoder.raw_decode(log, at)
        records.append(record)
    return result, records


@pytest.fixture(scope="module")
def s3(s3_endpoint: str) -> Any:
    """An s3fs client of that server, with the bucket `ckpts` made."""
    import s3fs

    client = s3fs.S3FileSystem(**s3_options(s3_endpoint), use_listings_cache=False)
    client.mkdir("ckpts")
    return client


# -- the structured fuzzers' counts (tests/fuzz/fuzz_oracle.py), shown at the end of the run -----------------

_fuzzed: dict[str, dict[str, int]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A fuzzing test's counts, from its teardown report's user_properties (xdist sends those to the
    controller, so this adds up every worker's)."""
    if report.when == "teardown":
        counts = {k: v for k, v in report.user_properties if k.startswith("fuzz_")}
        if counts:
            _fuzzed[report.nodeid] = counts


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _fuzzed:
        return
    keys = ("fuzz_inputs", "fuzz_commands", "fuzz_succeeded", "fuzz_seconds")
    total = {k: sum(c.get(k, 0) for c in _fuzzed.values()) for k in keys}
    terminalreporter.section("structured fuzzing")

    def line(c: dict[str, Any], what: str) -> str:
        return (
            f"{c.get('fuzz_inputs', 0):6d} inputs {c.get('fuzz_commands', 0):6d} commands "
            f"({c.get('fuzz_succeeded', 0)} exit 0, {c.get('fuzz_seconds', 0):.0f} s)  {what}"
        )

    for nodeid, c in sorted(_fuzzed.items()):
        terminalreporter.line(line(c, nodeid))
    terminalreporter.line(line(total, f"in {len(_fuzzed)} tests (CKPTCONV_FUZZ_EXAMPLES: examples per test)"))


@pytest.fixture
def fuzzer(
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Any]:
    """The structured fuzzers' Fuzzer (fuzz/fuzz_oracle.py) for one test; test_fuzz_oracle has its own."""
    from fuzz_oracle import fuzzing

    yield from fuzzing(request, capsys, tmp_path, monkeypatch)
