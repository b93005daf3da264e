"""Every ckptconv command shown in the README and the docs runs (issue #22 point 5), so the examples cannot
go stale: each ```bash block that runs ckptconv is run, line by line as a shell runs it (or whole, as a
script, where the page says so), in a sandbox made of the parts its `<!-- example: ... -->` line names
(docs_examples.py). Every command must exit 0 without a traceback, and a `--json` report must follow
the published schema.

What a sandbox changes in a line, and why (nothing else is touched):
- `/models/...` and `/shared/...` are the sandbox's `models/` and `shared/` (no test writes to `/`);
- `--nproc-per-node 8` (or 4) runs 2 ranks (this machine has 2 cores; the output is the same at any world
  size, which other tests check byte for byte); the two-node line runs as two torchrun "nodes" of 1 rank
  meeting on 127.0.0.1, the first hosting the rendezvous (`host0` is not a host here);
- `http://minio:9000` is the test's own S3 server (moto's), which also serves `s3://bucket/...` through the
  environment (AWS_ENDPOINT_URL), and hub repo ids come from the offline hub cache the parts fill;
- `--push-to-hub` runs in this process with huggingface_hub's HfApi replaced by commands/test_hub_push.py's
  recorder (there is no Hub here), which checks what would be uploaded.
Each example is shown standalone, so a converting command's OUT is removed first when it is there (made by
a part, or by an earlier line of the block), except on a line that passes `--overwrite`. The sandbox is a copy
of the parts, with HOME in it; an example naming any other absolute path fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import jsonschema
import pytest
import typer
from conftest import s3_options
from docs_examples import PARTS, ROOT, Block, blocks, part
from test_docs_commands import argv as ckptconv_argv

from ckptconv.cli.app import app
from ckptconv.cli.schema import load

BLOCKS = blocks()
VALIDATOR = jsonschema.Draft202012Validator(load())


def test_every_block_is_announced() -> None:
    """A new example must say which sandbox it runs in (or it would not run)."""
    bare = [b.id for b in BLOCKS if not b.parts]
    assert not bare, (
        f"bash blocks running ckptconv with no `<!-- example: PARTS -->` line before them: {bare}"
    )
    unknown = {p for b in BLOCKS for p in b.parts} - set(PARTS)
    assert not unknown, f"unknown parts {unknown}; known: {sorted(PARTS)}"
    assert len(BLOCKS) >= 20 and sum(len(b.commands) for b in BLOCKS) > 60


def _sandbox(block: Block, tmp_path: Path, endpoint: str | None) -> tuple[Path, dict[str, str]]:
    box = tmp_path / "sandbox"
    box.mkdir()
    for name in block.parts:
        if name == "s3":
            continue  # in the bucket, not the sandbox
        source = part(name)
        clash = [p for p in source.rglob("*") if p.is_file() and (box / p.relative_to(source)).exists()]
        assert not clash, f"{block.id}: part {name!r} clashes with another part at {clash[:3]}"
        shutil.copytree(source, box, dirs_exist_ok=True)
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(ROOT),
        HOME=str(box),
        HF_HOME=str(box / ".hf"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    env.pop("CKPTCONV_DEBUG", None)
    if endpoint:
        options = s3_options(endpoint)
        env.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID=options["key"],
            AWS_SECRET_ACCESS_KEY=options["secret"],
        )
    return box, env


def _fill_bucket(endpoint: str) -> object:
    import s3fs

    client = s3fs.S3FileSystem(**s3_options(endpoint), use_listings_cache=False)
    if client.exists("bucket"):
        client.rm("bucket", recursive=True)
    client.mkdir("bucket")
    source = part("s3") / "bucket"
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        client.put_file(str(path), f"bucket/{path.relative_to(source)}")
    return client


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _localize(line: str, box: Path, endpoint: str | None) -> str:
    line = re.sub(r"(?<=[\s'\"])/(models|shared)/", lambda m: f"{box}/{m.group(1)}/", line)
    line = re.sub(r"--nproc-per-node [48]\b", "--nproc-per-node 2", line)
    if endpoint:
        line = line.replace("http://minio:9000", endpoint)
    outside = [w for w in shlex.split(line) if w.startswith("/") and not w.startswith(str(box))]
    assert not outside, f"`{line}` names paths outside the sandbox: {outside}"
    return line


def _clear_out(args: list[str], box: Path, client: object) -> None:
    """Remove a converting command's OUT (found by the command's own parser) unless the line passes
    --overwrite."""
    if args[0] not in ("dcp-to-hf", "hf-to-dcp") or "--overwrite" in args:
        return
    command = typer.main.get_command(app).commands[args[0]]  # type: ignore[attr-defined]
    out = str(command.make_context(args[0], args[1:]).params["out"])
    if out.startswith("s3:/"):
        key = out.removeprefix("s3://").removeprefix("s3:/")
        if client.exists(key):  # type: ignore[attr-defined]
            client.rm(key, recursive=True)  # type: ignore[attr-defined]
    elif (box / out).exists():
        shutil.rmtree(box / out)


def _shell(line: str, box: Path, env: dict[str, str], out: Path) -> subprocess.Popen[bytes]:
    """`line` started by bash (with pipefail) in its own session, stdout and stderr into files."""
    return subprocess.Popen(
        ["bash", "-o", "pipefail", "-c", line],
        cwd=box,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=(out.with_suffix(".out")).open("wb"),
        stderr=(out.with_suffix(".err")).open("wb"),
        start_new_session=True,
    )


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float = 600) -> None:
    """Wait for every process; whatever is left of their sessions (torchrun's workers) is killed after."""
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(line: str, box: Path, env: dict[str, str], tmp: Path) -> None:
    proc = _shell(line, box, env, tmp / "line")
    _wait([proc])
    _check(line, ckptconv_argv(line), proc.returncode, *_output(tmp / "line"))


def _output(stem: Path) -> tuple[str, str]:
    return stem.with_suffix(".out").read_text(), stem.with_suffix(".err").read_text()


# torchrun's agent, not ckptconv: the node hosting the rendezvous store may leave the agents' exit barrier
# and close the store while another node's agent still waits on it (pytorch/pytorch#69520). That agent then
# logs this error with a traceback, one record, every line behind the same logging prefix, and exits 0.
_EXIT_BARRIER_RACE = re.compile(r"^(\S+ \S+ \d+ \S+\]) Error waiting on exit barrier", re.MULTILINE)


def without_exit_barrier_race(err: str) -> str:
    """`err` less the records of torchrun's exit-barrier race; any other traceback stays."""
    for prefix in _EXIT_BARRIER_RACE.findall(err):
        err = "".join(ln for ln in err.splitlines(keepends=True) if not ln.startswith(prefix + " "))
    return err


def _check(line: str, args: list[str], code: int, out: str, err: str) -> None:
    assert code == 0, f"`{line}` exited {code}:\n{out}\n{err}"
    assert "Traceback" not in without_exit_barrier_race(err), f"`{line}`:\n{err}"
    if "--json" in args and ">" not in line:
        VALIDATOR.validate(json.loads(out))


def _two_nodes(line: str, box: Path, env: dict[str, str], tmp: Path) -> None:
    port = _free_port()
    procs = []
    for node in (0, 1):  # node 0 hosts the rendezvous
        one = line.replace("--nproc-per-node 2", "--nproc-per-node 1")
        host = f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-conf is_host={int(node == 0)}"
        one = re.sub(r"--rdzv-endpoint \S+", host, one)
        procs.append(_shell(one, box, env, tmp / f"node{node}"))
    _wait(procs)
    for node, proc in enumerate(procs):
        _check(line, ckptconv_argv(line), proc.returncode, *_output(tmp / f"node{node}"))


def _push(line: str, box: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from test_hub_push import FakeApi

    from ckptconv.cli.app import main

    FakeApi.calls, FakeApi.fail, FakeApi.uploaded = [], {}, {}
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.delenv("CKPTCONV_DEBUG", raising=False)
    monkeypatch.chdir(box)
    args = ckptconv_argv(line)
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    _check(line, args, code, captured.out, captured.err)
    repo = args[args.index("--push-to-hub") + 1]
    uploads = [kw for name, kw in FakeApi.calls if name in ("upload_folder", "upload_large_folder")]
    assert uploads and uploads[0]["repo_id"] == repo, FakeApi.calls
    for flag, name in (("--revision", "revision"), ("--commit-message", "commit_message")):
        if flag in args:
            assert uploads[0][name] == args[args.index(flag) + 1], FakeApi.calls
    created = [kw for name, kw in FakeApi.calls if name == "create_repo"]
    assert created and created[0].get("private") is (True if "--private" in args else None), FakeApi.calls
    assert "model.safetensors" in FakeApi.uploaded or "model.safetensors.index.json" in FakeApi.uploaded


def test_only_torchruns_exit_barrier_record_is_forgiven() -> None:
    """The record comes from torchrun's own logger (as its agent writes it); a traceback of anything else,
    or an exit-barrier error under another prefix, still fails the example."""
    code = (
        "import torch.distributed.run, traceback\n"
        "from torch.distributed.elastic.agent.server import api\n"
        "try:\n    raise RuntimeError('recvValueWithTimeout failed')\n"
        "except RuntimeError:\n"
        "    api.logger.exception('Error waiting on exit barrier. Elapsed: %s seconds', 0.1)\n"
        "    api.logger.warning('failed to shutdown the rendezvous')\n"
    )
    agent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert agent.count("Traceback") == 1 and "Error waiting on exit barrier" in agent
    assert "Traceback" not in without_exit_barrier_race(agent)
    assert "failed to shutdown the rendezvous" in without_exit_barrier_race(agent)
    ours = 'Traceback (most recent call last):\n  File "ckptconv/cli/app.py", line 1\nValueError: x\n'
    assert "ValueError" in without_exit_barrier_race(agent + ours + agent)


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_example_runs(
    block: Block,
    tmp_path: Path,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    uses_s3 = "s3" in block.parts
    endpoint = s3_endpoint if uses_s3 else None
    box, env = _sandbox(block, tmp_path, endpoint)
    client = _fill_bucket(s3_endpoint) if uses_s3 else None
    if block.script_args is not None:
        script = tmp_path / "example.sh"
        script.write_text(_localize(block.text, box, endpoint))
        proc = _shell(f"bash {script} {' '.join(block.script_args)}", box, env, tmp_path / "script")
        _wait([proc])
        out, err = _output(tmp_path / "script")
        assert proc.returncode == 0, f"{block.id} as a script exited {proc.returncode}:\n{out}\n{err}"
        assert "Traceback" not in err
        reports = [*box.glob("*.convert.json"), *box.glob("*.report.json")]
        assert reports, f"{block.id}: the script wrote no report"
        for report in reports:
            VALIDATOR.validate(json.loads(report.read_text()))
        return
    for original in block.commands:
        line = _localize(original, box, endpoint)
        args = ckptconv_argv(line)
        if args in (["--version"], ["--help"]):
            _run(line, box, env, tmp_path)
            continue
        _clear_out(args, box, client)
        if "--push-to-hub" in args:
            _push(line, box, monkeypatch, capsys)
        elif "--nnodes 2" in line:
            _two_nodes(line, box, env, tmp_path)
        else:
            _run(line, box, env, tmp_path)
