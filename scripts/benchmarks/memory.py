"""Benchmark the memory of `verify`, `--verify` and `dcp-to-hf --read gather`: peak RSS per rank against what
they should hold, on the conversion benchmark's checkpoints (same sizes, shapes, work directory and runner).

  verify 1 rank            `ckptconv verify DCP RELEASE` (fp32 DCP vs its bf16 release: A cast to B's dtype)
  verify 1r --atol         the same with `--atol 1e-2` (fp32 arithmetic)
  verify 2r                under torchrun, keys shared out over 2 ranks
  dcp-to-hf --verify 1r    the conversion, re-read and compared before it is published
  gather 2r 128MB          `dcp-to-hf --read gather` on 2 ranks, the default bucket
  gather 2r 32MB           the same with `--bucket-size 32MB`

The release (`RELEASE`, bf16 safetensors) is made once from the DCP checkpoint by ckptconv and reused.
Columns: "beyond start-up" = RSS/rank minus the RSS/rank of the start-up row of the same rank count;
"largest" = the largest stored tensor (fp32 bytes); "bound" = what the command should hold beyond start-up:
the largest pair (fp32 + bf16: 1.5x largest) for verify, the bucket + the largest tensor for gather. The
start-up rows (`import torch`, `torchrun import torch`) and `ckptconv 1 rank` (dcp-to-hf) run beside them.

usage: .venv/bin/python scripts/bench.py memory --shapes dense --sizes 1,4 --runs 1
Writes WORKDIR/bench-memory.md and bench-memory.json (as convert's bench.md and bench.json); `--out FILE`
the results file (one row per shape, size and method, with the largest tensor and the bound).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from . import suite
from .checkpoints import ensure_release, largest_tensor_bytes, release_of
from .methods import METHODS, NPROC, PY, SHAPES, STARTUP, Method, ckptconv_args, torchrun
from .runner import GIB, command_line, log, options, write_results
from .tables import SizeReport, failed_row, result_rows

MB = 10**6
OPTIONS = options(None, default="3, or 1 with --quick")
TITLE = "memory: verify, --verify and --read gather against the largest tensor and the bucket"

MEMORY_METHODS: tuple[Method, ...] = (
    *STARTUP,
    next(m for m in METHODS if m.key == "ckptconv_1"),
    Method(
        "m_verify_1",
        "verify 1 rank",
        1,
        "convert",
        lambda c, o, f: [PY, "-m", "ckptconv", "verify", str(c), str(release_of(c)), *f],
    ),
    Method(
        "m_verify_atol",
        "verify 1r --atol",
        1,
        "convert",
        lambda c, o, f: [PY, "-m", "ckptconv", "verify", str(c), str(release_of(c)), "--atol", "1e-2", *f],
    ),
    Method(
        "m_verify_2",
        f"verify {NPROC}r",
        NPROC,
        "convert",
        lambda c, o, f: torchrun("-m", "ckptconv", "verify", str(c), str(release_of(c)), *f),
    ),
    Method(
        "m_convert_verify",
        "dcp-to-hf --verify 1r",
        1,
        "convert",
        lambda c, o, f: [PY, "-m", "ckptconv", *ckptconv_args(c, o, f), "--verify"],
    ),
    Method(
        "m_gather_128",
        f"gather {NPROC}r 128MB",
        NPROC,
        "convert",
        lambda c, o, f: torchrun("-m", "ckptconv", *ckptconv_args(c, o, f), "--read", "gather"),
    ),
    Method(
        "m_gather_32",
        f"gather {NPROC}r 32MB",
        NPROC,
        "convert",
        lambda c, o, f: torchrun(
            "-m", "ckptconv", *ckptconv_args(c, o, f), "--read", "gather", "--bucket-size", "32MB"
        ),
    ),
)
# key -> what it holds: "pair" or bucket bytes
BOUNDS: dict[str, str | int] = {
    "m_verify_1": "pair",
    "m_verify_atol": "pair",
    "m_verify_2": "pair",
    "m_convert_verify": "pair",
    "m_gather_128": 128 * MB,
    "m_gather_32": 32 * MB,
}
COLUMNS = (
    ("size", "<"),
    ("method", "<"),
    ("ranks", ">"),
    ("median s", ">"),
    ("RSS/rank GiB", ">"),
    ("beyond start-up GiB", ">"),
    ("largest GiB", ">"),
    ("bound GiB", ">"),
    ("beyond / bound", ">"),
)


def bound_bytes(key: str, largest: int) -> int:
    """What the command `key` should hold beyond start-up: the largest fp32/bf16 pair, or bucket + largest."""
    what = BOUNDS[key]
    return largest + largest // 2 if what == "pair" else int(what) + largest


def table_rows(reports: Sequence[Any]) -> list[list[str]]:
    """Rows of the memory table. `reports`: tables.SizeReport of the memory benchmark, with `.largest` set."""
    rows = []
    for rep in reports:
        startup = {m.ranks: rep.results[m.key] for m in rep.methods if m.kind == "startup"}
        for m in rep.methods:
            r = rep.results[m.key]
            head = [rep.label, m.label, str(m.ranks)]
            if not r.ok:
                rows.append(failed_row(head, COLUMNS))
                continue
            base = startup.get(m.ranks)
            beyond = (
                r.rss_rank - base.rss_rank if base is not None and base.ok and m.kind == "convert" else None
            )
            bound = bound_bytes(m.key, rep.largest) if m.key in BOUNDS else None
            rows.append(
                [
                    *head,
                    f"{r.seconds:.2f}",
                    f"{r.rss_rank / GIB:.2f}",
                    "-" if beyond is None else f"{beyond / GIB:.2f}",
                    f"{rep.largest / GIB:.2f}",
                    "-" if bound is None else f"{bound / GIB:.2f}",
                    "-" if beyond is None or not bound else f"{beyond / bound:.2f}",
                ]
            )
    return rows


def headlines(reports: Sequence[Any], labels: dict[str, str]) -> list[str]:
    """One line per report: each bounded command's peak beyond start-up as a fraction of its bound."""
    lines = []
    for rep, row in zip(reports, _per_report(reports), strict=True):
        parts = [f"{labels[key]} {ratio}" for key, ratio in row]
        lines.append(f"memory @{rep.label}: peak RSS per rank beyond start-up / bound = " + ", ".join(parts))
    return lines


def _per_report(reports: Sequence[Any]) -> list[list[tuple[str, str]]]:
    out = []
    for rep in reports:
        start = {m.ranks: rep.results[m.key] for m in rep.methods if m.kind == "startup"}
        row = []
        for m in rep.methods:
            r, base = rep.results[m.key], start.get(m.ranks)
            if m.key in BOUNDS and r.ok and base is not None and base.ok:
                row.append((m.key, f"{(r.rss_rank - base.rss_rank) / bound_bytes(m.key, rep.largest):.2f}"))
        out.append(row)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    suite.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    suite.resolve(args)
    env = suite.environment()

    def prepare(rep: SizeReport) -> None:
        log(f"memory {rep.label}: the bf16 release {ensure_release(rep.ckpt, SHAPES[rep.kind], env)}")
        rep.largest = largest_tensor_bytes(rep.ckpt, env)

    load_start = os.getloadavg()[0]
    reports = suite.measure(args, {"memory": MEMORY_METHODS}, env, prepare)
    load = (load_start, os.getloadavg()[0])
    labels = {m.key: m.label for m in MEMORY_METHODS}
    section = suite.Section("memory", TITLE, table_rows(reports), headlines(reports, labels), COLUMNS)
    code = suite.report(args, "bench-memory", [section], reports, MEMORY_METHODS, load)
    if args.out:
        rows = result_rows(reports)
        for row, rep in zip(rows, [r for r in reports for _ in r.methods], strict=True):
            row["largest_tensor_bytes"] = rep.largest
            row["bound_bytes"] = bound_bytes(row["method"], rep.largest) if row["method"] in BOUNDS else None
        write_results(args.out, "memory", rows, command_line())
    return code
