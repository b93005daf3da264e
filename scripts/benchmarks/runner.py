"""Running one benchmark command under a memory monitor: wall time, peak RSS of the largest process of its
tree (a rank, not the launcher above it) and of the whole tree, sampled every POLL_SECONDS."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

POLL_SECONDS = 0.02


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
