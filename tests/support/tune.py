"""torchtune 0.6.1 for tests, run in a subprocess (as tests/support/titan.py runs torchtitan).

torchtune cannot live in the main venv (its dependencies pull datasets, pyarrow, torchao and more), so
`run_script()` installs the pins of tests/support/tune-requirements.txt once, with `pip install --no-deps
--target`, into .cache/torchtune-0.6.1 under the repository, and runs a worker (such as
tests/support/workers/tune_lora.py) with that directory on PYTHONPATH in front of the venv's own site-packages
(torch, safetensors and huggingface_hub come from the venv). A failed install raises: a test that needs
torchtune fails rather than skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pinned import install_pinned

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "tune-requirements.txt"
TUNE_DIR = ROOT / ".cache" / "torchtune-0.6.1"


def run_script(worker: Path, *args: str, timeout: int = 300) -> None:
    """`python WORKER ARGS...` with torchtune's install on PYTHONPATH; RuntimeError with its output when it
    fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(install_pinned(TUNE_DIR, REQUIREMENTS))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(worker), *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
