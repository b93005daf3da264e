"""Quantized releases built by the formats' own code (tests/support/workers/modelopt_build.py): ModelOpt
NVFP4 by nvidia-modelopt 0.47.0 (installed once, pinned, with modelopt-requirements.txt into
.cache/nvidia-modelopt-0.47.0 and put on the worker's PYTHONPATH only), MXFP8 and DeepSeek-V4 by transformers'
Fp8Quantize (DeepSeek-V4's FP4 experts by ModelOpt's MXFP4QTensor). Beside each release
directory, its reference dequantization (<release>.reference-<dtype>.safetensors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from pinned import install_pinned
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "modelopt-requirements.txt"
WORKER = Path(__file__).resolve().parent / "workers" / "modelopt_build.py"
MODELOPT_DIR = ROOT / ".cache" / "nvidia-modelopt-0.47.0"


def build(*jobs: tuple[str, Path, Path]) -> None:
    """Each (kind, src, dst): release `kind` ("nvfp4", "mxfp8", "dsv4") of bf16 `src` written to `dst` (nvfp4
    also `dst`-mixed), in one worker process."""
    env = dict(os.environ, PYTHONPATH=str(install_pinned(MODELOPT_DIR, REQUIREMENTS)), OMP_NUM_THREADS="1")
    env.pop("CKPTCONV_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER), *(str(a) for job in jobs for a in job)],
        capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building {jobs} failed:\n{proc.stdout}\n{proc.stderr}")


def reference(release: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The quantized weights of `release` (a directory `build` made) as the format's reference dequantizes
    them, by logical key."""
    name = str(dtype).removeprefix("torch.")
    return load_file(release.with_name(f"{release.name}.reference-{name}.safetensors"))
