"""Benchmark `--resume`: what a conversion interrupted late costs to finish, against running it again.

For each direction, on the conversion benchmark's checkpoints (dense fp32, --size GB, made once in WORKDIR):

  full          the conversion, uninterrupted (after one run that warms the page cache, not timed)
  resumed@P     the same conversion stopped by SIGTERM once P% of its files are recorded as finished (as a
                scheduler's preemption would), then rerun with `--resume`: the time of that rerun
  rerun@P       after the same interruption, the conversion run again from zero (`--overwrite`), what users
                do without --resume

Each is run --runs times, interleaved, after `sync`: the full run and each stopped run from a clean OUT, the
resumed and the rerun from their stopped run's staging; the medians are reported.
dcp-to-hf writes bf16 shards of --file-size (`--max-shard-size`), hf-to-dcp data files of --file-size
(`--max-file-size`), so that a run finishes files all along. Each row reports the seconds, the files the
resumed run kept, and the ratios resumed/rerun (what --resume saves a user whose run was stopped) and
resumed/full (against a run on a clean machine). That the resumed output is the uninterrupted run's bytes is
the tests' to show (tests/jobs/test_resume.py), not this benchmark's.

usage: .venv/bin/python scripts/bench.py resume --size 2 --file-size 250MB --at 50
       .venv/bin/python scripts/bench.py resume --size 4 --at 50,75 --out docs/benchmarks/resume.json
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from .checkpoints import ensure_checkpoint, ensure_hf
from .methods import PY
from .runner import command_line, log, options, remove, run_measured, write_results
from .suite import environment

OPTIONS = options(3)
Env = dict[str, str]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=float, default=4.0, help="GB of fp32 weights (default 4)")
    p.add_argument("--file-size", default="250MB", help="output file size, HF notation (default 250MB)")
    p.add_argument("--at", default="50,75", help="%% of the files recorded when the run is stopped (50,75)")
    p.add_argument("--workdir", type=Path, default=Path("bench-out"), help="where checkpoints and output go")


def _records(out: Path) -> int:
    """The files the records in OUT's staging directory say are finished (a file's ranks: one record each)."""
    from ckptconv.publish.outdir import staging_dir
    from ckptconv.publish.records import NAME, RECORDS

    folder = staging_dir(out) / RECORDS
    if not folder.is_dir():
        return 0
    return len({p.name.rsplit(".r", 1)[0] for p in folder.iterdir() if NAME.fullmatch(p.name)})


def _stopped(argv: list[str], out: Path, files: int, percent: int, env: dict[str, str], log_to: Path) -> bool:
    """Run `argv` and SIGTERM it once `percent`% of its `files` are recorded; whether it was stopped (exit
    143) rather than finished first (its last files can finish together: nothing to stop between them)."""
    want = max(1, files * percent // 100)
    if want >= files:  # every file recorded: nothing left to stop before
        return False
    with log_to.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        while _records(out) < want and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    subprocess.run(["sync"], check=False)  # its write-back is not the next run's to pay
    if code == 0:
        return False
    if code != 128 + signal.SIGTERM:
        raise SystemExit(f"{argv}: exit {code} after SIGTERM, not 143 (see {log_to})")
    return True


def _direction(
    name: str, src: Path, out: Path, flags: list[str], at: list[int], runs: int, env: Env, logs: Path
) -> dict[str, Any]:
    """`runs` times, interleaved: the full run, then for each stopping point a stopped run finished with
    --resume and one run again from zero; the medians."""
    argv = [PY, "-m", "ckptconv", name, str(src), str(out), *flags, "--quiet"]
    remove(out)
    run_measured(argv, logs / f"{name}-warm.log", env)  # warms the page cache, untimed
    files = len([p for p in out.iterdir() if p.suffix in (".safetensors", ".distcp")])
    full: list[float] = []
    resumed: dict[int, list[float]] = {p: [] for p in at}
    rerun: dict[int, list[float]] = {p: [] for p in at}
    kept: dict[int, list[int]] = {p: [] for p in at}
    for run in range(runs):
        _clean(out)  # (replacing a previous result is not what is measured)
        full.append(run_measured(argv, logs / f"{name}-full{run}.log", env).seconds)
        for percent in at:
            for again in (False, True):
                _clean(out)
                stop_log = logs / f"{name}-stop{percent}-{run}-{'again' if again else 'kept'}.log"
                if not _stopped(argv, out, files, percent, env, stop_log):
                    log(f"{name}: finished before {percent}% of its files were seen recorded")
                    continue
                flag = "--overwrite" if again else "--resume"
                if not again:
                    kept[percent].append(_records(out))
                took = run_measured([*argv, flag], logs / f"{name}{flag}-{percent}-{run}.log", env).seconds
                (rerun if again else resumed)[percent].append(took)
        log(f"{name}: run {run + 1} of {runs} done")
    _clean(out)
    best = statistics.median(full)
    log(f"{name}: full {best:.2f}s ({files} files)")
    row: dict[str, Any] = {"direction": name, "files": files, "full_s": round(best, 2), "stopped": []}
    for percent in at:
        if not resumed[percent] or not rerun[percent]:
            continue
        took, again = statistics.median(resumed[percent]), statistics.median(rerun[percent])
        row["stopped"].append(
            {
                "at_percent": percent,
                "kept_files": min(kept[percent]),
                "resumed_s": round(took, 2),
                "rerun_s": round(again, 2),
                "resumed_over_rerun": round(took / again, 2),
                "resumed_over_full": round(took / best, 2),
            }
        )
    return row


def _clean(out: Path) -> None:
    """No OUT nor staging left, and nothing of the last run's left to write back."""
    from ckptconv.publish.outdir import staging_dir

    remove(out)
    remove(staging_dir(out))
    subprocess.run(["sync"], check=False)


def main(args: argparse.Namespace) -> int:
    env, work = environment(), args.workdir.resolve()
    logs = work / "logs" / "resume"
    logs.mkdir(parents=True, exist_ok=True)
    at = [int(p) for p in args.at.split(",") if p.strip()]
    ckpt = ensure_checkpoint(work, args.size, "dense", env)
    hf = ensure_hf(work, args.size, "dense", env)
    shards = ["--dtype", "bf16", "--max-shard-size", args.file_size]
    files = ["--max-file-size", args.file_size]
    results = [
        _direction("dcp-to-hf", ckpt, work / "out" / "resume-hf", shards, at, args.runs, env, logs),
        _direction("hf-to-dcp", hf, work / "out" / "resume-dcp", files, at, args.runs, env, logs),
    ]
    print("direction   stopped at  kept  full s  resumed s  rerun s  /rerun   /full")
    for r in results:
        for s in r["stopped"]:
            ratios = f"{s['resumed_over_rerun']:>7} {s['resumed_over_full']:>7}"
            print(
                f"{r['direction']:10} {s['at_percent']:>10}% {s['kept_files']:>5} {r['full_s']:>7} "
                f"{s['resumed_s']:>10} {s['rerun_s']:>8} {ratios}"
            )
    if args.out:
        write_results(args.out, "resume", results, command_line())
    return 0
