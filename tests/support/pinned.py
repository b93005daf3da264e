"""A pinned `pip install --no-deps --target` for test-only projects that cannot live in the main venv
(torchtitan: tests/support/titan.py; megatron-core: tests/support/megatron.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def install_pinned(target: Path, requirements: Path) -> Path:
    """`target` holding exactly the pins of `requirements`, installed on first use (once per machine: a lock
    file serialises concurrent test processes). pip installs into a temporary sibling that is renamed into
    place only after it succeeded, with a copy of the requirements as the completion marker, so a killed
    install never leaves a half directory; one with other pins is replaced. Raises, never skips."""
    marker = target / requirements.name

    def complete() -> bool:
        return marker.is_file() and marker.read_text() == requirements.read_text()

    if complete():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent))
        try:
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input"]
            cmd += ["--target", str(tmp), "-r", str(requirements)]
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=1800, stdin=subprocess.DEVNULL
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
                )
            shutil.copyfile(requirements, tmp / requirements.name)
            if target.exists():  # other pins, or left by hand: set aside, then removed
                target.rename(tmp.with_suffix(".old"))
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(tmp.with_suffix(".old"), ignore_errors=True)
    return target
