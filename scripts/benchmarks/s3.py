"""Benchmark dcp-to-hf from and to object storage against the three-pass way, on a local S3 server.

A local S3 server (moto's standalone server, in its own process) holds the benchmark's DCP checkpoint
(made by the convert benchmark's generator, FSDP2 on 2 ranks, cached in WORKDIR). Measured, each as a fresh
process with its wall time and peak RSS:

  direct            `ckptconv dcp-to-hf s3://bench/ckpt s3://bench/direct`: ranged reads in, multipart out
  3-pass get        the backend's own `get` of the checkpoint prefix to local disk (s3fs)
  3-pass convert    `ckptconv dcp-to-hf` of that local copy to local disk
  3-pass put        the backend's own `put` of the result to the bucket
  local convert     the same conversion with the checkpoint already on local disk (peak memory reference)

and from the direct run's --json report: bytes fetched over bytes needed (the records of the model's chunks
and of the stashed items; goal at most 1.05) and GET requests per GB fetched. The three passes' times add up
to the baseline; the ratio is direct / baseline. Results go to WORKDIR/bench_s3.json and are printed, and
with `--out FILE` to the results file (the rows of other sizes and rank counts already in FILE are kept).

usage: python scripts/bench.py s3 [--workdir /tmp/bench] [--size-gb 1] [--nproc 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .checkpoints import ensure_checkpoint
from .runner import Sample, command_line, log, options, run_measured, write_results

KEY = {"key": "bench-key", "secret": "bench-secret"}
OPTIONS = options(with_runs=False)  # one run of each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's server did not start")


def needed_bytes(ckpt: Path) -> int:
    """What dcp-to-hf must read: the model's chunk records and the stashed items' records."""
    from ckptconv.formats.dcp import open_dcp

    local = open_dcp(ckpt)
    model = sum(c.byte_length for t in local.tensors.values() if t.fqn.startswith("model.") for c in t.chunks)
    return model + sum(i.byte_length for i in local.items.values())


def ckptconv(nproc: int) -> list[str]:
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "ckptconv"]  # fmt: skip
    return [sys.executable, "-m", "ckptconv"]


def s3_call(endpoint: str, what: str, src: str, dst: str) -> list[str]:
    """A subprocess doing s3fs's own recursive `get` or `put` (or making the bucket)."""
    call = f"fs.{what}(sys.argv[4],sys.argv[5],recursive=True)"
    if what == "mkdir":
        call = "fs.mkdir(sys.argv[4])"
    code = (
        "import s3fs,sys;fs=s3fs.S3FileSystem(key=sys.argv[1],secret=sys.argv[2],endpoint_url=sys.argv[3]);"
        + call
    )
    return [sys.executable, "-c", code, KEY["key"], KEY["secret"], endpoint, src, dst]


def report_of(logfile: Path) -> dict[str, Any]:
    text = logfile.read_text()
    return json.loads(text[text.index("\n{") + 1 :])  # after the "$ command" line: the --json document


def ranged_get_seconds(endpoint: str, ckpt: Path) -> dict[str, float]:
    """What the server takes for one ranged GET of 22 bytes and of 8 MB of the largest object: a server
    that reads the whole object per request (moto's) makes many small requests cost like large ones."""
    import s3fs

    fs = s3fs.S3FileSystem(**KEY, endpoint_url=endpoint)
    big = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    out = {"object_mb": round(big.stat().st_size / 1e6, 1)}
    for label, n in (("22_bytes", 22), ("8_mb", 8 << 20)):
        t0 = time.perf_counter()
        for i in range(3):
            fs.cat_file(f"bench/ckpt/{big.name}", start=i * 4096, end=i * 4096 + n)
        out[label] = round((time.perf_counter() - t0) / 3, 3)
    return out


def row(name: str, sample: Sample) -> dict[str, Any]:
    return {
        "method": name,
        "seconds": round(sample.seconds, 2),
        "rss_rank_gib": round(sample.rss_rank / 2**30, 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench"))
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--nproc", type=int, default=1)


def main(args: argparse.Namespace) -> int:
    workdir: Path = args.workdir
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ckpt = ensure_checkpoint(workdir, args.size_gb, "dense", env)
    logs = workdir / "logs"
    server, endpoint = start_server()
    storage_options = json.dumps({**KEY, "endpoint_url": endpoint})
    try:
        # in a subprocess: this process stays small, and the children measured do not inherit its RSS
        log(f"uploading {ckpt} to s3://bench/ckpt ...")
        subprocess.run(s3_call(endpoint, "mkdir", "bench", ""), check=True)
        run_measured(s3_call(endpoint, "put", str(ckpt), "bench/ckpt"), logs / "s3-upload.log", env)
        rows = []
        base = [*ckptconv(args.nproc), "dcp-to-hf"]
        direct = run_measured(
            [
                *base,
                "s3://bench/ckpt",
                "s3://bench/direct",
                "--storage-options",
                storage_options,
                "--quiet",
                "--json",
            ],
            logs / "s3-direct.log",
            env,
        )
        rows.append(row("direct s3 -> s3", direct))
        report = report_of(logs / "s3-direct.log")
        local_copy, local_out = workdir / "s3-get", workdir / "s3-out"
        for path in (local_copy, local_out):
            shutil.rmtree(path, ignore_errors=True)
        get = run_measured(s3_call(endpoint, "get", "bench/ckpt", str(local_copy)), logs / "s3-get.log", env)
        convert = run_measured(
            [*base, str(local_copy), str(local_out), "--quiet"], logs / "s3-convert.log", env
        )
        put = run_measured(
            s3_call(endpoint, "put", str(local_out), "bench/threepass"), logs / "s3-put.log", env
        )
        rows += [row("3-pass get", get), row("3-pass convert", convert), row("3-pass put", put)]
        baseline = get.seconds + convert.seconds + put.seconds
        needed = needed_bytes(ckpt)
        get_cost = ranged_get_seconds(endpoint, ckpt)
        fetched = sum(r["bytes_fetched"] for r in report["ranks"])
        requests = sum(r["requests"] for r in report["ranks"])
        result = {
            "size_gb": args.size_gb,
            "nproc": args.nproc,
            "rows": rows,
            "three_pass_seconds": round(baseline, 2),
            "direct_over_three_pass": round(direct.seconds / baseline, 3),
            "fetched_over_needed": round(fetched / needed, 4),
            "requests_per_gb": round(requests / (fetched / 1e9), 1),
            "direct_rss_over_local": round(direct.rss_rank / convert.rss_rank, 2),
            "server_ranged_get_seconds": get_cost,
            "date": time.strftime("%Y-%m-%d"),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
    (workdir / "bench_s3.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"  {r['method']:18s} {r['seconds']:8.2f} s  {r['rss_rank_gib']:7.3f} GiB/rank")
    print(
        f"  direct / three passes: {result['direct_over_three_pass']}x "
        f"({direct.seconds:.2f} s / {baseline:.2f} s)"
    )
    print(f"  bytes fetched / needed: {result['fetched_over_needed']} (goal <= 1.05)")
    print(f"  GET requests per GB: {result['requests_per_gb']}")
    print(f"  peak RSS per rank, direct / local convert: {result['direct_rss_over_local']}")
    cost = result["server_ranged_get_seconds"]
    print(
        f"  the server's ranged GET of a {cost['object_mb']} MB object: {cost['22_bytes']} s for 22 bytes, "
        f"{cost['8_mb']} s for 8 MB"
    )
    if args.out:
        write_results(args.out, "s3", [result], command_line(), merge=lambda r: (r["size_gb"], r["nproc"]))
    return 0
