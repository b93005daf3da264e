"""The shared runner of the benchmarks.

- `run_measured`: one command as a fresh subprocess under a memory monitor: wall time, peak RSS of the
  largest process of its tree (a rank, not the launcher above it) and of the whole tree, sampled every
  POLL_SECONDS (`Sample`; `CommandFailed` when it exits non-zero).
- `run_interleaved`: several methods' commands, each `runs` times, interleaved run by run (`Result`: the
  samples, the median time, the peak RSS over the runs); with `cold`, the page cache dropped before each run
  (`drop_caches`), and each sample says whether it was.
- `log` (progress to stderr), `remove`, `dir_bytes`.
- `options`: the argparse parent every benchmark shares (`--runs`, `--out FILE`), and `write_results`: the
  results file `--out` writes: the benchmark's rows with the machine, the versions and the date, as JSON.
  docs/benchmarks/*.json hold the published ones; the docs site plots them (scripts/mkdocs_hooks.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

POLL_SECONDS = 0.02
GIB = 1024**3
ROOT = Path(__file__).resolve().parent.parent.parent
VERSIONS = ("ckptconv", "torch", "safetensors", "transformers", "peft", "compressed-tensors")


def log(msg: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class TreeMonitor(threading.Thread):
    """Samples the RSS of a process and all its descendants until stopped; keeps the peaks."""

    def __init__(self, pid: int) -> None:
        super().__init__(name=f"rss-monitor-{pid}", daemon=True)
        self.pid = pid
        self.peak_leaf = 0  # largest single leaf process (a worker, not the launcher above it)
        self.peak_sum = 0  # largest sum over the whole tree
        self.max_procs = 0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop_event.is_set():
            self._sample(root)
            self._stop_event.wait(POLL_SECONDS)

    def _sample(self, root: psutil.Process) -> None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss: dict[int, int] = {}
        parents: set[int] = set()
        for p in procs:
            try:
                with p.oneshot():
                    rss[p.pid] = p.memory_info().rss
                    parents.add(p.ppid())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not rss:
            return
        leaves = [v for pid, v in rss.items() if pid not in parents]
        self.peak_leaf = max(self.peak_leaf, *leaves) if leaves else self.peak_leaf
        self.peak_sum = max(self.peak_sum, sum(rss.values()))
        self.max_procs = max(self.max_procs, len(rss))


@dataclass
class Sample:
    seconds: float
    rss_rank: int  # bytes: peak RSS of the largest worker process
    rss_sum: int  # bytes: peak of the summed RSS of the process tree
    maxrss_kernel: int  # bytes: wait4 ru_maxrss, the largest process of the tree (launcher included)
    procs: int  # most processes seen at once in the tree
    cold: bool = False  # the page cache was dropped just before this run


class CommandFailed(RuntimeError):
    pass


def run_measured(argv: Sequence[str], logfile: Path, env: dict[str, str]) -> Sample:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("wb") as logf:
        logf.write(("$ " + " ".join(argv) + "\n").encode())
        logf.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        monitor = TreeMonitor(proc.pid)
        monitor.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        monitor.stop()
    if proc.returncode != 0:
        tail = logfile.read_text(errors="replace").strip().splitlines()[-15:]
        raise CommandFailed(f"exit {proc.returncode}: {' '.join(argv)}\n  " + "\n  ".join(tail))
    kernel = usage.ru_maxrss * 1024  # KiB on Linux
    if monitor.max_procs <= 1:  # one process (or too short to sample): the kernel's high-water mark is exact
        return Sample(seconds, max(monitor.peak_leaf, kernel), max(monitor.peak_sum, kernel), kernel, 1)
    return Sample(seconds, monitor.peak_leaf, monitor.peak_sum, kernel, monitor.max_procs)


# ------------------------------------------------------------------------------------------------------------
# Several methods, interleaved run by run


@dataclass
class Result:
    """One method's runs: the samples, or the error of the run that failed (later runs are skipped)."""

    method: str
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None
    not_cold: str | None = None  # asked for cold runs: why one was not (the page cache could not be dropped)

    @property
    def cache(self) -> str:
        """The runs' page cache: "cold" when every run started with it dropped, else "warm"."""
        return "cold" if self.samples and all(s.cold for s in self.samples) else "warm"

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples)

    @property
    def seconds(self) -> float:
        """The median wall time of the runs."""
        return statistics.median(s.seconds for s in self.samples)

    @property
    def rss_rank(self) -> int:
        """The peak over the runs of the largest worker process's RSS."""
        return max(s.rss_rank for s in self.samples)

    @property
    def rss_sum(self) -> int:
        return max(s.rss_sum for s in self.samples)


@dataclass(frozen=True)
class Command:
    """A method's command line. `out` (its output) is removed before each run, and after it unless `keep`."""

    key: str
    label: str
    argv: list[str]
    log: Path  # the last run's output
    out: Path | None = None
    keep: bool = False


def kept_commands(methods: dict[str, list[str]], workdir: Path, name: str) -> list[Command]:
    """One Command per method, `{out}` in its argv replaced by its own output WORKDIR/NAME-out-I, kept after
    each run (for comparing outputs), its log WORKDIR/logs/NAME-METHOD.log."""
    return [
        Command(
            method,
            method,
            [a.replace("{out}", str(workdir / f"{name}-out-{i}")) for a in argv],
            workdir / "logs" / f"{name}-{method.replace(' ', '_')}.log",
            workdir / f"{name}-out-{i}",
            keep=True,
        )
        for i, (method, argv) in enumerate(methods.items())
    ]


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_caches() -> str | None:
    """`sync; echo 3 > /proc/sys/vm/drop_caches`: written-back pages, then the clean page cache, dentries and
    inodes dropped, so the next run reads its input (and the interpreter's files) from the device. None, or
    why it could not (not root, a read-only /proc in a container)."""
    os.sync()
    try:
        with DROP_CACHES.open("w") as f:
            f.write("3\n")
    except OSError as e:
        return f"could not drop the page cache: writing {DROP_CACHES}: {e.strerror or e} (needs root)"
    return None


def run_interleaved(
    commands: Sequence[Command], runs: int, env: dict[str, str], tag: str, cold: bool = False
) -> dict[str, Result]:
    """Each command `runs` times, the methods interleaved run by run, every run a fresh process; outputs are
    removed and `sync` called between runs, outside the timed region, so no run pays for an earlier run's
    write-back. With `cold`, the page cache is dropped there too (`drop_caches`); a run it could not be
    dropped for is marked warm, with the reason in its Result's `not_cold`. A method whose run fails keeps
    its error and is not run again."""
    results = {c.key: Result(c.key) for c in commands}
    for run in range(1, runs + 1):
        for c in commands:
            r = results[c.key]
            if r.error is not None:
                continue
            if c.out is not None:
                remove(c.out)
                c.out.parent.mkdir(parents=True, exist_ok=True)
            os.sync()
            why = drop_caches() if cold else None
            if why is not None and r.not_cold is None:
                r.not_cold = why
                log(f"{tag} {c.label}: NOT cold: {why}")
            try:
                s = run_measured(c.argv, c.log, env)
                s.cold = cold and why is None
            except CommandFailed as e:
                r.error = str(e)
                log(f"{tag} run {run}/{runs} {c.label}: FAILED {e}")
                continue
            finally:
                if c.out is not None and not c.keep:
                    remove(c.out)
            r.samples.append(s)
            log(
                f"{tag} run {run}/{runs}{' cold' if s.cold else ''} {c.label:<24} {s.seconds:7.2f} s  "
                f"RSS/rank {s.rss_rank / GIB:5.2f} GiB  sum {s.rss_sum / GIB:5.2f} GiB"
            )
    return results


# ------------------------------------------------------------------------------------------------------------
# Options and the results file


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {n}")
    return n


def options(runs: int | None = 3, *, with_runs: bool = True, default: str = "") -> argparse.ArgumentParser:
    """The options every benchmark takes: `--out FILE`, and `--runs N` where it repeats its methods (default
    `runs`; None: the benchmark picks it, as `default` says)."""
    parent = argparse.ArgumentParser(add_help=False)
    if with_runs:
        default = f" (default {default or runs})" if default or runs is not None else ""
        parent.add_argument(
            "--runs",
            type=positive_int,
            default=runs,
            help=f"runs per method; the median is reported{default}",
        )
    parent.add_argument(
        "--out", type=Path, metavar="FILE", help="also write the results as JSON (machine, versions, date)"
    )
    return parent


def command_line() -> str:
    """How this run was started, for the results file: `scripts/bench.py NAME OPTIONS`."""
    return " ".join(["scripts/bench.py", *sys.argv[1:]])


def machine() -> dict[str, Any]:
    """The machine results were measured on, as every results file records it."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **({"gpus": gpus} if gpus else {}),  # a CUDA machine's (scripts/gpu.sh); none on this project's
    }


def write_results(
    path: Path, benchmark: str, results: Any, command: str, merge: Callable[[Any], Any] | None = None
) -> None:
    """`results` (the benchmark's own rows) in the envelope the plots read. With `merge` (a row -> its key),
    the rows of an existing file whose key no new row has are kept: one file for several invocations. Then
    each row names the command that made it, and the file's `command` is every one of them."""
    if merge is not None:
        results = [{**r, "command": command} for r in results]
        if path.exists():
            new = {merge(r) for r in results}
            kept = [r for r in json.loads(path.read_text())["results"] if merge(r) not in new]
            results = kept + results
        command = " and ".join(dict.fromkeys(r.get("command", "an earlier command") for r in results))
    versions: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    doc = {
        "benchmark": benchmark,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": machine(),
        "versions": versions,
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"wrote {path}")
