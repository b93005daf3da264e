"""Benchmark `ckptconv dcp-to-hf --lora merge` against merging with PEFT (issue #21's merge row).

The checkpoint (made once, WORKDIR/lora-SIZEGB): a Llama-shaped model of about SIZE GB of fp32 weights
(hidden 2048, FFN 5632, vocab 32000, as many layers as the size takes) wrapped by PEFT with a LoRA of r=16
on every projection (q, k, v, o, gate, up, down; `init_lora_weights=False`, so B is not zero), saved whole
with `dcp.save({"model": peft_model.state_dict()})`, beside the model's config.json and the adapter's
adapter_config.json (workers/lora_peft.py). Methods, each a fresh process, `--runs` times (interleaved), the
median time and the peak RSS of the largest process (a rank) shown (sampled every 20 ms over the process
tree; runner.py):

  ckptconv 1 rank    python -m ckptconv dcp-to-hf CKPT OUT --lora merge --lora-config CFG --quiet
  ckptconv 2 ranks   the same under torchrun --standalone --nproc-per-node 2
  PEFT merge         what trainers' merge scripts do: the model built from its config (on the meta device,
                     then `to_empty`, so no time goes to a random init), wrapped with `get_peft_model`,
                     `dcp.load` into its state dict, `merge_and_unload()`, cast to bf16, `save_pretrained`

The outputs are checked equal tensor by tensor (both merge in fp32 and cast once to bf16).

usage: .venv/bin/python scripts/bench.py lora [--gb 4] [--runs 3] [--workdir bench-out] [--out FILE]
`--out FILE` also writes the rows as JSON with the machine, versions and date, as docs/benchmarks/lora.json
holds them; the rows of other sizes already in FILE are kept (one file, all sizes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .methods import WORKERS
from .runner import GIB, ROOT, command_line, kept_commands, log, options, run_interleaved, write_results

OPTIONS = options(3)
WORKER = str(WORKERS / "lora_peft.py")


def same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, tuple[Path, str]]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: (f, k) for k in h.keys()})  # noqa: SIM118 (safe_open has no __iter__)
        return out

    ta, tb = tensors(a), tensors(b)
    if sorted(ta) != sorted(tb):
        return False
    for key, (file, name) in ta.items():
        with safe_open(str(file), "pt") as ha, safe_open(str(tb[key][0]), "pt") as hb:
            if not torch.equal(ha.get_tensor(name), hb.get_tensor(name)):
                return False
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gb", type=float, default=4.0, help="fp32 size of the model in GB (default 4)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench-out")


def main(args: argparse.Namespace) -> int:
    ckpt = args.workdir / f"lora-{args.gb:g}GB"
    if not ckpt.exists():  # in a child: this process stays small, and a fork of it measures only its command
        log(f"making {ckpt} ...")
        subprocess.run([sys.executable, WORKER, "make", str(ckpt), str(args.gb)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    flags = ["--lora", "merge", "--lora-config", str(ckpt / "adapter_config.json"), "--quiet", "--overwrite"]
    convert = ["-m", "ckptconv", "dcp-to-hf", str(ckpt / "dcp")]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    methods = {
        "ckptconv 1 rank": [sys.executable, *convert, "{out}", *flags],
        "ckptconv 2 ranks": [*torchrun, *convert, "{out}", *flags],
        "PEFT merge": [sys.executable, WORKER, "merge", str(ckpt), "{out}"],
    }
    commands = kept_commands(methods, args.workdir, "lora")  # outputs compared below
    outs = {c.key: c.out for c in commands if c.out is not None}
    results = run_interleaved(commands, args.runs, env, f"lora {args.gb:g}GB")
    failed = [r for r in results.values() if r.error is not None]
    for r in failed:
        sys.stderr.write(f"FAILED {r.method}: {r.error}\n")
    if failed:
        return 1
    equal = same_tensors(outs["ckptconv 1 rank"], outs["PEFT merge"])
    base = results["PEFT merge"].seconds
    size = sum(f.stat().st_size for f in (ckpt / "dcp").iterdir())
    print(f"{ckpt}: {size / 1e9:.2f} GB of DCP (fp32 base + r=16 LoRA on 7 projections), merged to bf16")
    print(f"| method | seconds (median of {args.runs}) | vs PEFT merge | peak RSS per rank |")
    print("| --- | --- | --- | --- |")
    for method, r in results.items():
        print(f"| {method} | {r.seconds:.2f} | {r.seconds / base:.2f}x | {r.rss_rank / GIB:.2f} GiB |")
    print(f"outputs equal tensor for tensor: {equal}")
    if args.out:
        rows = [
            {
                "size_gb": round(size / 1e9, 2),
                "method": method,
                "seconds": r.seconds,
                "rss_rank_gib": round(r.rss_rank / GIB, 3),
                "runs": len(r.samples),
            }
            for method, r in results.items()
        ]
        write_results(args.out, "lora-merge", rows, command_line(), merge=lambda row: row["size_gb"])
    return 0 if equal else 1
