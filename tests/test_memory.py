"""Peak memory (issue #14, point 9): `verify` / `--verify` hold one tensor pair (no full-size temporaries of
another dtype), and `dcp-to-hf --read gather` holds at most `--bucket-size` plus the largest tensor per rank.

Not timed: each command runs in a fresh process (under torchrun: each rank) through a wrapper that runs the
CLI and then writes its own kernel high-water mark (`ru_maxrss`) to a file; the same wrapper on a tiny
checkpoint gives the baseline (interpreter, torch, ckptconv, gloo under torchrun), measured in the same test.
The checkpoint is one 256 MiB fp32 tensor [16384, 4096] saved by 2 ranks (two 128 MiB chunks in two files),
released as bf16 (128 MiB): verify compares a 384 MiB pair, casting fp32 to bf16.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import _env, torchrun

pytestmark = pytest.mark.slow  # a 256 MiB checkpoint, torchrun jobs

MIB = 2**20
ROWS, COLS = 16384, 4096  # fp32: 256 MiB, two 128 MiB chunks; bf16: 128 MiB
SOURCE_BYTES, OUTPUT_BYTES = ROWS * COLS * 4, ROWS * COLS * 2

WRAPPER = """
import os, resource, sys
from ckptconv.cli import main
report = sys.argv.pop(1)
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
with open(f"{report}.{os.environ.get('RANK', '0')}", "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""

MAKER = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
seed = torch.Generator().manual_seed(dist.get_rank())
local = torch.randn(int(sys.argv[2]) // 2, int(sys.argv[3]), generator=seed)
big = DTensor.from_local(local, mesh, [Shard(0)])
dcp.save({"big": big, "small": torch.ones(8, 8)}, checkpoint_id=sys.argv[1])
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 2-rank 256 MiB checkpoint, its bf16 release, a tiny checkpoint, and the wrapper script."""
    root = tmp_path_factory.mktemp("memory")
    (root / "maxrss.py").write_text(WRAPPER)
    (root / "make.py").write_text(MAKER)
    torchrun(2, str(root / "make.py"), str(root / "big"), str(ROWS), str(COLS))
    dcp.save({"t": torch.ones(4, 4)}, checkpoint_id=str(root / "tiny"), no_dist=True)
    paths = {"root": root, "big": root / "big", "tiny": root / "tiny", "hf": root / "hf"}
    peak(paths, "dcp-to-hf", str(paths["big"]), str(paths["hf"]), "--quiet")
    return paths


def peak(paths: dict[str, Path], *args: str, nproc: int = 0) -> list[int]:
    """Run `ckptconv ARGS` (under torchrun with `nproc` ranks) through the wrapper; each rank's peak RSS."""
    report = paths["root"] / "rss"
    for old in paths["root"].glob("rss.*"):
        old.unlink()
    wrapper = str(paths["root"] / "maxrss.py")
    if nproc:
        proc = torchrun(nproc, wrapper, str(report), *args, check=False)
    else:
        cmd = [sys.executable, wrapper, str(report), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return [int((paths["root"] / f"rss.{rank}").read_text()) for rank in range(max(nproc, 1))]


def test_verify_holds_one_tensor_pair(ckpts: dict[str, Path]) -> None:
    """verify (exact, fp32 A cast to bf16 B; and with a tolerance) and dcp-to-hf --verify: peak RSS beyond the
    baseline <= 1.5x the pair (576 MiB). Measured on the 2-core dev VM, beyond a 301 MiB baseline: before
    this fix 1047 MiB exact, 1751 MiB with --atol, 1047 MiB for dcp-to-hf --verify (2.7x, 4.6x, 2.7x the
    pair: fp32 / bf16 / mask temporaries of the whole tensor); after it 355, 371 and 353 MiB (<= 0.97x)."""
    (base,) = peak(ckpts, "verify", str(ckpts["tiny"]), str(ckpts["tiny"]))
    pair = SOURCE_BYTES + OUTPUT_BYTES
    big, hf = str(ckpts["big"]), str(ckpts["hf"])
    runs = {
        "verify": peak(ckpts, "verify", big, hf)[0],
        "verify --atol": peak(ckpts, "verify", big, hf, "--atol", "1e-2")[0],
        "dcp-to-hf --verify": peak(ckpts, "dcp-to-hf", big, str(ckpts["root"] / "v"), "--quiet", "--verify")[
            0
        ],
    }
    extra = {name: (rss - base) / MIB for name, rss in runs.items()}
    assert all(x <= 1.5 * pair / MIB for x in extra.values()), (extra, base / MIB, pair / MIB)


def test_gather_holds_a_bucket_and_the_largest_tensor(ckpts: dict[str, Path]) -> None:
    """dcp-to-hf --read gather on 2 ranks, --bucket-size 32MB: each rank's peak RSS beyond the 2-rank
    baseline <= bucket + the largest tensor's source bytes (288 MiB). Rank 0 writes the file and receives
    rank 1's chunk. Measured on the 2-core dev VM, beyond a 261 MiB baseline: before this fix rank 0 639 MiB
    (its chunk, the received one, a full fp32 copy and the bf16 output), rank 1 129 MiB; after it 175 MiB
    (the 128 MiB bf16 output + one 32 MiB step) and 33 MiB."""
    bases = peak(ckpts, "verify", str(ckpts["tiny"]), str(ckpts["tiny"]), nproc=2)
    out = str(ckpts["root"] / "g")
    bucket = 32 * MIB
    peaks = peak(
        ckpts, "dcp-to-hf", str(ckpts["big"]), out, "--read", "gather", "--bucket-size", str(bucket), nproc=2
    )
    extra = [(p - b) / MIB for p, b in zip(peaks, bases, strict=True)]
    assert max(extra) <= (bucket + SOURCE_BYTES) / MIB, (extra, [b / MIB for b in bases])
    assert (Path(out) / "model.safetensors").read_bytes() == (ckpts["hf"] / "model.safetensors").read_bytes()
