"""What the two conversion benchmarks (convert, memory) share: their options (sizes, shapes, work directory),
the measuring loop (for each direction, shape and size a checkpoint made once in the work directory, and the
direction's methods run interleaved on it) and the report: printed, and written to WORKDIR as markdown (the
tables) and JSON (every raw number)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .checkpoints import (
    checkpoint_shape,
    describe_files,
    describe_shape,
    ensure_checkpoint,
    ensure_hf,
    size_label,
    stem,
)
from .methods import SHAPES, Method
from .runner import ROOT, Command, dir_bytes, log, remove, run_interleaved
from .runner import machine as runner_machine
from .tables import SizeReport, render_markdown, render_text

NOTES = (
    "Warm page cache: each checkpoint was just written and is read again and again, so this measures the\n"
    "converters, not the disk. Median wall time of the runs; RSS is the peak over the runs, sampled every\n"
    "20 ms. GB/s = input checkpoint bytes (1e9) / median seconds. 'vs ckptconv 1r' = median / ckptconv\n"
    "1 rank's median in the same direction and size (>1 is slower). 'beyond start-up / cp' = (median -\n"
    "start-up median) / cp -r median, the start-up being `import torch` for one process and `torchrun\n"
    "import torch` for two ranks."
)
COLD_NOTES = (
    "Cold page cache: before each run (outside the timed region) `sync; echo 3 > /proc/sys/vm/drop_caches`,\n"
    "so each run reads its input, and Python and torch their files, from the device. 'x read limit' =\n"
    "median / the median of `cat` of every source file, cold too (>1 is slower than reading the source once)."
)


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError("takes comma-separated positive sizes in GB")
    return sizes


def _shapes(text: str) -> list[str]:
    shapes = [k.strip() for k in text.split(",") if k.strip()]
    if not shapes or any(k not in SHAPES for k in shapes):
        raise argparse.ArgumentTypeError(f"takes a comma-separated list of {', '.join(SHAPES)}")
    return shapes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes", type=_sizes, help="comma-separated checkpoint sizes in GB of fp32 weights (default 1,4)"
    )
    p.add_argument("--quick", action="store_true", help="a smoke test: --sizes 0.25 --runs 1 unless given")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench-out", help="checkpoints, outputs, reports")
    p.add_argument(
        "--shapes", type=_shapes, default=list(SHAPES), help="comma-separated: dense, moe (default both)"
    )


def resolve(args: argparse.Namespace) -> None:
    """The defaults that depend on --quick: 0.25 GB and one run, else 1 and 4 GB and three runs."""
    args.sizes = args.sizes or ([0.25] if args.quick else [1.0, 4.0])
    args.runs = args.runs or (1 if args.quick else 3)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CKPTCONV_DEBUG", None)
    return env


def measure(
    args: argparse.Namespace,
    directions: dict[str, tuple[Method, ...]],
    env: dict[str, str],
    prepare: Callable[[SizeReport], None] | None = None,
) -> list[SizeReport]:
    """Every direction x shape x size: its checkpoint (made once), then its methods run interleaved."""
    out, logs = args.workdir / "out", args.workdir / "logs"
    reports = []
    for direction, methods in directions.items():
        for kind, size_gb in [(k, s) for k in args.shapes for s in args.sizes]:
            make = ensure_hf if direction == "hf-to-dcp" else ensure_checkpoint
            ckpt = make(args.workdir, size_gb, kind, env)
            rep = SizeReport(size_gb, ckpt, dir_bytes(ckpt), checkpoint_shape(ckpt), methods, direction, kind)
            if prepare is not None:
                prepare(rep)
            commands = [
                Command(
                    m.key,
                    m.label,
                    m.argv(ckpt, out / m.key, SHAPES[kind]),
                    logs / f"{direction}-{stem(size_gb, kind)}-{m.key}.log",
                    out / m.key,
                )
                for m in methods
            ]
            cold = getattr(args, "cold", False)
            rep.results = run_interleaved(commands, args.runs, env, f"{direction} {rep.label}", cold)
            rep.cache = "cold" if all(r.cache == "cold" for r in rep.results.values() if r.ok) else "warm"
            rep.not_cold = next((r.not_cold for r in rep.results.values() if r.not_cold), None)
            reports.append(rep)
    remove(out)
    return reports


@dataclass
class Section:
    direction: str
    title: str
    rows: list[list[str]]
    headlines: list[str]
    columns: Sequence[tuple[str, str]]


def title(args: argparse.Namespace) -> str:
    cache = ", page cache dropped before each run" if getattr(args, "cold", False) else ""
    return (
        f"ckptconv benchmark: {args.runs} run(s) per method, sizes {', '.join(map(size_label, args.sizes))}, "
        f"shapes {', '.join(args.shapes)}{cache}"
    )


def machine() -> dict[str, Any]:
    """The runner's machine record, with torch's version and the threads it was allowed."""
    import torch

    return {
        **runner_machine(),
        "torch": torch.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def report(
    args: argparse.Namespace,
    name: str,
    sections: Sequence[Section],
    reports: Sequence[SizeReport],
    methods: Sequence[Method],
    load: tuple[float, float],
) -> int:
    """Print the tables, write WORKDIR/NAME.md and NAME.json; 1 if a method failed."""
    workdir: Path = args.workdir
    load_line = (
        f"1-minute load average {load[0]:.2f} at start, {load[1]:.2f} at end "
        f"({os.cpu_count()} CPUs; other jobs on the machine skew the timings)"
    )
    shapes = [
        f"{r.direction} {r.label}: {r.ckpt.name}, {r.ckpt_bytes / 1e9:.2f} GB in "
        f"{describe_files(r.ckpt)}, {describe_shape(r.shape)}"
        for r in reports
    ]
    print(title(args))
    for s in sections:
        print(f"\n== {s.title} ==\n")
        print(render_text(s.rows, s.columns))
        print()
        print("\n".join(s.headlines))
    print()
    notes = COLD_NOTES if getattr(args, "cold", False) else NOTES
    refused = sorted({r.not_cold for r in reports if r.not_cold})
    notes += "".join(f"\nThese rows are NOT cold: {why}." for why in refused)
    print(notes)
    print(load_line)
    print("checkpoints:\n" + "".join(f"  {s}\n" for s in shapes), end="")

    (workdir / f"{name}.md").write_text(
        f"# {title(args)}\n\n"
        + "".join(
            f"## {s.title}\n\n{render_markdown(s.rows, s.columns)}\n\n"
            + "".join(f"- {h}\n" for h in s.headlines)
            + "\n"
            for s in sections
        )
        + f"{notes}\n\n{load_line}.\n\nCheckpoints:\n\n"
        + "".join(f"- {s}\n" for s in shapes)
    )
    doc = {
        "runs": args.runs,
        "directions": [s.direction for s in sections],
        "environment": machine(),
        "headlines": {s.direction: s.headlines for s in sections},
        "loadavg_1min": {"start": load[0], "end": load[1]},
        "commands": {m.key: m.argv(Path("SRC"), Path("OUT"), ()) for m in methods},
        "ckptconv_flags_by_shape": SHAPES,
        "sizes": [_size_doc(r) for r in reports],
    }
    (workdir / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    log(f"wrote {workdir / f'{name}.md'} and {workdir / f'{name}.json'}")

    failed = [(rep, r) for rep in reports for r in rep.results.values() if r.error is not None]
    for rep, r in failed:
        sys.stderr.write(f"FAILED {rep.direction} {rep.label} {rep.method(r.method).label}: {r.error}\n")
    return 1 if failed else 0


def _size_doc(r: SizeReport) -> dict[str, Any]:
    return {
        "direction": r.direction,
        "size_gb": r.size_gb,
        "shape_kind": r.kind,
        "cache": r.cache,
        "not_cold": r.not_cold,
        "checkpoint": str(r.ckpt),
        "checkpoint_bytes": r.ckpt_bytes,
        "checkpoint_files": describe_files(r.ckpt),
        "shape": r.shape,
        "largest_tensor_bytes": r.largest,
        "methods": {
            k: {
                "label": r.method(k).label,
                "ranks": r.method(k).ranks,
                "error": res.error,
                "median_seconds": res.seconds if res.ok else None,
                "vs_ckptconv_1": r.vs_ckptconv(k),
                "beyond_startup_over_cp": r.beyond_startup_over_cp(k),
                "runs": [asdict(s) for s in res.samples],
            }
            for k, res in r.results.items()
        },
    }
