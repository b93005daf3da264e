"""Benchmark `ckptconv dcp-to-hf --lora merge` against merging with PEFT (issue #21's merge row).

The checkpoint (made once, WORKDIR/lora-SIZEGB): a Llama-shaped model of about SIZE GB of fp32 weights
(hidden 2048, FFN 5632, vocab 32000, as many layers as the size takes) wrapped by PEFT with a LoRA of r=16
on every projection (q, k, v, o, gate, up, down; `init_lora_weights=False`, so B is not zero), saved whole
with `dcp.save({"model": peft_model.state_dict()})`, beside the model's config.json and the adapter's
adapter_config.json. Methods, each a fresh process, `--runs` times (interleaved), the median time and the
peak RSS of the largest process (a rank) shown (sampled every 20 ms over the process tree; `_bench_run`):

  ckptconv 1 rank    python -m ckptconv dcp-to-hf CKPT OUT --lora merge --lora-config CFG --quiet
  ckptconv 2 ranks   the same under torchrun --standalone --nproc-per-node 2
  PEFT merge         what trainers' merge scripts do: the model built from its config (on the meta device,
                     then `to_empty`, so no time goes to a random init), wrapped with `get_peft_model`,
                     `dcp.load` into its state dict, `merge_and_unload()`, cast to bf16, `save_pretrained`

The outputs are checked equal tensor by tensor (both merge in fp32 and cast once to bf16).

usage: .venv/bin/python scripts/bench_lora.py [--gb 4] [--runs 3] [--workdir bench-out] [--out FILE]
`--out FILE` also writes the rows as JSON with the machine, versions and date (scripts/_bench_results.py), as
docs/benchmarks/lora.json holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from _bench_results import write as write_results
from _bench_run import Sample, run_measured

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
HIDDEN, FFN, VOCAB, HEADS = 2048, 5632, 32000, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_config(gb: float) -> dict:
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN
    layers = max(1, round((gb * 1e9 / 4 - 2 * VOCAB * HIDDEN) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def lora_config() -> dict:
    return {"r": 16, "lora_alpha": 32, "target_modules": TARGETS, "init_lora_weights": False}


def make(path: Path, gb: float) -> None:
    """The checkpoint: PATH/dcp, PATH/config.json, PATH/adapter_config.json."""
    import torch
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model_config(gb)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    peft_model = get_peft_model(model, LoraConfig(**lora_config()))
    peft_model.peft_config["default"].save_pretrained(str(tmp))
    dcp.save({"model": peft_model.state_dict()}, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    tmp.rename(path)


def peft_merge(ckpt: Path, out: Path) -> None:
    """The baseline, in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**json.loads((ckpt / "config.json").read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft_model = get_peft_model(model, LoraConfig.from_pretrained(str(ckpt)))
    peft_model.to_empty(device="cpu")
    state = {"model": peft_model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    merged = peft_model.merge_and_unload()
    merged.to(torch.bfloat16).save_pretrained(str(out))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench-out")
    parser.add_argument("--baseline", nargs=2, type=Path, help=argparse.SUPPRESS)  # CKPT OUT: run it here
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)  # PATH: make the checkpoint here
    parser.add_argument("--out", type=Path, help="also write the results as JSON (machine, versions, date)")
    args = parser.parse_args()
    if args.baseline:
        peft_merge(*args.baseline)
        return
    if args.make:
        make(args.make, args.gb)
        return
    ckpt = args.workdir / f"lora-{args.gb:g}GB"
    if not ckpt.exists():  # in a child: this process stays small, and a fork of it measures only its command
        print(f"making {ckpt} ...", file=sys.stderr)
        subprocess.run([sys.executable, __file__, "--gb", str(args.gb), "--make", str(ckpt)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    flags = ["--lora", "merge", "--lora-config", str(ckpt / "adapter_config.json"), "--quiet", "--overwrite"]
    convert = ["-m", "ckptconv", "dcp-to-hf", str(ckpt / "dcp")]
    methods = {
        "ckptconv 1 rank": [sys.executable, *convert, "{out}", *flags],
        "ckptconv 2 ranks": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *convert,
            "{out}",
            *flags,
        ],
        "PEFT merge": [sys.executable, __file__, "--baseline", str(ckpt), "{out}"],
    }
    samples: dict[str, list[Sample]] = {m: [] for m in methods}
    outs = {m: args.workdir / f"lora-out-{i}" for i, m in enumerate(methods)}
    for run in range(args.runs):
        for method, argv in methods.items():
            shutil.rmtree(outs[method], ignore_errors=True)
            subprocess.run(["sync"], check=False)
            cmd = [a.replace("{out}", str(outs[method])) for a in argv]
            sample = run_measured(
                cmd, args.workdir / "logs" / f"lora-{run}-{method.replace(' ', '_')}.log", env
            )
            samples[method].append(sample)
            print(
                f"run {run + 1}: {method}: {sample.seconds:.2f} s, {sample.rss_rank / GIB:.2f} GiB",
                file=sys.stderr,
            )
    equal = same_tensors(outs["ckptconv 1 rank"], outs["PEFT merge"])
    base = statistics.median(s.seconds for s in samples["PEFT merge"])
    size = sum(f.stat().st_size for f in (ckpt / "dcp").iterdir())
    print(f"{ckpt}: {size / 1e9:.2f} GB of DCP (fp32 base + r=16 LoRA on 7 projections), merged to bf16")
    print(f"| method | seconds (median of {args.runs}) | vs PEFT merge | peak RSS per rank |")
    print("| --- | --- | --- | --- |")
    for method, got in samples.items():
        seconds = statistics.median(s.seconds for s in got)
        rss = max(s.rss_rank for s in got) / GIB
        print(f"| {method} | {seconds:.2f} | {seconds / base:.2f}x | {rss:.2f} GiB |")
    print(f"outputs equal tensor for tensor: {equal}")
    if args.out:
        rows = [
            {
                "size_gb": round(size / 1e9, 2),
                "method": method,
                "seconds": statistics.median(s.seconds for s in got),
                "rss_rank_gib": round(max(s.rss_rank for s in got) / GIB, 3),
                "runs": len(got),
            }
            for method, got in samples.items()
        ]
        _previous = json.loads(args.out.read_text())["results"] if args.out.exists() else []
        rows = [r for r in _previous if r["size_gb"] != round(size / 1e9, 2)] + rows  # one file, all sizes
        write_results(args.out, "lora-merge", rows, " ".join(["scripts/bench_lora.py", *sys.argv[1:]]))
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
