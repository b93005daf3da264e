"""Benchmark `ckptconv.save_hf` inside a (simulated) training job against the usual recipe.

Each method runs in its own `torchrun --standalone --nproc-per-node N` job (gloo on the CPU, or with
`--device cuda` nccl on one GPU a rank) holding the same FSDP2-style model: L layers of two [4096, 4096]
fp32 weights as DTensors sharded on dim 0 (about GB of fp32), each rank filling only its own shards. Timed on
every rank from a barrier to a barrier:

  ckptconv.save_hf     save_hf(sd, OUT, dtype="bf16", bucket_size="256MB")
  full_tensor+rank0    the recipe of trainers without a sharded HF writer: every rank calls `full_tensor()`
                       tensor by tensor, rank 0 keeps them (cast to bf16) and writes them with
                       huggingface_hub's `save_torch_state_dict`: the whole model ends up in one process

Reported per method: wall time (median of --runs), and each rank's peak RSS beyond what it held before the
save (ru_maxrss after minus before: the memory the save itself needed) and, on GPUs, the GPU memory it
allocated beyond the model's. Both outputs are checked equal.

Each job is workers/save_hf_job.py under torchrun.

usage: .venv/bin/python scripts/bench.py save-hf [--gb 1] [--nproc 2] [--device cpu|cuda] [--runs 3]
       [--workdir DIR] [--out FILE]
`--out FILE` writes the results file: per method the median seconds and the largest extra RSS per rank.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from .methods import WORKERS
from .runner import ROOT, command_line, options, write_results

OPTIONS = options(3)


def run(method: str, out: Path, gb: float, nproc: int, device: str) -> list[dict[str, float]]:
    shutil.rmtree(out, ignore_errors=True)
    for stale in out.parent.glob(f"{out.name}.rank*.json"):
        stale.unlink()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    argv += [str(WORKERS / "save_hf_job.py"), method, str(out), str(gb), device]
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gb", type=float, default=1.0, help="fp32 model size in GB (default 1)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the training job (default 2)")
    devices = ("cpu", "cuda")
    p.add_argument("--device", choices=devices, default="cpu", help="cpu (gloo; default) or cuda (nccl)")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench-out", help="where outputs go")


def main(args: argparse.Namespace) -> int:
    results: dict[str, list[list[dict[str, float]]]] = {"ckptconv": [], "full_tensor+rank0": []}
    for _ in range(args.runs):
        for method in results:  # interleaved run by run
            out = args.workdir / f"save-hf-{method}"
            results[method].append(run(method, out, args.gb, args.nproc, args.device))
    where = f"{args.nproc} ranks ({args.device})"
    print(f"save_hf: {args.gb:g} GB fp32 FSDP2 (Shard(0)) on {where} -> bf16, {args.runs} runs")
    head = f"{'method':<20} {'seconds':>8} {'extra RSS/rank GiB (max)':>26} {'rank 0':>8}"
    print(f"{head} {'extra GPU GiB':>14}")
    summary = {}
    rows = []
    for method, runs in results.items():
        seconds = statistics.median(max(r["seconds"] for r in ranks) for ranks in runs)
        extra = max(r["extra_rss_gib"] for ranks in runs for r in ranks)
        rank0 = max(ranks[0]["extra_rss_gib"] for ranks in runs)
        gpu = max(r.get("extra_gpu_gib", 0.0) for ranks in runs for r in ranks)
        summary[method] = (seconds, extra)
        print(f"{method:<20} {seconds:>8.2f} {extra:>26.2f} {rank0:>8.2f} {gpu:>14.2f}")
        rows.append(
            {
                "gb": args.gb,
                "nproc": args.nproc,
                "device": args.device,
                "method": method,
                "seconds": seconds,
                "extra_rss_rank_gib": round(extra, 3),
                "extra_rss_rank0_gib": round(rank0, 3),
                "extra_gpu_gib": round(gpu, 3),
                "runs": len(runs),
            }
        )
    (c_s, c_m), (b_s, b_m) = summary["ckptconv"], summary["full_tensor+rank0"]
    print(
        f"ckptconv.save_hf is {b_s / c_s:.1f}x faster and needs {b_m / max(c_m, 1e-3):.1f}x less extra memory"
    )
    equal = same_output(args.workdir / "save-hf-ckptconv", args.workdir / "save-hf-full_tensor+rank0")
    print(f"outputs equal tensor for tensor: {equal}")
    if args.out:
        write_results(args.out, "save-hf", rows, command_line())
    return 0 if equal else 1
