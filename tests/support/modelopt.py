"""Quantized releases built by the formats' own code (tests/support/workers/modelopt_build.py): ModelOpt
NVFP4 by nvidia-modelopt 0.47.0 (installed once, pinned, with modelopt-requirements.txt into
.cache/nvidia-modelopt-0.47.0 and put on the worker's PYTHONPATH only), MXFP8 and DeepSeek-V4 by transformers'
Fp8Quantize (DeepSeek-V4's FP4 experts by ModelOpt's MXFP4QTensor). Beside each release
directory, its reference dequantization (<release>.reference-<dtype>.safetensors).
`modelopt_nvfp4`: ModelOpt's own NVFP4 of given weights and the quantization_config its HF export writes
(workers/modelopt_nvfp4.py), the oracle of `dcp-to-hf --quantize nvfp4`. A failed install raises: a test that
needs ModelOpt fails, never skips."""

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
REQUIREMENTS = Path(__file__).resolve().parent / "modelopt-requirements.txt"
WORKER = Path(__file__).resolve().parent / "workers" / "modelopt_build.py"
QUANTIZE_WORKER = Path(__file__).resolve().parent / "workers" / "modelopt_nvfp4.py"
MODELOPT_DIR = ROOT / ".cache" / "nvidia-modelopt-0.47.0"


def build(*jobs: tuple[str, Path, Path]) -> None:
    """Each (kind, src, dst): release `kind` ("nvfp4", "mxfp8", "dsv4") of bf16 `src` written to `dst` (nvfp4
    also `dst`-mixed), in one worker process."""
    env = dict(os.environ, PYTHONPATH=str(install_pinned(MODELOPT_DIR, REQUIREMENTS)), OMP_NUM_THREADS="1")
    env.pop("CKPTCONV_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER), *(str(a) for job in jobs for a in job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building {jobs} failed:\n{proc.stdout}\n{proc.stderr}")


def reference(release: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The quantized weights of `release` (a directory `build` made) as the format's reference dequantizes
    them, by logical key."""
    name = str(dtype).removeprefix("torch.")
    return load_file(release.with_name(f"{release.name}.reference-{name}.safetensors"))


def modelopt_nvfp4(
    weights: dict[str, torch.Tensor], exclude: list[str], work: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """ModelOpt's NVFP4 of `weights` (key -> 2-D weight in the dtype it is quantized in): {key: packed uint8,
    key + "_scale", key + "_scale_2"} as `NVFP4QTensor.quantize(w, 16)` returns them, key + "_dequantized" as
    `NVFP4QTensor.dequantize` reads them back in w's dtype,, and the
    quantization_config ModelOpt's HF export writes for a model quantized so with `exclude` left alone."""
    work.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, work / "in.safetensors")
    (work / "exclude.json").write_text(json.dumps(exclude))
    env = {k: v for k, v in os.environ.items() if k != "CKPTCONV_DEBUG"}
    env["PYTHONPATH"] = str(install_pinned(MODELOPT_DIR, REQUIREMENTS))
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, str(QUANTIZE_WORKER), str(work)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        name = QUANTIZE_WORKER.name
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return load_file(work / "out.safetensors"), json.loads((work / "config.json").read_text())
