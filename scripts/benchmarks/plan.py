"""Planning at scale, measured without the data: a synthetic DCP checkpoint with a real torch `.metadata`.

usage: python scripts/bench.py plan [--scales 0.1,0.3,1] [--workdir DIR] [--ranks 512] [--hf-files 2000]
                                   [--out FILE: the results as JSON, as docs/benchmarks/plan.json holds them]

For each scale it writes WORKDIR/plan-SCALE: the `.metadata` torch's own `FileSystemWriter` would write for
`{"model": ..., "optimizer": ...}` of a Llama-70B-shaped model (hidden 8192, FFN 28672, 64 heads / 8 KV
heads, vocab 128256, round(80 * SCALE) layers) saved in fp32 by RANKS ranks as FSDP 64 x TP 8 (colwise
weights `Shard(0)` then FSDP's strided `Shard(0)`; rowwise `Shard(1)` then FSDP `Shard(0)`; norms FSDP only,
deduplicated over TP), with Adam's `exp_avg` / `exp_avg_sq` beside every parameter and 4 files per rank.
The data files are sparse (`truncate`; only each file's first bytes, a zip record's magic, are written), so
the checkpoint's size on disk is the metadata's: planning reads no tensor data.

Then it times, each in a fresh process (wall seconds and the kernel's peak RSS, `wait4`):

  read limit         `cat .metadata > /dev/null`: reading the file (from the page cache once made)
  torch unpickle     `pickle.load` of `.metadata` with torch imported: what `dcp.load` pays on every rank
  ckptconv dry-run   `python -m ckptconv dcp-to-hf SRC OUT --dry-run --quiet --json`: the whole plan, 1 rank
  ckptconv inspect   `python -m ckptconv inspect SRC --json`

and prints the dry run's ratio to torch's unpickling and to the read limit; then each rank's planning under
torchrun on 2 ranks, from its first line (start-up included), and, in one more process, the plan at RANKS
ranks under each `--write-granularity`: how many ranks write, and the least and most bytes a rank writes
(the table in docs/benchmarks.md). Last, `hf-to-dcp --dry-run` of a synthetic HF model of HF_FILES
safetensors files (real headers, sparse data; see `make_hf`).
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

from .runner import command_line, options, write_results

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 8192, 28672, 64, 8, 128256
HEAD_DIM = HIDDEN // HEADS
FSDP, TP = 64, 8
FILES_PER_RANK = 4


def _layout(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(fqn, global shape, sharding): "col" (TP dim 0), "row" (TP dim 1), "fsdp" (FSDP only)."""
    kv = KV_HEADS * HEAD_DIM
    out = [("tok_embeddings.weight", (VOCAB, HIDDEN), "col")]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (HIDDEN, HIDDEN), "col"),
            (p + "attention.wk.weight", (kv, HIDDEN), "col"),
            (p + "attention.wv.weight", (kv, HIDDEN), "col"),
            (p + "attention.wo.weight", (HIDDEN, HIDDEN), "row"),
            (p + "feed_forward.w1.weight", (FFN, HIDDEN), "col"),
            (p + "feed_forward.w3.weight", (FFN, HIDDEN), "col"),
            (p + "feed_forward.w2.weight", (HIDDEN, FFN), "row"),
            (p + "attention_norm.weight", (HIDDEN,), "fsdp"),
            (p + "ffn_norm.weight", (HIDDEN,), "fsdp"),
        ]
    out += [("norm.weight", (HIDDEN,), "fsdp"), ("output.weight", (VOCAB, HIDDEN), "col")]
    return out


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's split of n into `parts` (offset, size), empty parts dropped."""
    step = -(-n // parts)
    return [(o, min(step, n - o)) for o in range(0, n, step)]


def _chunks(shape: tuple[int, ...], how: str) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(saving rank, offsets, sizes) of every chunk stored."""
    out = []
    if how == "fsdp":
        for f, (o, s) in enumerate(_split(shape[0], FSDP)):
            out.append((f * TP, (o,), (s,)))
        return out
    for t, (to, ts) in enumerate(_split(shape[0 if how == "col" else 1], TP)):
        inner = _split(ts if how == "col" else shape[0], FSDP)
        for f, (fo, fs) in enumerate(inner):
            rank = f * TP + t
            if how == "col":
                out.append((rank, (to + fo, 0), (fs, shape[1])))
            else:
                out.append((rank, (fo, to), (fs, ts)))
    return out


def make(root: Path, scale: float, ranks: int) -> dict:
    """Write the synthetic checkpoint under `root` (once); returns its description."""
    done = root / "made.json"
    if done.exists():
        return json.loads(done.read_text())
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    assert ranks == FSDP * TP, "the layout is FSDP 64 x TP 8"
    root.mkdir(parents=True, exist_ok=True)
    layers = max(1, round(80 * scale))
    props = TensorProperties(dtype=torch.float32)
    state: dict = {}
    storage: dict = {}
    planner: dict = {}
    sizes = [[0] * FILES_PER_RANK for _ in range(ranks)]
    # one name per file, shared by its entries: torch's writer pickles each file's name once
    names = [[f"__{rank}_{k}.distcp" for k in range(FILES_PER_RANK)] for rank in range(ranks)]
    count = [0] * ranks
    chunks_total = 0
    for name, shape, how in _layout(layers):
        for fqn, path in (
            (f"model.{name}", ("model", name)),
            (f"optimizer.state.{name}.exp_avg", ("optimizer", "state", name, "exp_avg")),
            (f"optimizer.state.{name}.exp_avg_sq", ("optimizer", "state", name, "exp_avg_sq")),
        ):
            chunks = []
            for rank, offsets, csize in _chunks(shape, how):
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(csize)))
                nbytes = 4
                for s in csize:
                    nbytes *= s
                k = count[rank] % FILES_PER_RANK
                count[rank] += 1
                index = MetadataIndex(fqn, torch.Size(offsets), len(chunks) - 1)
                storage[index] = _StorageInfo(names[rank][k], sizes[rank][k], nbytes)
                sizes[rank][k] += nbytes
            state[fqn] = TensorStorageMetadata(props, torch.Size(shape), chunks)
            planner[fqn] = path
            chunks_total += len(chunks)
    metadata = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)
    with open(root / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    total = 0
    for rank in range(ranks):
        for k in range(FILES_PER_RANK):
            with open(root / f"__{rank}_{k}.distcp", "wb") as f:
                f.truncate(sizes[rank][k])
                f.write(b"PK\x03\x04")  # where a torch.save record starts (what the reader sniffs)
            total += sizes[rank][k]
    info = {
        "scale": scale,
        "layers": layers,
        "ranks": ranks,
        "files": ranks * FILES_PER_RANK,
        "tensors": len(state),
        "chunks": chunks_total,
        "bytes": total,
        "metadata_bytes": (root / ".metadata").stat().st_size,
    }
    done.write_text(json.dumps(info))
    return info


EXPERT_FFN, EXPERTS, MOE_LAYERS = 2048, 128, 60


def make_hf(root: Path, files: int) -> dict:
    """A synthetic HF safetensors checkpoint of `files` files and its index (once): a DeepSeek-V3-sized MoE
    (hidden 7168, 60 layers of 128 experts, bf16, ~0.7 TB), sparse files whose headers follow the format
    spec and are checked by the safetensors library itself (`safe_open` of every file)."""
    done = root / "made.json"
    if done.exists():
        return json.loads(done.read_text())
    root.mkdir(parents=True, exist_ok=True)
    hidden = 7168
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, hidden))]
    for i in range(MOE_LAYERS):
        p = f"model.layers.{i}."
        tensors += [(p + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        tensors += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            tensors += [
                (q + "gate_proj.weight", (EXPERT_FFN, hidden)),
                (q + "up_proj.weight", (EXPERT_FFN, hidden)),
            ]
            tensors += [(q + "down_proj.weight", (hidden, EXPERT_FFN))]
    tensors += [("model.norm.weight", (hidden,)), ("lm_head.weight", (VOCAB, hidden))]
    per_file = -(-len(tensors) // files)
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(files):
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, shape in tensors[k * per_file : (k + 1) * per_file]:
            nbytes = 2
            for d in shape:
                nbytes *= d
            header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / name, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
        total += offset
    from safetensors import safe_open

    for k in range(files):
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        with safe_open(root / name, "pt") as f:
            assert sorted(f.keys()) == sorted(key for key, file in weight_map.items() if file == name), name
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    info = {"files": files, "tensors": len(tensors), "bytes": total}
    done.write_text(json.dumps(info))
    return info


def _measure(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Wall seconds and peak RSS (GiB) of `cmd` as a fresh process: a wrapper interpreter runs it and reports
    RUSAGE_CHILDREN's ru_maxrss, which then holds that one child's kernel high-water mark."""
    wrapper = (
        "import resource,subprocess,sys,time,json;t=time.perf_counter();"
        "p=subprocess.run(sys.argv[1:],stdout=subprocess.PIPE,stderr=subprocess.PIPE);"
        "w=time.perf_counter()-t;"
        "sys.stderr.buffer.write(p.stderr);sys.stdout.buffer.write(p.stdout);"
        "print(json.dumps({'s':w,'rss':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,'rc':p.returncode}),"
        "file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, env=env)
    stats = json.loads(proc.stderr.decode().strip().splitlines()[-1])
    if stats["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({stats['rc']}):\n{proc.stderr.decode()[-2000:]}")
    peak = round(stats["rss"] / 2**20, 3)
    return {"seconds": round(stats["s"], 2), "peak_gib": peak, "stdout": proc.stdout}


BALANCE = """
import json, sys
from pathlib import Path
from ckptconv.core.dtypes import DtypePolicy, parse_dtype_flag
from ckptconv.formats.dcp import open_dcp
from ckptconv.plan.to_hf import plan_dcp_to_hf
from ckptconv.plan.writes import bytes_per_rank
ckpt, ranks, out = open_dcp(Path(sys.argv[1])), int(sys.argv[2]), {}
for granularity in ("tensor", "file"):
    plan = plan_dcp_to_hf(ckpt, DtypePolicy(parse_dtype_flag("bf16")), max_shard_size=5 * 10**9,
                          world_size=ranks, write_granularity=granularity)
    loads = bytes_per_rank(plan.writes, ranks)
    out[granularity] = {"busy": sum(1 for n in loads if n), "min": min(loads), "max": max(loads),
                        "files": len(plan.files)}
print(json.dumps(out))
"""


SHARED = """
import time
started = time.perf_counter()
import json, resource, sys
from pathlib import Path
from ckptconv.source.early import open_early
early = open_early(Path(sys.argv[1]))  # as the command line does, before torch is imported
from ckptconv.core.dtypes import DtypePolicy, parse_dtype_flag
from ckptconv.source.share import open_dcp_shared
from ckptconv.job.gcpause import paused
from ckptconv.plan.to_hf import plan_dcp_to_hf
from ckptconv.job.world import everyone, world_from_env
with world_from_env() as world, paused():
    ckpt = everyone(world, open_dcp_shared, world, Path(sys.argv[1]), early)
    policy = DtypePolicy(parse_dtype_flag("bf16"))
    plan_dcp_to_hf(ckpt, policy, max_shard_size=5 * 10**9, world_size=world.size)
    mine = {"rank": world.rank, "seconds": round(time.perf_counter() - started, 2),
            "peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    ranks = world.all_gather_object(mine)
    if world.is_main:
        print(json.dumps(ranks))
"""


def _shared(root: Path, nproc: int) -> list[dict]:
    """Each rank's planning under torchrun, from its first line, as the command line does it (`open_early`
    before torch is imported, then start-up, `open_dcp_shared` and `plan_dcp_to_hf`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*cmd, "--no-python", sys.executable, "-c", SHARED, str(root)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"torchrun planning failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratios(rows: dict[str, dict]) -> dict[str, float]:
    """The dry run's wall time over torch's unpickling (below 1: faster) and over the read limit (the
    time `cat` takes to read `.metadata`: what no decoder of the whole file can go below)."""
    dry = rows["ckptconv dry-run"]["seconds"]
    out = {"dry-run / read limit": round(dry / max(rows["read limit (cat .metadata)"]["seconds"], 0.01), 2)}
    if "torch unpickle" in rows:
        out["dry-run / torch unpickle"] = round(dry / max(rows["torch unpickle"]["seconds"], 0.01), 2)
    return out


OPTIONS = options(with_runs=False)  # each method is measured once per scale


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scales", default="0.1,0.3,1", help="comma-separated fractions of the 80 layers")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptconv-bench-plan"))
    parser.add_argument("--ranks", type=int, default=FSDP * TP)
    parser.add_argument("--skip-torch", action="store_true", help="leave out torch's own unpickling")
    parser.add_argument(
        "--hf-files", type=int, default=2000, help="files of the synthetic HF model (0: none)"
    )


def main(args: argparse.Namespace) -> int:
    py = sys.executable
    results = []
    for scale in [float(s) for s in args.scales.split(",")]:
        root = args.workdir / f"plan-{scale:g}"
        t = time.perf_counter()
        info = make(root, scale, args.ranks)
        made = time.perf_counter() - t
        print(
            f"scale {scale:g}: {info['layers']} layers, {info['tensors']} tensors, "
            f"{info['chunks']:,} chunks, "
            f"{info['files']} files, {info['bytes'] / 1e12:.2f} TB, "
            f".metadata {info['metadata_bytes'] / 1e6:.0f} MB (made in {made:.0f}s)",
            flush=True,
        )
        rows = {}
        metadata = str(root / ".metadata")
        rows["read limit (cat .metadata)"] = _measure(["sh", "-c", 'cat "$1" > /dev/null', "sh", metadata])
        if not args.skip_torch:
            load = "import pickle,sys,torch.distributed.checkpoint;pickle.load(open(sys.argv[1],'rb'))"
            rows["torch unpickle"] = _measure([py, "-c", load, str(root / ".metadata")])
        out = args.workdir / "out"
        dry = [py, "-m", "ckptconv", "dcp-to-hf", str(root), str(out), "--dry-run", "--quiet", "--json"]
        rows["ckptconv dry-run"] = _measure(dry)
        rows["ckptconv inspect"] = _measure([py, "-m", "ckptconv", "inspect", str(root), "--json"])
        balance = json.loads(_measure([py, "-c", BALANCE, str(root), str(args.ranks)])["stdout"])
        for name, row in rows.items():
            print(f"  {name:28s} {row['seconds']:8.2f} s  {row['peak_gib']:7.3f} GiB", flush=True)
        ratios = _ratios(rows)
        for name, ratio in ratios.items():
            print(f"  {name:28s} {ratio:8.2f} x", flush=True)
        shared = _shared(root, 2)
        for r in shared:
            print(
                f"  {'plan, torchrun rank ' + str(r['rank']):28s} {r['seconds']:8.2f} s"
                f"  {r['peak_gib']:7.3f} GiB"
            )
        for granularity, b in balance.items():
            print(
                f"  --write-granularity {granularity:6s} at {args.ranks} ranks: {b['busy']} busy, "
                f"{b['min'] / 1e9:.2f}-{b['max'] / 1e9:.2f} GB per rank, {b['files']} files",
                flush=True,
            )
        results.append(
            {
                **info,
                "rows": {k: {"seconds": v["seconds"], "peak_gib": v["peak_gib"]} for k, v in rows.items()},
                "ratios": ratios,
                "balance": balance,
                "shared": shared,
            }
        )
    if args.hf_files:
        root = args.workdir / f"hf-{args.hf_files}"
        info = make_hf(root, args.hf_files)
        print(
            f"HF: {info['files']} files, {info['tensors']:,} tensors, {info['bytes'] / 1e12:.2f} TB",
            flush=True,
        )
        out = args.workdir / "out"
        dry = [py, "-m", "ckptconv", "hf-to-dcp", str(root), str(out), "--dry-run", "--quiet", "--json"]
        row = _measure(dry)
        print(
            f"  {'ckptconv hf-to-dcp dry-run':28s} {row['seconds']:8.2f} s  {row['peak_gib']:7.3f} GiB",
            flush=True,
        )
        results.append(
            {**info, "rows": {"ckptconv hf-to-dcp dry-run": {k: row[k] for k in ("seconds", "peak_gib")}}}
        )
    (args.workdir / "bench_plan.json").write_text(json.dumps(results, indent=1))
    if args.out:
        write_results(args.out, "planning", results, command_line())
    print(f"results: {args.workdir / 'bench_plan.json'}")
    return 0
