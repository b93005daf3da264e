"""megatron-bridge 0.3.1 for tests: the oracle of Megatron's gated delta-net, gated attention and MoE layouts.

`bridge_dir()` installs the pins of bridge-requirements.txt once, with `pip install --no-deps --target`, into
.cache/megatron-bridge-0.3.1 under the repository (as tests/support/megatron.py installs megatron-core);
`megatron_tensors()` runs support/workers/gdn_megatron.py in a subprocess with that directory and
megatron-core 0.16.1's in front of the venv's site-packages, and returns the Megatron tensors Bridge's own
mapping functions give for a tiny HF model. A subprocess, because tests/support/megatron.py shadows the
`megatron` package inside pytest (docs/notes/megatron-torch-dist.md).

A failed install raises: a test that needs megatron-bridge fails rather than skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from megatron import megatron_dir
from pinned import install_pinned

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).resolve().parent / "bridge-requirements.txt"
WORKER = Path(__file__).resolve().parent / "workers" / "gdn_megatron.py"
VERSION = "0.3.1"
BRIDGE_DIR = ROOT / ".cache" / f"megatron-bridge-{VERSION}"


def bridge_dir() -> Path:
    """The --target directory holding megatron-bridge 0.3.1: `pinned.install_pinned`, once."""
    return install_pinned(BRIDGE_DIR, REQUIREMENTS)


def megatron_tensors(hf_dir: Path, family: str, tps: tuple[int, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """{"split": torch_dist's keys, "fused{TP}": fsdp_dtensor's keys at each TP size} of the HF model in
    `hf_dir` (see the worker). Raises RuntimeError with the worker's output when it fails."""
    root = bridge_dir()
    env = {k: v for k, v in os.environ.items() if k != "CKPTCONV_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(megatron_dir())])
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="ckptconv-bridge-") as tmp:
        out = Path(tmp) / "megatron.pt"
        cmd = [sys.executable, str(WORKER), str(root), str(hf_dir), str(out), family, *map(str, tps)]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=300, stdin=subprocess.DEVNULL
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        result: Any = torch.load(out, weights_only=True)
    return result
