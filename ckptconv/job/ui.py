"""Where messages go: logs, warnings and progress to stderr (rank 0, or any rank for its own warnings)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ckptconv.job.env import env_float


def human_bytes(n: int) -> str:
    """1234567 -> '1.23 MB' (powers of ten, as sizes are given on the command line)."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{n} B"


@dataclass
class Ui:
    rank: int = 0
    quiet: bool = False
    progress: bool | None = None  # None: a bar only when stderr is a terminal
    console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False, soft_wrap=True))
    warnings: list[str] = field(default_factory=list)

    def info(self, message: str) -> None:
        if self.rank == 0 and not self.quiet:
            self.console.print(message, markup=False)

    def warn(self, message: str, *, every_rank: bool = False) -> None:
        """A warning; computed identically on every rank unless `every_rank`, so printed by rank 0 only."""
        self.warnings.append(message)
        if self.rank == 0 or every_rank:
            prefix = f"[rank {self.rank}] " if every_rank and self.rank else ""
            self.console.print(f"warning: {prefix}{message}", style="yellow", markup=False)

    @contextmanager
    def bytes_progress(self, label: str, total: int) -> Iterator[ProgressHook]:
        """Rank 0's progress over `total` bytes: a bar on a terminal (or --progress), otherwise a plain log
        line every CKPTCONV_LOG_EVERY_S seconds (default 10) for logs of batch jobs; nothing with --quiet."""
        show = self.progress if self.progress is not None else sys.stderr.isatty()
        if self.rank != 0 or self.quiet or self.progress is False:
            yield ProgressHook(None, None)
            return
        if not show:
            yield LogProgress(None, None, self.console, label, total)
            return
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        with bar:
            yield ProgressHook(bar, bar.add_task(label, total=total))


@dataclass
class ProgressHook:
    bar: Progress | None
    task: object

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, nbytes)  # type: ignore[arg-type]


class LogProgress(ProgressHook):
    def __init__(self, bar: None, task: None, console: Console, label: str, total: int) -> None:
        super().__init__(bar, task)
        self.console, self.label, self.total, self.done = console, label, total, 0
        self.every = env_float("CKPTCONV_LOG_EVERY_S", 10.0)
        self.start = self.last = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.last >= self.every and self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            self.console.print(
                f"{self.label}: {100 * self.done / self.total:.0f}% "
                f"({human_bytes(self.done)} of {human_bytes(self.total)}, {human_bytes(int(rate))}/s)",
                markup=False,
            )
