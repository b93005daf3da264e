"""megatron-core 0.16.1 for tests, run under torchrun in a subprocess.

Megatron-Core's `dist_checkpointing.save` writes the torch_dist checkpoints of Megatron-LM and NeMo 2. The
tests produce them with megatron-core's own code: `megatron_dir()` installs the pins of
megatron-requirements.txt once, with `pip install --no-deps --target`, into .cache/megatron-core-0.16.1
under the repository, and `run_megatron()` runs support/workers/megatron_save.py under torchrun (gloo, CPU)
with that directory on PYTHONPATH in front of the venv's own site-packages (torch and numpy come from the
venv, through the same interpreter). See docs/notes/megatron-torch-dist.md for what the checkpoints hold.

A failed install raises: a test that needs megatron-core fails rather than skips.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pinned import install_pinned

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "megatron-requirements.txt"
WORKER = Path(__file__).resolve().parent / "workers" / "megatron_save.py"
VERSION = "0.16.1"
MEGATRON_DIR = ROOT / ".cache" / f"megatron-core-{VERSION}"


def _env(pythonpath: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CKPTCONV_DEBUG", None)
    if pythonpath is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = pythonpath
    return env


def megatron_dir() -> Path:
    """The --target directory holding megatron-core 0.16.1 (and whatever the pins add):
    `pinned.install_pinned`, once."""
    return install_pinned(MEGATRON_DIR, REQUIREMENTS)


def run_megatron(nproc: int, *args: str, timeout: int = 300) -> None:
    """`python -m torch.distributed.run --standalone --nproc-per-node NPROC support/workers/megatron_save.py
    ARGS...` (as tests/conftest.py's `torchrun` runs workers) with megatron-core on PYTHONPATH; ARGS are MODE
    OUT [options] (see the worker). Raises RuntimeError with the job's output when it fails or times out.

    The job runs in its own session with its output in a file rather than a pipe, and whatever is left of
    its process group when torchrun ends is killed: a worker that dies before shutting down megatron's
    write-results Manager (a "spawn" child) would otherwise leave an orphan holding the output pipe open,
    and reading the output would wait for it forever."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(WORKER), *args]
    env = _env(str(megatron_dir()))
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        output = log.read()
    if returncode != 0:
        how = f"timed out after {timeout} s" if returncode is None else f"failed ({returncode})"
        raise RuntimeError(f"{' '.join(cmd)} {how}:\n{output}")


_SAVED: dict[tuple[str, ...], Path] = {}


def saved(*args: str) -> Path:
    """The checkpoint `megatron_save.py MODE OUT [options]` writes for ARGS = (MODE, options...) on 2 ranks,
    once per test session whichever module asks first (megatron runs cost ~10 s each): OUT = DIR/ckpt, with
    the worker's expected.pt and config.json in DIR. Read-only for the tests sharing it; removed at exit."""
    if args not in _SAVED:
        root = Path(tempfile.mkdtemp(prefix="ckptconv-megatron-"))
        atexit.register(shutil.rmtree, root, True)
        run_megatron(2, args[0], str(root / "ckpt"), *args[1:])
        _SAVED[args] = root / "ckpt"
    return _SAVED[args]
