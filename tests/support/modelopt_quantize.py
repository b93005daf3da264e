"""nvidia-modelopt 0.47.0 for tests, run in a subprocess: the oracle of `dcp-to-hf --quantize nvfp4`.

`modelopt_dir()` installs the pins of modelopt-quantize-requirements.txt once, with `pip install --no-deps
--target`, into .cache/nvidia-modelopt-0.47.0-quantize under the repository (`pinned.install_pinned`), and
`modelopt_nvfp4()` runs support/workers/modelopt_nvfp4.py with that directory on PYTHONPATH in front of the
venv's own site-packages (torch and numpy come from the venv, through the same interpreter): ModelOpt's own
`NVFP4QTensor.quantize` of each weight and the `quantization_config` its HF export writes.

A failed install raises: a test that needs ModelOpt fails rather than skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from pinned import install_pinned
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "modelopt-quantize-requirements.txt"
WORKER = Path(__file__).resolve().parent / "workers" / "modelopt_nvfp4.py"
VERSION = "0.47.0"
MODELOPT_DIR = ROOT / ".cache" / f"nvidia-modelopt-{VERSION}-quantize"


def modelopt_dir() -> Path:
    """The --target directory holding nvidia-modelopt 0.47.0 and the pins: `pinned.install_pinned`, once."""
    return install_pinned(MODELOPT_DIR, REQUIREMENTS)


def modelopt_nvfp4(
    weights: dict[str, torch.Tensor], exclude: list[str], work: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """ModelOpt's NVFP4 of `weights` (key -> 2-D weight in the dtype it is quantized in): {key: packed uint8,
    key + "_scale", key + "_scale_2"} as `NVFP4QTensor.quantize(w, 16)` returns them, and the
    quantization_config ModelOpt's HF export writes for a model quantized so with `exclude` left alone."""
    work.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, work / "in.safetensors")
    (work / "exclude.json").write_text(json.dumps(exclude))
    env = {k: v for k, v in os.environ.items() if k != "CKPTCONV_DEBUG"}
    env["PYTHONPATH"] = str(modelopt_dir())
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(work)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{WORKER.name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return load_file(work / "out.safetensors"), json.loads((work / "config.json").read_text())
