"""The commands the conversion benchmarks time: each method (ckptconv, the plain PyTorch baselines, cp -r,
start-up floors) as a command line per (input, output dir, ckptconv flags), grouped by direction. The
memory benchmark's own methods are in memory.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

WORKERS = Path(__file__).resolve().parent / "workers"  # scripts run by path: the generator and the baselines
BASELINE = str(WORKERS / "baseline.py")
PY = sys.executable
NPROC = 2

Kind = Literal["io", "startup", "convert"]


def torchrun(*args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}", *args]


def two_nodes(*args: str) -> list[str]:
    """Two torchrun "nodes" of one process each on this machine, meeting through c10d on 127.0.0.1."""
    port = 29000 + os.getpid() % 1000
    one = " ".join(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "bench",
            "--rdzv-conf",
            "is_host={host}",
            *args,
        ]
    )
    both = f"{one.format(host=1)} & a=$!; {one.format(host=0)} & b=$!; wait $a; x=$?; wait $b; exit $((x|$?))"
    return ["bash", "-c", both]


# the read limit: every file of the source read once, as fast as `cat` reads it (hidden `.metadata` included)
READ_ALL = 'find "$1" -type f -exec cat {} + > /dev/null'


def read_all(ckpt: Path) -> list[str]:
    return ["bash", "-c", READ_ALL, "_", str(ckpt)]


def ckptconv_args(ckpt: Path, out: Path, flags: Flags) -> list[str]:
    return ["dcp-to-hf", str(ckpt), str(out), "--dtype", "bf16", "--quiet", "--overwrite", *flags]


Flags = tuple[str, ...]  # what ckptconv needs to know about a checkpoint shape (the key mapping)
SHAPES: dict[str, Flags] = {"dense": (), "moe": ("--mapping", "torchtitan-qwen3")}


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    ranks: int
    kind: Kind
    argv: Callable[[Path, Path, Flags], list[str]]  # (input, output dir, ckptconv's flags) -> command line
    fsync: bool | None = None  # its output fsynced before it ends (None: writes nothing, or only in part)

    @property
    def startup_key(self) -> str:
        """The start-up row whose time is subtracted to get this method's time "beyond start-up"."""
        return "torchrun_import" if self.ranks > 1 else "import_torch"


METHODS: tuple[Method, ...] = (
    Method("cp", "cp -r", 1, "io", lambda c, o, f: ["cp", "-r", str(c), str(o)], fsync=False),
    Method("cat", "cat (read limit)", 1, "io", lambda c, o, f: read_all(c)),
    Method("import_torch", "import torch", 1, "startup", lambda c, o, f: [PY, "-c", "import torch"]),
    Method(
        "torchrun_import",
        "torchrun import torch",
        NPROC,
        "startup",
        lambda c, o, f: torchrun("--no-python", PY, "-c", "import torch"),
    ),
    Method(
        "ckptconv_1",
        "ckptconv 1 rank",
        1,
        "convert",
        lambda c, o, f: [PY, "-m", "ckptconv", *ckptconv_args(c, o, f)],
        fsync=True,
    ),
    Method(
        "ckptconv_2_direct",
        f"ckptconv {NPROC}r direct",
        NPROC,
        "convert",
        lambda c, o, f: torchrun("-m", "ckptconv", *ckptconv_args(c, o, f), "--read", "direct"),
        fsync=True,
    ),
    Method(
        "ckptconv_2_nodes",
        "ckptconv 2 nodes x 1",
        NPROC,
        "convert",
        lambda c, o, f: two_nodes("-m", "ckptconv", *ckptconv_args(c, o, f)),
        fsync=True,
    ),
    Method(
        "ckptconv_2_gather",
        f"ckptconv {NPROC}r gather",
        NPROC,
        "convert",
        lambda c, o, f: torchrun("-m", "ckptconv", *ckptconv_args(c, o, f), "--read", "gather"),
        fsync=True,
    ),
    Method(
        "format_utils",
        "format_utils+save_file",
        1,
        "convert",
        lambda c, o, f: [PY, BASELINE, "format_utils", str(c), str(o)],
        fsync=False,
    ),
    Method(
        "hf_writer",
        f"torch HF writer {NPROC}r",
        NPROC,
        "convert",
        lambda c, o, f: torchrun(BASELINE, "hf_storage_writer", str(c), str(o)),
    ),
    Method(
        "dcp_load",
        "dcp.load+save_torch_sd",
        1,
        "convert",
        lambda c, o, f: [PY, BASELINE, "dcp_load", str(c), str(o)],
        fsync=False,
    ),
    Method(
        "ckptconv_fp8",
        "ckptconv 1r --quantize fp8",
        1,
        "convert",
        lambda c, o, f: [PY, "-m", "ckptconv", *ckptconv_args(c, o, f), "--quantize", "fp8"],
        fsync=True,
    ),
    Method(
        "dcp_load_fp8",
        "dcp.load+quantize+save",
        1,
        "convert",
        lambda c, o, f: [PY, BASELINE, "dcp_load_fp8", str(c), str(o)],
        fsync=False,
    ),
)
STARTUP = tuple(m for m in METHODS if m.kind == "startup")
HF_TO_DCP_METHODS: tuple[Method, ...] = (
    Method("h_cp", "cp -r", 1, "io", lambda c, o, f: ["cp", "-r", str(c), str(o)], fsync=False),
    Method("h_cat", "cat (read limit)", 1, "io", lambda c, o, f: read_all(c)),
    *STARTUP,
    Method(
        "h_ckptconv_1",
        "ckptconv 1 rank",
        1,
        "convert",
        lambda c, o, f: [PY, "-m", "ckptconv", "hf-to-dcp", str(c), str(o), "--quiet", "--overwrite", *f],
        fsync=True,
    ),
    Method(
        "h_ckptconv_2",
        f"ckptconv {NPROC}r",
        NPROC,
        "convert",
        lambda c, o, f: torchrun("-m", "ckptconv", "hf-to-dcp", str(c), str(o), "--quiet", "--overwrite", *f),
        fsync=True,
    ),
    Method(
        "h_load_save",
        "load_file+dcp.save",
        1,
        "convert",
        lambda c, o, f: [PY, BASELINE, "load_file_dcp_save", str(c), str(o)],
        fsync=True,
    ),
)
DIRECTIONS: dict[str, tuple[Method, ...]] = {
    "dcp-to-hf": METHODS,
    "hf-to-dcp": HF_TO_DCP_METHODS,
}
REFERENCE = {
    "dcp-to-hf": ("ckptconv_1", "cp"),
    "hf-to-dcp": ("h_ckptconv_1", "h_cp"),
    "memory": ("ckptconv_1", "cp"),
}  # (ckptconv 1 rank, cp)
READ_LIMIT = {"dcp-to-hf": "cat", "hf-to-dcp": "h_cat"}  # reading the source once: `cat` of every file
BY_KEY = {m.key: m for methods in DIRECTIONS.values() for m in methods}
