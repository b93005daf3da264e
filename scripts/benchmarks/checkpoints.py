"""The checkpoints the conversion benchmarks read, made once into the work directory and reused by later
invocations: the fp32 DCP checkpoint (written by a real FSDP2 job, workers/make_dcp.py), the fp32 HF directory
made of it for hf-to-dcp, and the bf16 release the memory benchmark verifies against."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .methods import NPROC, PY, SHAPES, WORKERS, torchrun
from .runner import dir_bytes, log, remove, run_measured


def size_label(size_gb: float) -> str:
    return f"{size_gb:g}GB"


def stem(size_gb: float, shape: str) -> str:
    """File name part of a checkpoint: `4GB` (dense, as before shapes existed), `moe-4GB`."""
    return size_label(size_gb) if shape == "dense" else f"{shape}-{size_label(size_gb)}"


def ensure_checkpoint(workdir: Path, size_gb: float, shape: str, env: dict[str, str]) -> Path:
    ckpt = workdir / f"dcp-{stem(size_gb, shape)}"
    if (ckpt / ".metadata").is_file():
        log(f"reusing {ckpt} ({dir_bytes(ckpt) / 1e9:.2f} GB)")
        return ckpt
    remove(ckpt)
    log(f"generating {ckpt} with FSDP2 on {NPROC} ranks ...")
    argv = torchrun(str(WORKERS / "make_dcp.py"), str(ckpt), str(size_gb), shape)
    sample = run_measured(argv, workdir / "logs" / f"make-{stem(size_gb, shape)}.log", env)
    log(f"generated {ckpt}: {dir_bytes(ckpt) / 1e9:.2f} GB in {sample.seconds:.1f}s")
    return ckpt


def ensure_hf(workdir: Path, size_gb: float, shape: str, env: dict[str, str]) -> Path:
    """An fp32 HF safetensors directory (shards and an index) made from the DCP checkpoint by ckptconv."""
    hf = workdir / f"hf-{stem(size_gb, shape)}"
    if (hf / "model.safetensors.index.json").is_file() or (hf / "model.safetensors").is_file():
        log(f"reusing {hf} ({dir_bytes(hf) / 1e9:.2f} GB in {len(safetensors_files(hf))} file(s))")
        return hf  # complete: it only gets this name by the rename below
    ckpt = ensure_checkpoint(workdir, size_gb, shape, env)
    tmp = hf.with_name(hf.name + ".partial")
    log(f"generating {hf} from {ckpt} with ckptconv dcp-to-hf --dtype keep --max-shard-size 2GB ...")
    remove(tmp)
    argv = [
        PY,
        "-m",
        "ckptconv",
        "dcp-to-hf",
        str(ckpt),
        str(tmp),
        "--dtype",
        "keep",
        "--max-shard-size",
        "2GB",
        "--quiet",
        *SHAPES[shape],
    ]
    sample = run_measured(argv, workdir / "logs" / f"make-hf-{stem(size_gb, shape)}.log", env)
    shape_json = ckpt.with_name(ckpt.name + ".shape.json")
    if shape_json.is_file():
        shutil.copy(shape_json, hf.with_name(hf.name + ".shape.json"))
    tmp.rename(hf)
    log(
        f"generated {hf}: {dir_bytes(hf) / 1e9:.2f} GB in {len(safetensors_files(hf))} file(s), "
        f"{sample.seconds:.1f}s"
    )
    return hf


def release_of(ckpt: Path) -> Path:
    """Where the bf16 release of DCP checkpoint `ckpt` (named dcp-STEM) is kept."""
    return ckpt.with_name("release-" + ckpt.name.removeprefix("dcp-"))


def ensure_release(ckpt: Path, flags: Sequence[str], env: dict[str, str]) -> Path:
    """The bf16 HF release of `ckpt`, made once by `ckptconv dcp-to-hf` (with the shape's mapping flags)."""
    release = release_of(ckpt)
    if (release / "model.safetensors.index.json").is_file() or (release / "model.safetensors").is_file():
        return release
    tmp = release.with_name(release.name + ".partial")
    argv = [sys.executable, "-m", "ckptconv", "dcp-to-hf", str(ckpt), str(tmp), "--quiet", "--overwrite"]
    subprocess.run([*argv, *flags], check=True, env=env, stdin=subprocess.DEVNULL)
    tmp.rename(release)
    return release


def largest_tensor_bytes(ckpt: Path, env: dict[str, str]) -> int:
    """The largest stored tensor of a DCP checkpoint, in bytes (from `ckptconv inspect --json`)."""
    argv = [sys.executable, "-m", "ckptconv", "inspect", str(ckpt), "--json"]
    doc: dict[str, Any] = json.loads(subprocess.run(argv, check=True, env=env, capture_output=True).stdout)
    return max(t["nbytes"] for t in doc["tensors"])


def safetensors_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def describe_files(ckpt: Path) -> str:
    """How the checkpoint is laid out on disk: DCP files, or safetensors shards (and an index)."""
    if (ckpt / ".metadata").is_file():
        return f"{len(list(ckpt.glob('*.distcp')))} .distcp file(s)"
    n = len(safetensors_files(ckpt))
    index = " + index" if (ckpt / "model.safetensors.index.json").is_file() else ", no index"
    return f"{n} safetensors file(s){index}"


def checkpoint_shape(ckpt: Path) -> dict[str, Any]:
    path = ckpt.with_name(ckpt.name + ".shape.json")
    return json.loads(path.read_text()) if path.is_file() else {}


def describe_shape(shape: dict[str, Any]) -> str:
    try:
        return (
            f"hidden {shape['hidden']}, ffn {shape['ffn']}, vocab {shape['vocab']}, "
            f"{shape['layers']} layers, {shape['heads']} heads / {shape['kv_heads']} kv heads, "
            + (f"{shape['experts']} experts of ffn {shape['ffn']} stacked, " if shape.get("experts") else "")
            + f"{shape['params'] / 1e6:.1f}M fp32 params"
        )
    except KeyError:
        return "shape unknown"
