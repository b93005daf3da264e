"""DeepSpeed 0.19.8 for tests, run under torchrun in a subprocess (CPU: DS_ACCELERATOR=cpu, gloo).

`deepspeed_dir()` installs the pins of deepspeed-requirements.txt once, with `pip install --no-deps --target`
(DS_BUILD_OPS=0: no compiled ops), into .cache/deepspeed-0.19.8 under the repository; `trained()` runs
support/workers/deepspeed_train.py under torchrun with that directory on PYTHONPATH: DeepSpeed itself trains
a tiny transformers Llama one step under each ZeRO stage asked for and saves it with `engine.save_checkpoint`,
and its own `zero_to_fp32` writes the expected fp32 weights beside. ckptconv never imports DeepSpeed.

A failed install raises: a test that needs DeepSpeed fails rather than skips.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pinned import install_pinned

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "deepspeed-requirements.txt"
WORKER = Path(__file__).resolve().parent / "workers" / "deepspeed_train.py"
VERSION = "0.19.8"
DEEPSPEED_DIR = ROOT / ".cache" / f"deepspeed-{VERSION}"


def deepspeed_dir() -> Path:
    """The --target directory holding DeepSpeed 0.19.8 and its pinned dependencies: `pinned.install_pinned`
    (DeepSpeed's setup.py reads DS_BUILD_OPS from the environment), once."""
    before = os.environ.get("DS_BUILD_OPS")
    os.environ["DS_BUILD_OPS"] = "0"
    try:
        return install_pinned(DEEPSPEED_DIR, REQUIREMENTS)
    finally:
        if before is None:
            del os.environ["DS_BUILD_OPS"]
        else:
            os.environ["DS_BUILD_OPS"] = before


def run_deepspeed(nproc: int, out: Path, *specs: str, timeout: int = 300) -> None:
    """`torchrun --nproc-per-node NPROC deepspeed_train.py OUT SPEC...` with DeepSpeed on PYTHONPATH; raises
    RuntimeError with the job's output when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CKPTCONV_DEBUG")}
    env.update(PYTHONPATH=str(deepspeed_dir()), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(WORKER), str(out), *specs]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def trained(*specs: str) -> Path:
    """A directory holding SPEC/{ckpt,fp32.pt,module.pt,config} for each SPEC (`1`, `3_tied_frozen`; see the
    worker), made by one 2-rank DeepSpeed job; removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="ckptconv-deepspeed-"))
    atexit.register(shutil.rmtree, root, True)
    run_deepspeed(2, root, *specs)
    return root
