"""Benchmark `ckptconv hf-to-dcp` of quantized releases against the format's own dequantizer (issue #38).

The releases (made once, WORKDIR/dequant-SIZEGB/KIND): a Llama-shaped model of about SIZE GB of bf16 weights
(hidden 2048, FFN 5632, vocab 32000, as many layers as the size takes), quantized by compressed-tensors' own
code (workers/ct_release.py): `int4` its W4A16 preset (pack-quantized int4, group 128), `nvfp4` its NVFP4A16
preset (nvfp4-pack-quantized weights, FP8 scales per 16 and a global scale; not its W4A4 NVFP4 preset, whose
input_global_scale compressed-tensors' own dequantizer refuses as a residual qparam, 0.20.0). Methods, each
a fresh process, `--runs` times (interleaved), the median time and the peak RSS of the largest process (a
rank) shown:

  ckptconv 1 rank     python -m ckptconv hf-to-dcp RELEASE OUT --quiet      (bf16 DCP, dequantized on read)
  ckptconv 2 ranks    the same under torchrun --standalone --nproc-per-node 2
  compressed-tensors  its own dequantizer: convert_checkpoint(RELEASE, OUT, CompressedTensorsDequantizer) in
                      bf16 on the CPU, one worker (file by file), writing bf16 safetensors

The outputs are checked equal tensor by tensor (ckptconv's DCP read back with torch's dcp_to_torch_save).

usage: .venv/bin/python scripts/bench.py dequant [--gb 1] [--kinds int4,nvfp4] [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .methods import WORKERS
from .runner import GIB, ROOT, command_line, kept_commands, log, options, run_interleaved, write_results

OPTIONS = options(3)
WORKER = str(WORKERS / "ct_release.py")
KINDS = ("int4", "nvfp4")


def same_values(dcp_dir: Path, hf_dir: Path) -> bool:
    """Whether the DCP holds exactly the tensors of the safetensors directory (keys, dtypes, bits)."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(dcp_dir, Path(tmp) / "all.pt")
        ours = torch.load(Path(tmp) / "all.pt", weights_only=True)
    ours = {k: v for k, v in ours.items() if isinstance(v, torch.Tensor)}
    theirs: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            theirs.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 (no __iter__)
    if sorted(ours) != sorted(theirs):
        sys.stderr.write(f"keys differ: {sorted(set(ours) ^ set(theirs))[:5]}\n")
        return False
    return all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gb", type=float, default=1.0, help="bf16 size of the model in GB (default 1)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="int4, nvfp4 or both (default both)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench-out")


def main(args: argparse.Namespace) -> int:
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        sys.stderr.write(f"--kinds: one or more of {', '.join(KINDS)}\n")
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    rows, ok = [], True
    for kind in kinds:
        base = args.workdir / f"dequant-{args.gb:g}GB"
        release = base / kind
        if not release.exists():
            log(f"making {release} ...")
            import subprocess

            subprocess.run([sys.executable, WORKER, "make", kind, str(base), str(args.gb)], check=True)
        convert = ["-m", "ckptconv", "hf-to-dcp", str(release), "{out}", "--quiet", "--overwrite"]
        methods = {
            "ckptconv 1 rank": [sys.executable, *convert],
            "ckptconv 2 ranks": [*torchrun, *convert],
            "compressed-tensors": [sys.executable, WORKER, "dequant", str(release), "{out}"],
        }
        commands = kept_commands(methods, args.workdir, f"dequant-{kind}")  # outputs compared below
        outs = {c.key: c.out for c in commands if c.out is not None}
        results = run_interleaved(commands, args.runs, env, f"dequant {kind} {args.gb:g}GB")
        failed = [r for r in results.values() if r.error is not None]
        for r in failed:
            sys.stderr.write(f"FAILED {r.method}: {r.error}\n")
        if failed:
            return 1
        equal = same_values(outs["ckptconv 1 rank"], outs["compressed-tensors"])
        ok = ok and equal
        size = sum(f.stat().st_size for f in release.glob("*.safetensors"))
        ref = results["compressed-tensors"]
        print(f"{release}: {size / 1e9:.2f} GB of {kind} safetensors, dequantized to bf16")
        print(f"| method | seconds (median of {args.runs}) | vs compressed-tensors | peak RSS per rank |")
        print("| --- | --- | --- | --- |")
        for method, r in results.items():
            print(
                f"| {method} | {r.seconds:.2f} | {r.seconds / ref.seconds:.2f}x | "
                f"{r.rss_rank / GIB:.2f} GiB ({r.rss_rank / ref.rss_rank:.2f}x) |"
            )
        print(f"outputs equal tensor for tensor: {equal}")
        rows += [
            {
                "kind": kind,
                "size_gb": round(size / 1e9, 2),
                "method": method,
                "seconds": r.seconds,
                "rss_rank_gib": round(r.rss_rank / GIB, 3),
                "runs": len(r.samples),
            }
            for method, r in results.items()
        ]
    if args.out:
        write_results(
            args.out, "dequant", rows, command_line(), merge=lambda row: (row["kind"], row["size_gb"])
        )
    return 0 if ok else 1
