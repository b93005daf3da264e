"""Benchmark `ckptconv.save_hf` inside a (simulated) training job against the usual recipe.

Each method runs in its own `torchrun --standalone --nproc-per-node N` job (gloo, CPU) holding the same
FSDP2-style model: L layers of two [4096, 4096] fp32 weights as DTensors sharded on dim 0 (about GB of fp32),
each rank filling only its own shards. Timed on every rank from a barrier to a barrier:

  ckptconv.save_hf     save_hf(sd, OUT, dtype="bf16", bucket_size="256MB")
  full_tensor+rank0    the recipe of trainers without a sharded HF writer: every rank calls `full_tensor()`
                       tensor by tensor, rank 0 keeps them (cast to bf16) and writes them with
                       huggingface_hub's `save_torch_state_dict`: the whole model ends up in one process

Reported per method: wall time (median of --runs), and each rank's peak RSS beyond what it held before the
save (ru_maxrss after minus before: the memory the save itself needed). Both outputs are checked equal.

usage: .venv/bin/python scripts/bench_save_hf.py [--gb 1] [--nproc 2] [--runs 3] [--workdir bench-out]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = 4096


def worker(method: str, out: Path, gb: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    layers = max(1, round(gb * 1e9 / (2 * ROWS * ROWS * 4)))
    rows = ROWS // world
    g = torch.Generator().manual_seed(rank)
    sd = {}
    for i in range(layers):
        for name in ("q_proj", "o_proj"):
            local = torch.empty(rows, ROWS).uniform_(-0.05, 0.05, generator=g)
            sd[f"model.layers.{i}.{name}.weight"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False
            )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.barrier()
    start = time.perf_counter()
    if method == "ckptconv":
        from ckptconv.live import save_hf

        save_hf(sd, out, dtype="bf16", fp32=(), bucket_size="256MB")
    else:
        from huggingface_hub import save_torch_state_dict

        full = {}
        for key, value in sd.items():
            whole = value.full_tensor()
            if rank == 0:
                full[key] = whole.to(torch.bfloat16)
            del whole
        if rank == 0:
            out.mkdir(parents=True)
            save_torch_state_dict(full, out)
    dist.barrier()
    seconds = time.perf_counter() - start
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    doc = {"rank": rank, "seconds": seconds, "extra_rss_gib": extra}
    out.with_name(f"{out.name}.rank{rank}.json").write_text(json.dumps(doc))
    os._exit(0)


def run(method: str, out: Path, gb: float, nproc: int) -> list[dict[str, float]]:
    shutil.rmtree(out, ignore_errors=True)
    for stale in out.parent.glob(f"{out.name}.rank*.json"):
        stale.unlink()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv += [__file__, "--worker", method, str(out), str(gb)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode:
        sys.exit(f"{method} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    rows = [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text()) for r in range(nproc)]
    subprocess.run(["sync"], check=False)
    return rows


def same_output(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    def load(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    x, y = load(a), load(b)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="fp32 model size in GB (default 1)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the training job (default 2)")
    p.add_argument("--runs", type=int, default=3, help="runs per method; the median time is reported")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench-out", help="where outputs go")
    args = p.parse_args()
    results: dict[str, list[list[dict[str, float]]]] = {"ckptconv": [], "full_tensor+rank0": []}
    for _ in range(args.runs):
        for method in results:  # interleaved run by run
            results[method].append(run(method, args.workdir / f"save-hf-{method}", args.gb, args.nproc))
    print(f"save_hf: {args.gb:g} GB fp32 FSDP2 (Shard(0)) on {args.nproc} ranks -> bf16, {args.runs} runs")
    print(f"{'method':<20} {'seconds':>8} {'extra RSS/rank GiB (max)':>26} {'rank 0':>8}")
    summary = {}
    for method, runs in results.items():
        seconds = statistics.median(max(r["seconds"] for r in ranks) for ranks in runs)
        extra = max(r["extra_rss_gib"] for ranks in runs for r in ranks)
        rank0 = max(ranks[0]["extra_rss_gib"] for ranks in runs)
        summary[method] = (seconds, extra)
        print(f"{method:<20} {seconds:>8.2f} {extra:>26.2f} {rank0:>8.2f}")
    (c_s, c_m), (b_s, b_m) = summary["ckptconv"], summary["full_tensor+rank0"]
    print(
        f"ckptconv.save_hf is {b_s / c_s:.1f}x faster and needs {b_m / max(c_m, 1e-3):.1f}x less extra memory"
    )
    equal = same_output(args.workdir / "save-hf-ckptconv", args.workdir / "save-hf-full_tensor+rank0")
    print(f"outputs equal tensor for tensor: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
