"""Benchmark what durable output costs: dcp-to-hf and hf-to-dcp with their fsyncs (the default) and with
`--no-fsync`, against torch's default paths and the same paths made durable, on the conversion benchmark's
checkpoints (same sizes, shapes, work directory and runner).

What fsyncs by default: ckptconv (every output file as it is finished, then the directories, before OUT is
renamed into place; `--no-fsync` turns it off) and torch's `dcp.save` (`FileSystemWriter(sync_files=True)`:
each data file and `.metadata`, not the directory). What does not: `huggingface_hub.save_torch_state_dict` and
`safetensors.torch.save_file` (nor `cp`). Each of them is measured both ways:

dcp-to-hf (fp32 DCP -> bf16 safetensors):
  cp -r, cp -r + sync          copying the checkpoint; then `sync` of every file and directory copied and
                               of OUT's parent
  import torch, torchrun import torch   the start-up floors
  ckptconv 1 rank              `ckptconv dcp-to-hf CKPT OUT --dtype bf16` (fsyncs)
  ckptconv 1r --no-fsync       the same without
  ckptconv 2r direct, 2r --no-fsync   under `torchrun --nproc-per-node 2` (each rank fsyncs what it wrote)
  dcp.load+save_torch_sd       torch's default path (convert's baseline): no fsync
  dcp.load+save_torch_sd+fsync the same, then every file written and OUT fsynced, one after the other

hf-to-dcp (fp32 safetensors -> DCP):
  cp -r, cp -r + sync, the start-up floors, ckptconv 1 rank / 1r --no-fsync / 2r / 2r --no-fsync  as above
  load_file+dcp.save           `load_file` of every shard, `dcp.save(sd, no_dist=True)`: torch's default,
                               which fsyncs each file
  load_file+dcp.save no fsync  the same with `FileSystemWriter(OUT, sync_files=False)`

The runner calls `sync` between runs, outside the timed region, so each run pays for its own write-back only.
The page cache is warm for reading; what an fsync costs is the device's time to take the written bytes, so the
numbers depend on the disk under --workdir (name it in what you publish).

usage: .venv/bin/python scripts/bench.py durable --shapes dense --sizes 1 --runs 1
       .venv/bin/python scripts/bench.py durable --shapes dense --sizes 4,8 --runs 2 \
           --out docs/benchmarks/durable.json
Writes WORKDIR/bench-durable.md and bench-durable.json (as convert's bench.md and bench.json); `--out FILE`
the results file (one row per direction, shape, size and method, each with "fsync": true when its output is
fsynced before it ends, false when not, null for the start-up floors). Compare like with like: ckptconv
(fsync) with the torch paths that fsync, `--no-fsync` with those that do not; the benchmarks page's table
of this file pairs them so.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from . import suite
from .methods import BASELINE, BY_KEY, NPROC, PY, STARTUP, Method, ckptconv_args, torchrun
from .runner import command_line, options, write_results
from .tables import COLUMNS, SizeReport, result_rows, table_rows

OPTIONS = options(None, default="3, or 1 with --quick")
# coreutils' `sync FILE...` fsyncs each: every file and directory copied, then OUT's parent
SYNC_TREE = 'cp -r "$1" "$2" && find "$2" -exec sync {} + && sync "$(dirname "$2")"'


def _hf_to_dcp(*flags: str) -> list[str]:
    return ["-m", "ckptconv", "hf-to-dcp", *flags, "--quiet", "--overwrite"]


DCP_TO_HF: tuple[Method, ...] = (
    BY_KEY["cp"],
    Method(
        "d_cp_sync", "cp -r + sync", 1, "io", lambda c, o, f: ["bash", "-c", SYNC_TREE, "_", str(c), str(o)]
    ),
    *STARTUP,
    BY_KEY["ckptconv_1"],
    Method(
        "d_nofsync_1",
        "ckptconv 1r --no-fsync",
        1,
        "convert",
        lambda c, o, f: [PY, "-m", "ckptconv", *ckptconv_args(c, o, f), "--no-fsync"],
    ),
    BY_KEY["ckptconv_2_direct"],
    Method(
        "d_nofsync_2",
        f"ckptconv {NPROC}r --no-fsync",
        NPROC,
        "convert",
        lambda c, o, f: torchrun("-m", "ckptconv", *ckptconv_args(c, o, f), "--no-fsync"),
    ),
    BY_KEY["dcp_load"],
    Method(
        "d_dcp_load_fsync",
        "dcp.load+save_torch_sd+fsync",
        1,
        "convert",
        lambda c, o, f: [PY, BASELINE, "dcp_load_fsync", str(c), str(o)],
    ),
)
HF_TO_DCP: tuple[Method, ...] = (
    BY_KEY["h_cp"],
    Method(
        "h_cp_sync", "cp -r + sync", 1, "io", lambda c, o, f: ["bash", "-c", SYNC_TREE, "_", str(c), str(o)]
    ),
    *STARTUP,
    BY_KEY["h_ckptconv_1"],
    Method(
        "h_nofsync_1",
        "ckptconv 1r --no-fsync",
        1,
        "convert",
        lambda c, o, f: [PY, *_hf_to_dcp(str(c), str(o), "--no-fsync", *f)],
    ),
    BY_KEY["h_ckptconv_2"],
    Method(
        "h_nofsync_2",
        f"ckptconv {NPROC}r --no-fsync",
        NPROC,
        "convert",
        lambda c, o, f: torchrun(*_hf_to_dcp(str(c), str(o), "--no-fsync", *f)),
    ),
    BY_KEY["h_load_save"],
    Method(
        "h_load_save_nofsync",
        "load_file+dcp.save no fsync",
        1,
        "convert",
        lambda c, o, f: [PY, BASELINE, "load_file_dcp_save_nofsync", str(c), str(o)],
    ),
)
DIRECTIONS = {"dcp-to-hf": DCP_TO_HF, "hf-to-dcp": HF_TO_DCP}
# (fsync, no fsync) pairs per direction, as the headlines compare them
PAIRS = {
    "dcp-to-hf": (
        ("ckptconv_1", "d_nofsync_1"),
        ("ckptconv_2_direct", "d_nofsync_2"),
        ("d_dcp_load_fsync", "dcp_load"),
        ("d_cp_sync", "cp"),
    ),
    "hf-to-dcp": (
        ("h_ckptconv_1", "h_nofsync_1"),
        ("h_ckptconv_2", "h_nofsync_2"),
        ("h_load_save", "h_load_save_nofsync"),
        ("h_cp_sync", "h_cp"),
    ),
}
# (ckptconv, torch's default path, that path durable)
VERSUS = {
    "dcp-to-hf": ("ckptconv_1", "dcp_load", "d_dcp_load_fsync"),
    "hf-to-dcp": ("h_ckptconv_1", "h_load_save_nofsync", "h_load_save"),
}
# whether each method's output is fsynced (made durable) before it ends: every row of the results says so
FSYNC = {
    "cp": False,
    "h_cp": False,
    "d_cp_sync": True,
    "h_cp_sync": True,
    "ckptconv_1": True,
    "h_ckptconv_1": True,
    "ckptconv_2_direct": True,
    "h_ckptconv_2": True,
    "d_nofsync_1": False,
    "h_nofsync_1": False,
    "d_nofsync_2": False,
    "h_nofsync_2": False,
    "dcp_load": False,
    "d_dcp_load_fsync": True,
    "h_load_save": True,
    "h_load_save_nofsync": False,
}
TITLES = {
    "dcp-to-hf": f"durable dcp-to-hf: fp32 DCP (FSDP2, {NPROC} ranks) -> bf16 safetensors, fsync or not",
    "hf-to-dcp": "durable hf-to-dcp: fp32 safetensors -> DCP, fsync or not",
}


def headlines(reports: Sequence[SizeReport]) -> list[str]:
    """Per size: what fsync adds to each method that has both, and ckptconv against torch's paths."""
    lines = []
    for rep in reports:
        label = {m.key: m.label for m in rep.methods}
        costs = []
        for synced, unsynced in PAIRS[rep.direction]:
            a, b = rep.seconds(synced), rep.seconds(unsynced)
            if a is not None and b:
                costs.append(f"{label[synced]} {a:.2f} s against {b:.2f} s ({a - b:+.2f} s, {a / b:.2f}x)")
        lines.append(f"{rep.direction} @{rep.label}: with fsync / without: " + "; ".join(costs))
        keys = VERSUS[rep.direction]
        ours, default, durable = (rep.seconds(k) for k in keys)
        if ours is not None and default and durable:
            lines.append(
                f"{rep.direction} @{rep.label}: ckptconv 1 rank (fsynced) takes {ours / durable:.2f}x the "
                f"time of {label[keys[2]]} and {ours / default:.2f}x {label[keys[1]]}"
            )
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    suite.add_arguments(p)
    p.add_argument(
        "--direction", choices=("both", *DIRECTIONS), default="both", help="dcp-to-hf, hf-to-dcp, or both"
    )


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
            suite.Section(direction, TITLES[direction], table_rows(mine), headlines(mine), COLUMNS)
        )
    methods = [m for d in names for m in DIRECTIONS[d]]
    code = suite.report(args, "bench-durable", sections, reports, methods, load)
    if args.out:
        rows = [{**r, "fsync": FSYNC.get(r["method"])} for r in result_rows(reports)]  # None: start-up rows
        write_results(args.out, "durable", rows, command_line())
    return code
