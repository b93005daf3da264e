"""The results file every benchmark script can write (`--out FILE`): its rows, with the machine, the versions
and the date they were measured on, as JSON. docs/benchmarks/*.json hold the published ones; the docs site
plots them (scripts/mkdocs_hooks.py)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

VERSIONS = ("ckptconv", "torch", "safetensors", "transformers", "peft")


def write(path: Path, benchmark: str, results: Any, command: str) -> None:
    """`results` (the script's own rows) in the envelope the plots read."""
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    doc = {
        "benchmark": benchmark,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": versions,
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
