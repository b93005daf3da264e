"""Benchmark `ckptconv dcp-to-hf` and `hf-to-dcp` against `cp -r` and plain PyTorch recipes.

What it measures, per checkpoint size (default ~1 GB and ~4 GB of fp32 weights) and shape (`--shapes`,
default both): `dense`, a Llama/Qwen-like decoder under HF names, and `moe`, a torchtitan Qwen3-MoE-like
decoder (32 routed experts per layer stacked as [E, F, D] tensors under torchtitan's names) that ckptconv
converts with `--mapping torchtitan-qwen3` (one HF tensor per expert) and the baselines by splitting the
stacked tensors themselves (see scripts/_bench_baseline.py):

  cp -r                    copying the checkpoint directory: the I/O floor
  import torch             `python -c "import torch"`: interpreter + torch start-up, paid by any Python method
  torchrun import torch    the same under `torchrun --nproc-per-node 2`: the start-up floor of 2-rank runs
  ckptconv 1 rank          `python -m ckptconv dcp-to-hf CKPT OUT --dtype bf16 --quiet --overwrite`
  ckptconv 2r direct       the same under `torchrun --standalone --nproc-per-node 2`, `--read direct`
  ckptconv 2 nodes x 1     the 1-rank command under two `torchrun --nnodes 2 --nproc-per-node 1` at once,
                           meeting through the c10d rendezvous on 127.0.0.1 (two "nodes" of this machine)
  ckptconv 2r gather       ... with `--read gather`
  format_utils+save_file   torch's `dcp_to_torch_save` to a .pt, `torch.load`, cast to bf16, `save_file`
  torch HF writer 2r       torchrun: `dcp.load` into Shard(0) DTensors, cast to bf16, `dcp.save` with torch's
                           HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)
  dcp.load+save_torch_sd   `dcp.load(no_dist=True)` into tensors preallocated from the metadata, cast to bf16,
                           `huggingface_hub.save_torch_state_dict`

and for hf-to-dcp, from an fp32 HF directory made once of the same DCP checkpoint by
`ckptconv dcp-to-hf --dtype keep --max-shard-size 2GB` (cached as WORKDIR/hf-SIZE):

  cp -r                    copying the HF directory
  import torch, torchrun import torch   as above
  ckptconv 1 rank          `python -m ckptconv hf-to-dcp HF OUT --quiet --overwrite`
  ckptconv 2r              the same under `torchrun --standalone --nproc-per-node 2`
  load_file+dcp.save       `safetensors.torch.load_file` of every shard into one state dict, then
                           `dcp.save(sd, no_dist=True)`

`--direction` picks dcp-to-hf, hf-to-dcp or both (the default), `memory` (peak RSS per rank of `verify`,
`dcp-to-hf --verify` and `--read gather` against the largest tensor and the bucket: scripts/_bench_memory.py)
or `all`; each direction gets its own section (table and headlines) in the printed output and in bench.md.

Every command runs `--runs` times (methods interleaved run by run) as a fresh subprocess of this interpreter
(`sys.executable`); the table shows the median wall time, and the peak RSS over the runs, sampled every 20 ms
over the whole process tree with psutil: "RSS/rank" is the largest single worker process (the leaves of the
tree, so the torchrun agent is left out), "RSS sum" the largest sum over all processes of the tree (agent
included).
RSS counts the pages a process has touched, including file pages it maps. The exact kernel high-water mark of
the largest process (`wait4` ru_maxrss, agent included) is kept in bench.json.

The checkpoints are written once by a real FSDP2 job (2 ranks, gloo, CPU; scripts/_bench_make_dcp.py) into the
work directory and reused by later invocations. The page cache is warm: the checkpoint was just written and
is read over and over, so the numbers measure the converters, not the disk. Outputs are deleted and `sync` is
called between runs, outside the timed region, so no run pays for an earlier run's write-back; nothing is
fsynced inside a run beyond what each tool does itself.

usage (from the repository root):
  .venv/bin/python scripts/bench.py                     # 1 and 4 GB, dense and moe, 3 runs: ~25 minutes
  .venv/bin/python scripts/bench.py --quick             # 0.25 GB, dense and moe, 1 run: a smoke test
  .venv/bin/python scripts/bench.py --sizes 2 --runs 5 --workdir /tmp/bench
  .venv/bin/python scripts/bench.py --direction memory --shapes dense --sizes 1,4 --runs 1
Writes WORKDIR/bench.md (the table in markdown) and WORKDIR/bench.json (every raw number); logs of the last
run of each command are in WORKDIR/logs. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _bench_memory as memory
import psutil
from _bench_memory import ensure_release, largest_tensor_bytes
from _bench_methods import (
    BY_KEY,
    DIRECTIONS,
    GIB,
    MEMORY_METHODS,
    NPROC,
    PY,
    ROOT,
    SCRIPTS,
    SHAPES,
    torchrun,
)
from _bench_report import (
    COLUMNS,
    NOTES,
    SECTION_TITLES,
    Result,
    SizeReport,
    headlines,
    render_markdown,
    render_text,
    size_label,
    table_rows,
)
from _bench_run import CommandFailed, run_measured


def log(msg: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def stem(size_gb: float, shape: str) -> str:
    """File name part of a checkpoint: `4GB` (dense, as before shapes existed), `moe-4GB`."""
    return size_label(size_gb) if shape == "dense" else f"{shape}-{size_label(size_gb)}"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ------------------------------------------------------------------------------------------------------------
# Checkpoints


def ensure_checkpoint(workdir: Path, size_gb: float, shape: str, env: dict[str, str]) -> Path:
    ckpt = workdir / f"dcp-{stem(size_gb, shape)}"
    if (ckpt / ".metadata").is_file():
        log(f"reusing {ckpt} ({dir_bytes(ckpt) / 1e9:.2f} GB)")
        return ckpt
    remove(ckpt)
    log(f"generating {ckpt} with FSDP2 on {NPROC} ranks ...")
    argv = torchrun(str(SCRIPTS / "_bench_make_dcp.py"), str(ckpt), str(size_gb), shape)
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


def environment() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_gib": round(psutil.virtual_memory().total / GIB, 1),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


# ------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", help="comma-separated checkpoint sizes in GB of fp32 weights (default 1,4)")
    p.add_argument("--runs", type=int, help="runs per method and size; the median is reported (default 3)")
    p.add_argument("--quick", action="store_true", help="a smoke test: --sizes 0.25 --runs 1 unless given")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench-out", help="checkpoints, outputs, reports")
    p.add_argument(
        "--direction",
        choices=("both", "all", *DIRECTIONS),
        default="both",
        help="both: the two conversions; memory: verify and --read gather against the largest tensor; all",
    )
    p.add_argument("--shapes", default="dense,moe", help="comma-separated: dense, moe (default both)")
    args = p.parse_args(argv)
    args.shapes = [k.strip() for k in args.shapes.split(",") if k.strip()]
    if not args.shapes or any(k not in SHAPES for k in args.shapes):
        p.error(f"--shapes takes a comma-separated list of {', '.join(SHAPES)}")
    both = ["dcp-to-hf", "hf-to-dcp"]
    args.directions = {"both": both, "all": list(DIRECTIONS)}.get(args.direction, [args.direction])
    args.sizes = [float(s) for s in (args.sizes or ("0.25" if args.quick else "1,4")).split(",") if s.strip()]
    args.runs = args.runs or (1 if args.quick else 3)
    if args.runs < 1 or not args.sizes or min(args.sizes) <= 0:
        p.error("--runs must be >= 1 and --sizes positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir: Path = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("CKPTCONV_DEBUG", None)
    out = workdir / "out"
    logs = workdir / "logs"

    load_start = os.getloadavg()[0]
    reports: list[SizeReport] = []
    for direction in args.directions:
        for kind, size_gb in [(k, s) for k in args.shapes for s in args.sizes]:
            make = ensure_hf if direction == "hf-to-dcp" else ensure_checkpoint
            ckpt = make(workdir, size_gb, kind, env)
            nbytes = dir_bytes(ckpt)
            methods = DIRECTIONS[direction]
            results = {m.key: Result(size_gb, kind, m.key) for m in methods}
            rep = SizeReport(size_gb, ckpt, nbytes, checkpoint_shape(ckpt), results, direction, kind)
            if direction == "memory":
                log(f"memory {rep.label}: the bf16 release {ensure_release(ckpt, SHAPES[kind], env)}")
                rep.largest = largest_tensor_bytes(ckpt, env)
            for run in range(1, args.runs + 1):
                for m in methods:
                    r = rep.results[m.key]
                    if r.error is not None:
                        continue
                    dest = out / m.key
                    remove(dest)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    os.sync()
                    tag = f"{direction} {rep.label}"
                    try:
                        s = run_measured(
                            m.argv(ckpt, dest, SHAPES[kind]),
                            logs / f"{direction}-{stem(size_gb, kind)}-{m.key}.log",
                            env,
                        )
                    except CommandFailed as e:
                        r.error = str(e)
                        log(f"{tag} run {run}/{args.runs} {m.label}: FAILED {e}")
                        continue
                    finally:
                        remove(dest)
                    r.samples.append(s)
                    log(
                        f"{tag} run {run}/{args.runs} {m.label:<24} {s.seconds:7.2f} s  "
                        f"RSS/rank {s.rss_rank / GIB:5.2f} GiB  sum {s.rss_sum / GIB:5.2f} GiB"
                    )
            reports.append(rep)
    remove(out)
    load_end = os.getloadavg()[0]
    load = (
        f"1-minute load average {load_start:.2f} at start, {load_end:.2f} at end "
        f"({os.cpu_count()} CPUs; other jobs on the machine skew the timings)"
    )

    title = (
        f"ckptconv benchmark: {args.runs} run(s) per method, sizes {', '.join(map(size_label, args.sizes))}, "
        f"shapes {', '.join(args.shapes)}"
    )
    sections = []  # (direction, section title, table rows, headlines)
    for direction in args.directions:
        mine = [r for r in reports if r.direction == direction]
        if direction == "memory":
            labels = {m.key: m.label for m in MEMORY_METHODS}
            rows, heads = memory.table_rows(mine), memory.headlines(mine, labels)
            sections.append((direction, SECTION_TITLES[direction], rows, heads, memory.COLUMNS))
            continue
        sections.append((direction, SECTION_TITLES[direction], table_rows(mine), headlines(mine), COLUMNS))
    shapes = [
        f"{r.direction} {r.label}: {r.ckpt.name}, {r.ckpt_bytes / 1e9:.2f} GB in "
        f"{describe_files(r.ckpt)}, {describe_shape(r.shape)}"
        for r in reports
    ]
    print(title)
    for _, section_title, rows, heads, columns in sections:
        print(f"\n== {section_title} ==\n")
        print(render_text(rows, columns))
        print()
        print("\n".join(heads))
    print()
    print(NOTES)
    print(load)
    print("checkpoints:\n" + "".join(f"  {s}\n" for s in shapes), end="")

    (workdir / "bench.md").write_text(
        f"# {title}\n\n"
        + "".join(
            f"## {section_title}\n\n{render_markdown(rows, columns)}\n\n"
            + "".join(f"- {h}\n" for h in heads)
            + "\n"
            for _, section_title, rows, heads, columns in sections
        )
        + f"{NOTES}\n\n{load}.\n\nCheckpoints:\n\n"
        + "".join(f"- {s}\n" for s in shapes)
    )
    doc = {
        "runs": args.runs,
        "directions": args.directions,
        "environment": environment(),
        "headlines": {direction: heads for direction, _, _, heads, _ in sections},
        "loadavg_1min": {"start": load_start, "end": load_end},
        "commands": {m.key: m.argv(Path("SRC"), Path("OUT"), ()) for m in BY_KEY.values()},
        "ckptconv_flags_by_shape": SHAPES,
        "sizes": [
            {
                "direction": r.direction,
                "size_gb": r.size_gb,
                "shape_kind": r.kind,
                "checkpoint": str(r.ckpt),
                "checkpoint_bytes": r.ckpt_bytes,
                "checkpoint_files": describe_files(r.ckpt),
                "shape": r.shape,
                "largest_tensor_bytes": r.largest,
                "methods": {
                    k: {
                        "label": BY_KEY[k].label,
                        "ranks": BY_KEY[k].ranks,
                        "error": res.error,
                        "median_seconds": res.seconds if res.ok else None,
                        "vs_ckptconv_1": r.vs_ckptconv(k),
                        "beyond_startup_over_cp": r.beyond_startup_over_cp(k),
                        "runs": [asdict(s) for s in res.samples],
                    }
                    for k, res in r.results.items()
                },
            }
            for r in reports
        ],
    }
    (workdir / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    log(f"wrote {workdir / 'bench.md'} and {workdir / 'bench.json'}")

    failed = [(rep, r) for rep in reports for r in rep.results.values() if r.error is not None]
    for rep, r in failed:
        sys.stderr.write(f"FAILED {rep.direction} {rep.label} {BY_KEY[r.method].label}: {r.error}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
