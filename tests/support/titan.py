"""torchtitan 0.3.0's StateDictAdapters for tests, run in a subprocess.

torchtitan cannot live in the main venv (it needs triton and fla, and its declared dependencies pull wandb,
datasets and a newer huggingface_hub), so `titan_dir()` installs the pins of support/titan-requirements.txt
once, with `pip install --no-deps --target`, into .cache/torchtitan-0.3.0 under the repository, and
`run_adapter()` runs support/workers/titan_adapter.py with that directory on PYTHONPATH in front of the venv's
own site-packages (torch, safetensors and transformers come from the venv, through the same interpreter).
`run_titan_job()` runs a torchrun job (such as support/workers/titan_checkpoint.py) with the same PYTHONPATH.

A failed install raises: a test that needs torchtitan fails rather than skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pinned import install_pinned

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "titan-requirements.txt"
WORKER = Path(__file__).resolve().parent / "workers" / "titan_adapter.py"
TITAN_DIR = ROOT / ".cache" / "torchtitan-0.3.0"
# torchtitan's family names (torchtitan/models/<family>); "kimi_k2_7" holds the Kimi K2.5/K2.6/K2.7 adapter.
FAMILIES = ("llama3", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_5", "kimi_k2_7", "muse_glimmer")


def _env(pythonpath: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if pythonpath is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = pythonpath
    return env


def titan_dir() -> Path:
    """The --target directory holding torchtitan 0.3.0 and the packages its adapters import:
    `pinned.install_pinned`, once."""
    return install_pinned(TITAN_DIR, REQUIREMENTS)


def run_adapter(
    family: str, direction: str, config: dict[str, Any], src: Path, dst: Path, timeout: int = 300
) -> None:
    """`direction` ("from_hf", "to_hf", "load" or "model") with torchtitan 0.3.0's `family` adapter, for a
    checkpoint whose HF config.json is `config`: SRC an HF directory (from_hf, load) or a runtime safetensors
    file (to_hf), DST a safetensors file (a JSON file for model); see support/workers/titan_adapter.py. Raises
    RuntimeError with the worker's output when it fails."""
    if family not in FAMILIES:
        raise ValueError(f"unknown torchtitan family {family!r}; one of {FAMILIES}")
    cmd = [sys.executable, str(WORKER), family, direction, json.dumps(config), str(src), str(dst)]
    _run(cmd, timeout, f"torchtitan {family} {direction} of {src}")


def run_titan_job(nproc: int, worker: Path, *args: str, timeout: int = 300) -> None:
    """`python -m torch.distributed.run --standalone --nproc-per-node NPROC WORKER ARGS...` with the same
    PYTHONPATH as `run_adapter` (torchtitan 0.3.0's install in front of the venv's site-packages): a
    torchrun job (gloo, CPU) that uses torchtitan's own training components, such as
    tests/support/workers/titan_checkpoint.py. Raises RuntimeError with the job's output when it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(worker), *args]
    _run(cmd, timeout, " ".join(cmd))


def run_script(worker: Path, *args: str, timeout: int = 300) -> None:
    """`python WORKER ARGS...` in one process with torchtitan 0.3.0's install on PYTHONPATH (as
    `run_adapter`), such as support/workers/titan_peft.py. Raises RuntimeError with its output on failure."""
    _run([sys.executable, str(worker), *args], timeout, f"{worker.name} {' '.join(args)}")


def _run(cmd: list[str], timeout: int, what: str) -> None:
    """`cmd` with torchtitan 0.3.0's install on PYTHONPATH; RuntimeError with its output when it fails."""
    env = _env(str(titan_dir()))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
