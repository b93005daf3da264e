"""Benchmark `ckptconv dcp-to-hf` and `hf-to-dcp` against `cp -r` and plain PyTorch recipes.

What it measures, per checkpoint size (default ~1 GB and ~4 GB of fp32 weights) and shape (`--shapes`,
default both): `dense`, a Llama/Qwen-like decoder under HF names, and `moe`, a torchtitan Qwen3-MoE-like
decoder (32 routed experts per layer stacked as [E, F, D] tensors under torchtitan's names) that ckptconv
converts with `--mapping torchtitan-qwen3` (one HF tensor per expert) and the baselines by splitting the
stacked tensors themselves (see workers/baseline.py):

  cp -r                    copying the checkpoint directory: the I/O floor
  cat (read limit)         `cat` of every file of the checkpoint to /dev/null: reading the source once
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
  ckptconv 1r --quantize fp8, dcp.load+quantize+save   the same export as a block-FP8 release

and for hf-to-dcp, from an fp32 HF directory made once of the same DCP checkpoint by
`ckptconv dcp-to-hf --dtype keep --max-shard-size 2GB` (cached as WORKDIR/hf-SIZE):

  cp -r                    copying the HF directory
  cat (read limit)         `cat` of every file of it to /dev/null
  import torch, torchrun import torch   as above
  ckptconv 1 rank          `python -m ckptconv hf-to-dcp HF OUT --quiet --overwrite`
  ckptconv 2r              the same under `torchrun --standalone --nproc-per-node 2`
  load_file+dcp.save       `safetensors.torch.load_file` of every shard into one state dict, then
                           `dcp.save(sd, no_dist=True)`

`--direction` picks dcp-to-hf, hf-to-dcp or both (the default); each direction gets its own section (table
and headlines) in the printed output and in bench.md. (The memory of `verify` and `--read gather` is the
`memory` benchmark.)

Every command runs `--runs` times (methods interleaved run by run) as a fresh subprocess of this interpreter
(`sys.executable`); the table shows the median wall time, and the peak RSS over the runs, sampled every 20 ms
over the whole process tree with psutil: "RSS/rank" is the largest single worker process (the leaves of the
tree, so the torchrun agent is left out), "RSS sum" the largest sum over all processes of the tree (agent
included).
RSS counts the pages a process has touched, including file pages it maps. The exact kernel high-water mark of
the largest process (`wait4` ru_maxrss, agent included) is kept in bench.json.

`--cold` drops the page cache before each run, outside the timed region (`sync; echo 3 >
/proc/sys/vm/drop_caches`: root only), so every row, `cat` and `import torch` included, reads from the
device: what a conversion of a checkpoint just copied from elsewhere, or written long ago, costs. "x read
limit" is a row's median over `cat`'s (same source, same cache state). Where the cache cannot be dropped (not
root), the rows run warm, and the report and the results file say they are NOT cold and why.

The checkpoints are written once by a real FSDP2 job (2 ranks, gloo, CPU; workers/make_dcp.py) into the
work directory and reused by later invocations. The page cache is warm: the checkpoint was just written and
is read over and over, so the numbers measure the converters, not the disk. Outputs are deleted and `sync` is
called between runs, outside the timed region, so no run pays for an earlier run's write-back; nothing is
fsynced inside a run beyond what each tool does itself: ckptconv fsyncs its output (its default since issue
#34), as `dcp.save` does (the hf-to-dcp baselines); `save_torch_state_dict`, `save_file` and `cp -r` do not.
The `durable` benchmark measures each with and without.

usage (from the repository root):
  .venv/bin/python scripts/bench.py convert                  # 1 and 4 GB, dense and moe, 3 runs: ~25 minutes
  .venv/bin/python scripts/bench.py convert --quick          # 0.25 GB, dense and moe, 1 run: a smoke test
  .venv/bin/python scripts/bench.py convert --sizes 2 --runs 5 --workdir /tmp/bench
  .venv/bin/python scripts/bench.py convert --shapes dense --sizes 0.5,1,2,4 --runs 1 --out convert.json
  .venv/bin/python scripts/bench.py convert --shapes dense --sizes 1 --out c.json      # warm, then
  .venv/bin/python scripts/bench.py convert --shapes dense --sizes 1 --cold --out c.json   # cold rows beside
Writes WORKDIR/bench.md (bench-cold.md with --cold; the table in markdown) and WORKDIR/bench.json
(bench-cold.json; every raw number); logs of the last run of each command are in WORKDIR/logs. Progress goes
to stderr, the table to stdout. `--out FILE` writes the results file: one row per direction, shape, size,
method and cache (median seconds, GB/s, peak RSS per rank and summed, in bytes, "cache": "warm" or "cold",
the ratio to the read limit), with the machine, the versions and the date; the rows of other sizes, shapes
or caches already in FILE are kept, so a warm and a cold run make one file. docs/benchmarks/convert*.json are
the published ones, plotted on the benchmarks page.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from . import suite
from .methods import BY_KEY, DIRECTIONS
from .runner import command_line, options, write_results
from .tables import LIMIT_COLUMNS, SECTION_TITLES, headlines, result_rows, table_rows

OPTIONS = options(None, default="3, or 1 with --quick")


def add_arguments(p: argparse.ArgumentParser) -> None:
    suite.add_arguments(p)
    p.add_argument(
        "--direction",
        choices=("both", *DIRECTIONS),
        default="both",
        help="dcp-to-hf, hf-to-dcp, or both (the default)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each run (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root); "
        "the report and the results file say so, or why the rows are not cold",
    )


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """A results row's identity: rows of other sizes, shapes or caches already in `--out` are kept."""
    return (row["direction"], row["shape"], row["size_gb"], row["method"], row.get("cache", "warm"))


def main(args: argparse.Namespace) -> int:
    suite.resolve(args)
    names = list(DIRECTIONS) if args.direction == "both" else [args.direction]
    env = suite.environment()
    load_start = os.getloadavg()[0]
    reports = suite.measure(args, {d: DIRECTIONS[d] for d in names}, env)
    load = (load_start, os.getloadavg()[0])
    sections = []
    for direction in names:
        mine = [r for r in reports if r.direction == direction]
        sections.append(
            suite.Section(
                direction, SECTION_TITLES[direction], table_rows(mine, True), headlines(mine), LIMIT_COLUMNS
            )
        )
    name = "bench-cold" if args.cold else "bench"
    code = suite.report(args, name, sections, reports, list(BY_KEY.values()), load)
    if args.out:
        write_results(args.out, "convert", result_rows(reports), command_line(), merge=row_key)
    return code
