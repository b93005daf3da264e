"""Benchmark how the conversions scale with ranks where cores exist, and save_hf / load_hf on GPUs.

Made for a machine with many cores and a GPU (scripts/scaling.sh: 16 cores, 128 GiB, one GPU; it runs on
any machine at a small size: `--sizes 0.05 --ranks 1,2`):

CPU, per checkpoint size (`--sizes`, default 16 GB of fp32 weights, dense; made once in the work directory by
a 2-rank FSDP2 job, and its fp32 HF copy by `ckptconv dcp-to-hf --dtype keep --max-shard-size 2GB`, as the
convert benchmark's) and rank count (`--ranks`, default 1,2,4,8):
  dcp-to-hf Nr   `torchrun --standalone --nproc-per-node N -m ckptconv dcp-to-hf CKPT OUT --dtype bf16`
  hf-to-dcp Nr   `torchrun ... -m ckptconv hf-to-dcp HF OUT`
every rank count under torchrun (1 rank too: the same launcher, so the speedup is the work's), gloo on the
CPU, ckptconv's own fsyncs on (its default). Reported: median time, GB/s, peak RSS of the largest rank and
summed, and the speedup over 1 rank (goal: 8 ranks >= 5x one rank, peak RSS per rank flat).

GPU (skipped with a note when torch sees no CUDA device), every GPU one rank, nccl, a model of `--gpu-gb` GB
of fp32 FSDP2-style DTensors ([4096, 4096] weights sharded on dim 0):
  save  `ckptconv.save_hf` against `full_tensor()` + a rank-0 `save_torch_state_dict` (the save-hf
        benchmark's jobs, workers/save_hf_job.py; outputs checked equal)
  load  `ckptconv.load_hf` (through page-locked host memory) against `dcp.load` of the same model saved by
        `dcp.save` (workers/load_hf_job.py; the loaded values' checksums checked equal)
median time over `--runs`, the peak RSS each rank needed beyond the job's own and the GPU memory beyond the
model's.

The results file (`--out FILE`) records the machine: CPU count, memory, GPU names (`runner.machine`).
Disk: the checkpoint, its HF copy and one output at a time (48 GB at 16 GB); outputs are removed between
runs and `sync` called, outside the timed region.

usage: .venv/bin/python scripts/bench.py scaling --sizes 0.05 --ranks 1,2 --runs 1     # a smoke test
       python3 scripts/bench.py scaling --sizes 16 --ranks 1,2,4,8 --runs 2 --out scaling.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import save_hf, suite
from .checkpoints import ensure_checkpoint, ensure_hf, stem
from .methods import PY, WORKERS
from .runner import (
    GIB,
    ROOT,
    Command,
    command_line,
    dir_bytes,
    log,
    options,
    remove,
    run_interleaved,
    write_results,
)
from .runner import machine as runner_machine
from .tables import render_text

OPTIONS = options(1)
GOAL = (8, 5.0)  # 8 ranks at least 5x faster than one


def _ints(text: str) -> list[int]:
    try:
        ranks = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError("takes comma-separated rank counts >= 1")
    return ranks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=suite._sizes, default=[16.0], help="checkpoint sizes in GB (default 16)")
    p.add_argument("--ranks", type=_ints, default=[1, 2, 4, 8], help="rank counts (default 1,2,4,8)")
    p.add_argument("--gpu-gb", type=float, default=4.0, help="model size of the GPU part in GB (default 4)")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench-out", help="checkpoints, outputs, logs")


def launch(n: int, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]


def cpu_rows(args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    """dcp-to-hf and hf-to-dcp of each size at each rank count, interleaved run by run."""
    rows = []
    for size in args.sizes:
        sources = {
            "dcp-to-hf": ensure_checkpoint(args.workdir, size, "dense", env),
            "hf-to-dcp": ensure_hf(args.workdir, size, "dense", env),
        }
        commands = []
        for direction, src in sources.items():
            flags = ["--dtype", "bf16"] if direction == "dcp-to-hf" else []
            for n in args.ranks:
                key = f"{direction} {n}r"
                out = args.workdir / "scaling-out"
                argv = launch(
                    n, "-m", "ckptconv", direction, str(src), str(out), *flags, "--quiet", "--overwrite"
                )
                log_file = args.workdir / "logs" / f"scaling-{stem(size, 'dense')}-{direction}-{n}.log"
                commands.append(Command(key, key, argv, log_file, out))
        results = run_interleaved(commands, args.runs, env, f"scaling {size:g}GB")
        for direction, src in sources.items():
            nbytes = dir_bytes(src)
            one = results[f"{direction} {args.ranks[0]}r"]
            for n in args.ranks:
                r = results[f"{direction} {n}r"]
                ok = r.ok and one.ok
                rows.append(
                    {
                        "part": "cpu",
                        "direction": direction,
                        "size_gb": size,
                        "checkpoint_bytes": nbytes,
                        "ranks": n,
                        "runs": len(r.samples),
                        "median_seconds": r.seconds if r.ok else None,
                        "gb_per_s": nbytes / 1e9 / r.seconds if r.ok else None,
                        "speedup": one.seconds / r.seconds if ok else None,
                        "speedup_over_ranks": args.ranks[0],
                        "rss_rank_bytes": r.rss_rank if r.ok else None,
                        "rss_sum_bytes": r.rss_sum if r.ok else None,
                        "error": r.error,
                    }
                )
    remove(args.workdir / "scaling-out")
    return rows


def _load_job(method: str, src: Path, gb: float, nproc: int) -> list[dict[str, float]]:
    argv = launch(nproc, str(WORKERS / "load_hf_job.py"), method, str(src), str(gb), "cuda")
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode:
        sys.exit(f"load_hf_job {method} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    if method == "prepare":
        return []
    return [json.loads((src / f"{method}.rank{r}.json").read_text()) for r in range(nproc)]


def _summary(
    op: str, method: str, gb: float, nproc: int, runs: list[list[dict[str, float]]]
) -> dict[str, Any]:
    return {
        "part": "gpu",
        "op": op,
        "method": method,
        "gb": gb,
        "nproc": nproc,
        "runs": len(runs),
        "seconds": statistics.median(max(r["seconds"] for r in ranks) for ranks in runs),
        "extra_rss_rank_gib": round(max(r["extra_rss_gib"] for ranks in runs for r in ranks), 3),
        "extra_gpu_gib": round(max(r.get("extra_gpu_gib", 0.0) for ranks in runs for r in ranks), 3),
    }


def gpu_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """save_hf and load_hf against their baselines on every GPU; ([], why) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return [], "no CUDA device: the GPU part (save_hf / load_hf) was skipped"
    nproc, gb, work = torch.cuda.device_count(), args.gpu_gb, args.workdir / "scaling-gpu"
    remove(work)
    work.mkdir(parents=True)
    saves: dict[str, list[list[dict[str, float]]]] = {"ckptconv": [], "full_tensor+rank0": []}
    loads: dict[str, list[list[dict[str, float]]]] = {"ckptconv": [], "dcp.load": []}
    _load_job("prepare", work / "src", gb, nproc)
    for _ in range(args.runs):
        for method in saves:
            saves[method].append(save_hf.run(method, work / f"save-{method}", gb, nproc, "cuda"))
        for method in loads:
            loads[method].append(_load_job(method, work / "src", gb, nproc))
    equal = save_hf.same_output(work / "save-ckptconv", work / "save-full_tensor+rank0")
    sums = {m: [r["checksum"] for r in runs[-1]] for m, runs in loads.items()}
    rows = [_summary("save", m, gb, nproc, runs) for m, runs in saves.items()]
    rows += [_summary("load", m, gb, nproc, runs) for m, runs in loads.items()]
    shutil.rmtree(work, ignore_errors=True)
    same = sums["ckptconv"] == sums["dcp.load"]
    return rows, f"GPU: saved outputs equal: {equal}; loaded values' checksums equal: {same}"


def _cells(r: dict[str, Any]) -> list[str]:
    if r["error"] is not None:
        return ["FAILED", "-", "-", "-", "-"]
    speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    return [
        f"{r['median_seconds']:.2f}",
        f"{r['gb_per_s']:.2f}",
        speedup,
        f"{r['rss_rank_bytes'] / GIB:.2f}",
        f"{r['rss_sum_bytes'] / GIB:.2f}",
    ]


def main(args: argparse.Namespace) -> int:
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = suite.environment()
    where = runner_machine()
    log(f"machine: {where}")
    rows = cpu_rows(args, env)
    gpu, note = gpu_rows(args)
    columns = (("case", "<"), ("ranks", ">"), ("median s", ">"), ("GB/s", ">"), ("speedup", ">"))
    columns += (("RSS/rank GiB", ">"), ("RSS sum GiB", ">"))
    table = [[f"{r['direction']} {r['size_gb']:g}GB", str(r["ranks"]), *_cells(r)] for r in rows]
    print(f"scaling: {where['cpus']} CPUs, {where['memory_gib']} GiB, GPUs: {where.get('gpus', 'none')}")
    print(render_text(table, columns))
    n, goal = GOAL
    for r in rows:
        if r["ranks"] == n and r["speedup"] is not None:
            met = "met" if r["speedup"] >= goal else "NOT met"
            case = f"{r['direction']} {r['size_gb']:g}GB"
            print(f"{case}: {n} ranks {r['speedup']:.2f}x one rank (goal {goal:g}x: {met})")
    for r in gpu:
        extra = f"extra RSS/rank {r['extra_rss_rank_gib']:.2f} GiB, GPU {r['extra_gpu_gib']:.2f} GiB"
        print(f"GPU {r['op']:<5} {r['method']:<18} {r['seconds']:7.2f} s  {extra}")
    print(note)
    if args.out:
        write_results(args.out, "scaling", [*rows, *gpu, {"part": "note", "note": note}], command_line())
    failed = any(r["error"] for r in rows) or "False" in note
    return 1 if failed else 0
